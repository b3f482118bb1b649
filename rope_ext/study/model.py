"""The decoder-only LMs of the study.

RoPE is transformers' own LlamaForCausalLM with a small LlamaConfig. Every other encoding runs in
`CompactDecoder`, which is that same LLaMA minus its rotary embedding: transformers'
LlamaRMSNorm and LlamaMLP, LLaMA's pre-norm residual layout, bias-free q/k/v/o projections named
as in LLaMA, an untied output head. Only the attention differs, and only by what the encoding
adds. `build_model` starts every encoding from the same LLaMA initialisation (same seed, same
weights for every shared parameter), so the encodings differ in nothing but their own parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutput
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from .encodings import COMPACT_ENCODINGS, PositionEncoding, build_encoding

ENCODINGS = (*COMPACT_ENCODINGS, "rope")


@dataclass(frozen=True)
class ModelShape:
    """The shape shared by every model of the study; `window` is the training length W."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    window: int
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "window"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=self.window,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            attn_implementation="sdpa",
        )

    def to_dict(self) -> dict:
        return asdict(self)


class EncodedAttention(nn.Module):
    """LLaMA's multi-head attention with the rotation replaced by whatever the encoding adds."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor, encoding: PositionEncoding, shared) -> torch.Tensor:
        batch, seq_len, _ = hidden_states.shape

        def heads(x):
            return x.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

        query = heads(self.q_proj(hidden_states))
        key = heads(self.k_proj(hidden_states))
        value = heads(self.v_proj(hidden_states))
        bias = encoding.attention_bias(shared, query, key, self)
        scale = encoding.attention_scale(self.head_dim)
        if bias is None:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class CompactLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = EncodedAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden_states: torch.Tensor, encoding: PositionEncoding, shared) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), encoding, shared)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class CompactBody(nn.Module):
    def __init__(self, config: LlamaConfig, encoding: PositionEncoding):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoding = encoding
        self.layers = nn.ModuleList(CompactLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class CompactDecoder(nn.Module):
    """A LLaMA-shaped decoder whose position information comes from `encoding`. Parameter names
    match LlamaForCausalLM's (model.embed_tokens, model.layers.N.self_attn.q_proj, ..., lm_head)."""

    def __init__(self, config: LlamaConfig, encoding: PositionEncoding):
        super().__init__()
        self.config = config
        self.model = CompactBody(config, encoding)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def encoding(self) -> PositionEncoding:
        return self.model.encoding

    def forward(self, input_ids: torch.LongTensor) -> CausalLMOutput:
        seq_len = input_ids.shape[1]
        self.encoding.check_length(seq_len)
        hidden = self.model.embed_tokens(input_ids)
        positions = self.encoding.embed(seq_len, input_ids.device)
        if positions is not None:
            hidden = hidden + positions
        shared = self.encoding.prepare(seq_len, input_ids.device)
        for layer in self.model.layers:
            hidden = layer(hidden, self.encoding, shared)
        return CausalLMOutput(logits=self.lm_head(self.model.norm(hidden)))


def build_model(encoding: str, shape: ModelShape, seed: int, **encoding_params) -> nn.Module:
    """The study's model for `encoding`, freshly initialised from `seed`.

    The LLaMA is always built first from the seed; a compact model then takes over all of its
    weights and initialises only the encoding's own parameters (normal, std = LLaMA's
    initializer_range), so every encoding starts from the same network."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown position encoding {encoding!r}; choose from {', '.join(ENCODINGS)}")
    torch.manual_seed(seed)
    config = shape.llama_config()
    llama = LlamaForCausalLM(config)
    if encoding == "rope":
        if encoding_params:
            raise ValueError(f"rope takes no encoding parameters here, got {sorted(encoding_params)}")
        return llama
    enc = build_encoding(encoding, shape.hidden_size, shape.num_heads, shape.window, config.initializer_range, **encoding_params)
    model = CompactDecoder(config, enc)
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    own = {name for name, _ in model.named_parameters() if name.startswith("model.encoding.")}
    if set(missing) != own or unexpected:
        raise RuntimeError(f"compact model does not mirror LLaMA: missing {missing}, unexpected {unexpected}")
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
