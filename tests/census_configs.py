"""The tiny random models of the census (tests/patches/test_census.py): every causal-LM architecture of the
installed transformers, built small enough that the census checks all of them in a few minutes on
one core.

`config_for(model_type)` is the config: SHRINK (2 layers, hidden 64, 4 heads of 16, vocab 128,
window 64) for every config, plus the type's entry in OVERRIDES, where SHRINK alone does not build a
tiny model of it or leaves it too big. A composite config (a text config beside vision or audio
ones) gets SHRINK and its entry's part in every sub-config: the text model of a vision-language
checkpoint is what the causal LM runs. `tiny(model_type)` is the model, with its norm weights moved
away from 1, or None when it has no rotary embedding. NOT_BUILT names the rotary architectures no
config builds here, with the reason."""

from __future__ import annotations

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

WINDOW = 64
VOCAB = 128
# The tiny shape every config is built with; keys a config does not know become unused attributes.
SHRINK = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=WINDOW,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    shared_expert_intermediate_size=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
# A model over this is not built: a config that ignores the shrink would slow the census by minutes.
MAX_PARAMETERS = 3_000_000
UNSET = object()  # an override that takes a SHRINK key out of the config's arguments

# Multi-head latent attention keeps its own head sizes, which SHRINK's head_dim does not reach (the
# defaults make a 2-layer model of 4-30M parameters). Its rotary module is sized by head_dim, so
# the rotated part of the head is head_dim wide; each head has its own keys (with 2 key heads of
# SHRINK the shapes do not meet); one dense layer then one MoE layer; one routing group for 4
# experts; the sparse-attention indexer of the DSA models small, but keeping every key of the
# census's sequences: below their length transformers' own decoding differs from its full forward
# (by 0.02-0.05 unpatched, top-k 16), so decode == full forward could not hold for any patch.
# tests/patches/test_mla.py checks a top-k below the length, where the indexer refuses the methods that
# rotate inside attention.
MLA = dict(
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    index_topk=128,
    index_head_dim=16,
    index_n_heads=2,
)
MLA_TYPES = (
    "axk1 axk2 deepseek_v2 deepseek_v3 deepseek_v32 glm4_moe_lite glm_moe_dsa hy_v4 longcat_flash minicpm3 sarvam_mla youtu"
).split()
# Hybrids of linear attention (gated delta net) and softmax attention put one softmax layer in
# three or five: the first two layers would be linear attention only, and a cache with no attention
# layer cannot tell its length (`get_seq_length` raises). One of each, and linear heads of SHRINK's size.
LINEAR = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
# Qwen4-Exp's softmax layers are indexed attention, which needs every field of its token indexer;
# its budget of keys is under the probe's 8 tokens, as the released one (2048) is under its window,
# so the keys the indexer selects count. Its hyper-connections' low rank (320 by default) is most
# of the model otherwise.
QWEN4_EXP = dict(
    LINEAR,
    hc_lowrank=32,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=4,
    indexer_compress_ratio=2,
)
# Gemma 4's per-layer input embeddings have a vocabulary of their own (134M parameters by default).
GEMMA4_TEXT = {"vocab_size_per_layer_input": VOCAB}
# dots3 note preview: MLA with a rotated share qk_rope_head_dim / head_dim of a 32-wide head, and no
# sliding-window layers (their own MLA sizes sit in a per-layer config of the released shapes).
DOTS3_TEXT = dict(MLA, head_dim=32, use_sliding_window=False)

SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]

OVERRIDES: dict[str, dict] = {
    **{model_type: MLA for model_type in MLA_TYPES},
    # hybrids: a layer of each kind (see LINEAR)
    "bailing_hybrid": {**MLA, "layer_types": ["linear_attention", "full_attention"]},
    "bamba": {"attn_layer_indices": [1]},
    "lfm3": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # no default layer types
    "qwen3_next": LINEAR,
    "qwen3_5_text": LINEAR,
    "qwen3_5_moe_text": LINEAR,
    "qwen3_5": {"text_config": LINEAR},
    "qwen3_5_moe": {"text_config": LINEAR},
    "qwen4_exp_text": QWEN4_EXP,
    "qwen4_exp": {"text_config": QWEN4_EXP},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "zaya": {"num_experts_per_tok": 1},  # ZAYA routes to one expert only
    # rotary_dim (64 by default) is wider than a 16-channel head
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    "falcon": {"head_dim": UNSET},  # a read-only property (hidden_size // heads)
    # DBRX names its sizes its own way; its attention reads attn_config.rope_theta, which
    # DbrxAttentionConfig does not define, and clamps with clip_qkv, which may not be None.
    "dbrx": {
        "d_model": 64,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_top_k": 2},
    },
    "dots3_note_text": DOTS3_TEXT,
    # the vision and audio adapters must meet the text hidden size; the vision tower's MoE schedule
    # is a per-layer config of its 42 released layers unless its layers are named
    "dots3_note": {
        "text_config": DOTS3_TEXT,
        "vision_config": {"adapter_in_dim": 64, "adapter_out_dim": 64, "mlp_layer_types": ["dense", "dense"]},
        "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64},
    },
    # rope_parameters keyed by layer type, with an M-RoPE section of head_dim / 2 channels
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}}
    },
    # Gemma 3n: its last 15 layers reuse an earlier layer's KV cache by default (more than 2 layers
    # hold), and its per-layer input embeddings have a vocabulary of their own
    "gemma3n_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": VOCAB},
    "gemma4_text": GEMMA4_TEXT,
    # the text's per-layer inputs, the vision position table and the audio projection (2.6M
    # parameters with the text's alone)
    "gemma4": {
        "text_config": GEMMA4_TEXT,
        "audio_config": {"output_proj_dims": 64},
        "vision_config": {"position_embedding_size": 64},
    },
    "gemma4_unified": {"vision_config": {"mm_embed_dim": 64}},  # the vision embedder's width (35M parameters)
    # the drafter takes no per-layer inputs: its config's validation refuses the default text config's
    "gemma4_assistant": {
        "text_config": {"model_type": "gemma4_text", "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    },
    # the SAM vision tower's neck channels, which the projector's convolutions widen (3.3M parameters)
    "got_ocr2": {"vision_config": {"output_channels": 16}},
    "moshi": {"ffn_dim": 128},  # its own name for the MLP width
    # Their default layer pattern makes both of the census's 2 layers sliding ones (the full-attention
    # layer comes sixth, or fourth), leaving no layer of the type a patch replaces: one of each.
    "gemma3_text": {"layer_types": SLIDING_THEN_FULL},
    "gemma3": {"text_config": {"layer_types": SLIDING_THEN_FULL}},
    "olmo3": {"layer_types": SLIDING_THEN_FULL},
    # Its partial rotary factor 0.334 rotates 64 of the released 192-wide heads' channels; of a
    # 16-wide head it would be 5, an odd count transformers' exponents run over (which no rotary
    # geometry states). A 24-wide head keeps the released share: 8 channels.
    "mimo_v2_flash": {"head_dim": 24},
    # the audio encoder's convolution widths (1024 by default: 11M parameters)
    "phi4_multimodal": {
        "audio_config": {
            "num_blocks": 2,
            "ext_pw_out_channel": 64,
            "depthwise_separable_out_channel": 64,
            "nemo_conv_channels": 64,
        }
    },
    # byte n-gram hash embeddings (500k rows by default) and the global width the local models meet
    "blt": {"encoder_hash_byte_group_vocab": 64, "decoder_config": {"hidden_size_global": 64}},
}
# Speculative-decoding drafters: their forward takes the target model's embeddings and KV states,
# not token ids, so they are built without the token forward (patch() decides on them as on any).
DRAFTERS = ("gemma4_assistant", "gemma4_unified_assistant")
# The rotary causal LMs of transformers 5.24 that no config builds here.
NOT_BUILT = {
    "gemma3n": "its vision tower is a timm model, and timm is not a dependency of rope-ext "
    "(its text model, gemma3n_text, is built)",
}


def ids(length: int, seed: int = 0) -> torch.LongTensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, x):
    return model(x).logits


def norms_moved(model):
    """`model` with its norm weights moved away from 1 (seeded), so that a rotation that does not
    commute with a norm is seen."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name and weight.dim() == 1:
                weight.add_(0.1 * torch.randn(weight.shape, generator=generator))
    return model


def config_for(model_type: str, **overrides):
    """The tiny config of `model_type`: SHRINK, its OVERRIDES entry and `overrides`, in the config
    and in each of its sub-configs (a sub-config's entry is a dict under its name)."""
    config_class = CONFIG_MAPPING[model_type]
    wanted = {**SHRINK, **OVERRIDES.get(model_type, {}), **overrides}
    default = None
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        given = dict(wanted.get(name) or {})
        if sub_class is AutoConfig:  # the composite's default names the sub-config's type
            sub_type = given.pop("model_type", None)
            if sub_type is None:
                default = default or config_class()
                sub_type = getattr(getattr(default, name, None), "model_type", None)
                if sub_type is None:
                    continue
            sub_class = CONFIG_MAPPING[sub_type]
        wanted[name] = sub_class(**arguments({**SHRINK, **given}))
    return config_class(**arguments(wanted))


def arguments(wanted: dict) -> dict:
    return {key: value for key, value in wanted.items() if value is not UNSET}


def rotary(model) -> bool:
    """Whether `model` has a rotary embedding: a module with an `inv_freq` buffer, or one named
    rotary (GPT-J's keeps a table of sin and cos instead)."""
    return any(name.endswith("inv_freq") for name, _ in model.named_buffers()) or any(
        "rotary" in type(module).__name__.lower() for module in model.modules()
    )


def tiny(model_type: str, **overrides):
    """The tiny random fp32 model of `model_type` with its norm weights moved away from 1, or None
    when it does not build under MAX_PARAMETERS or has no rotary embedding."""
    try:
        config = config_for(model_type, **overrides)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            return None
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        if model_type not in DRAFTERS:
            with torch.no_grad():
                model(ids(8))
    except Exception:  # not a causal LM this way: the census counts what builds (test_census)
        return None
    if not rotary(model):
        return None
    return norms_moved(model)
