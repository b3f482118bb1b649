"""The position encodings of the study, one small class per family.

Each class answers up to three questions for the compact decoder in `model.py`:

- `embed(seq_len, device)`: a [seq_len, hidden] tensor added to the token embeddings (absolute
  encodings), or None.
- `prepare(seq_len, device)`: whatever the attention layers share within one forward pass (a
  bias, a bucket index), computed once, or None.
- `attention_bias(shared, query, key, attention)`: the additive attention bias of one layer,
  causal mask included (-inf on future keys), or None for plain causal attention. The bias is
  added to the logits after they are scaled by `attention_scale(head_dim)`.

A bias is one [heads, S, S] tensor built in place: at 8x the window it is the largest thing in
memory, so no second copy of it (or of an [S, S, heads] intermediate) is ever made.

RoPE has no class here: the RoPE model of the study is transformers' own LlamaForCausalLM (see
`model.py`), so that `rope_ext.patch` extends it exactly as it would extend a real LLaMA.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rope_ext.method.alibi_hybrid import alibi_slopes


def relative_distances(seq_len: int, device=None) -> torch.Tensor:
    """[seq_len, seq_len] int64 matrix of i - j (query minus key), clamped at 0 above the diagonal,
    where the causal mask hides the value anyway."""
    pos = torch.arange(seq_len, device=device)
    return (pos[:, None] - pos[None, :]).clamp_(min=0)


def future_mask(seq_len: int, device=None) -> torch.Tensor:
    """[seq_len, seq_len] bool, True where key j comes after query i."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu_(1)


class PositionEncoding(nn.Module):
    """What every family may contribute; the defaults contribute nothing."""

    name = "none"
    # The longest input the encoding can represent; None when any length works.
    max_length: int | None = None

    def check_length(self, seq_len: int) -> None:
        if self.max_length is not None and seq_len > self.max_length:
            raise ValueError(f"{self.name}: input of {seq_len} tokens, but this encoding has no positions past {self.max_length}")

    def embed(self, seq_len: int, device=None) -> torch.Tensor | None:
        return None

    def prepare(self, seq_len: int, device=None):
        return None

    def attention_bias(self, shared, query: torch.Tensor, key: torch.Tensor, attention: nn.Module):
        return shared

    def attention_scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)


class LearnedAbsolute(PositionEncoding):
    """BERT / GPT-2: one trained vector per position 0..W-1, added to the token embedding.
    There is nothing to look up past W."""

    name = "learned"

    def __init__(self, hidden_size: int, window: int):
        super().__init__()
        self.max_length = window
        self.table = nn.Embedding(window, hidden_size)

    def embed(self, seq_len: int, device=None) -> torch.Tensor:
        self.check_length(seq_len)
        return self.table.weight[:seq_len]


class Sinusoidal(PositionEncoding):
    """The original Transformer: PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...),
    added to the token embedding. Defined for every position, trained on none past W."""

    name = "sinusoidal"

    def __init__(self, hidden_size: int, rms: float, base: float = 10000.0):
        super().__init__()
        if hidden_size % 2:
            raise ValueError(f"sinusoidal encoding needs an even hidden size, got {hidden_size}")
        self.hidden_size = hidden_size
        self.base = base
        # What matters is the size of the sinusoids next to the token embeddings. Vaswani et al.
        # (and fairseq) make both O(1); with LLaMA's 0.02-std embeddings here, the table is given
        # the same RMS as the token embeddings (and a learned table) at initialisation. Unscaled
        # sinusoids swamp the tokens: in a trial at the test config's shape they gave perplexity 87
        # inside the window against 60 with this scale.
        self.amplitude = rms * math.sqrt(2)

    def embed(self, seq_len: int, device=None) -> torch.Tensor:
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None]
        inv_freq = self.base ** (-torch.arange(0, self.hidden_size, 2, device=device).float() / self.hidden_size)
        angles = pos * inv_freq
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1) * self.amplitude


class T5RelativeBias(PositionEncoding):
    """T5: a learned scalar per head and distance bucket, added to the attention logits; one table
    shared by all layers. Distances below num_buckets/2 get their own bucket, longer ones share
    log-spaced buckets up to max_distance, and every distance beyond falls in the last bucket
    (the causal, one-directional variant: all buckets serve i - j >= 0)."""

    name = "t5"

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        if num_buckets < 4 or max_distance <= num_buckets // 2:
            raise ValueError(f"t5: need num_buckets >= 4 and max_distance > num_buckets/2, got {num_buckets}, {max_distance}")
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bias = nn.Embedding(num_buckets, num_heads)

    def bucket(self, distance: torch.Tensor) -> torch.Tensor:
        exact = self.num_buckets // 2
        # clamp(min=1) only keeps log() finite for the distances the where() below discards
        log_ratio = torch.log(distance.clamp(min=1).float() / exact) / math.log(self.max_distance / exact)
        far = (exact + log_ratio * (self.num_buckets - exact)).long().clamp_(max=self.num_buckets - 1)
        return torch.where(distance < exact, distance, far)

    def prepare(self, seq_len: int, device=None) -> torch.Tensor:
        per_distance = self.bias(self.bucket(torch.arange(seq_len, device=device))).T  # [H, S]
        bias = per_distance[:, relative_distances(seq_len, device)]  # [H, S, S]
        return bias.masked_fill_(future_mask(seq_len, device), float("-inf")).unsqueeze(0)


class DebertaDisentangled(PositionEncoding):
    """DeBERTa: attention logits are the sum of content-to-content q_i.k_j, content-to-position
    q_i.Kr[d(i,j)] and position-to-content k_j.Qr[d(i,j)], scaled by 1/sqrt(3 head_dim). One table
    of relative-position embeddings is shared by all layers; each layer projects it with its own
    query and key projections (DeBERTa-v2's shared attention keys). Distances are log-bucketed as
    in DeBERTa-v2: exact below num_buckets/2, log-spaced up to max_distance, clamped beyond.

    In a causal decoder only i >= j is ever attended, so the table is one-sided: DeBERTa's
    p2c term indexes the table with the opposite sign, which here is the same bucket of a
    separate one-sided half."""

    name = "deberta"

    def __init__(self, hidden_size: int, num_buckets: int = 128, max_distance: int = 256):
        super().__init__()
        if num_buckets < 4 or max_distance <= num_buckets // 2 + 1:
            raise ValueError(
                f"deberta: need num_buckets >= 4 and max_distance > num_buckets/2 + 1, got {num_buckets}, {max_distance}"
            )
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.table = nn.Embedding(num_buckets, hidden_size)

    def bucket(self, distance: torch.Tensor) -> torch.Tensor:
        mid = self.num_buckets // 2
        log_ratio = torch.log(distance.clamp(min=1).float() / mid) / math.log((self.max_distance - 1) / mid)
        far = (torch.ceil(log_ratio * (mid - 1)) + mid).long().clamp_(max=self.num_buckets - 1)
        return torch.where(distance <= mid, distance, far)

    def prepare(self, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        buckets = self.bucket(torch.arange(seq_len, device=device))[relative_distances(seq_len, device)]
        return buckets, future_mask(seq_len, device)

    def attention_bias(self, shared, query, key, attention) -> torch.Tensor:
        buckets, future = shared
        batch, heads, seq_len, head_dim = query.shape
        # the table seen through this layer's projections: [heads, num_buckets, head_dim]
        rel_key = attention.k_proj(self.table.weight).view(self.num_buckets, heads, head_dim).transpose(0, 1)
        rel_query = attention.q_proj(self.table.weight).view(self.num_buckets, heads, head_dim).transpose(0, 1)
        index = buckets.expand(batch, heads, seq_len, seq_len)
        c2p = torch.gather(query @ rel_key.transpose(-1, -2), -1, index)  # [b, h, i, j]
        p2c = torch.gather(key @ rel_query.transpose(-1, -2), -1, index.transpose(-1, -2))  # [b, h, j, i]
        bias = c2p.add_(p2c.transpose(-1, -2)).mul_(self.attention_scale(head_dim))
        return bias.masked_fill_(future, float("-inf"))

    def attention_scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(3 * head_dim)


class Alibi(PositionEncoding):
    """ALiBi: no position parameters; each head h adds -m_h * (i - j) to its logits, with the
    geometric slopes m_h of `rope_ext.method.alibi_hybrid.alibi_slopes`."""

    name = "alibi"

    def __init__(self, num_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def prepare(self, seq_len: int, device=None) -> torch.Tensor:
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        bias = (pos[None, :] - pos[:, None]) * self.slopes[:, None, None]  # -m_h * (i - j)
        return bias.masked_fill_(future_mask(seq_len, device), float("-inf")).unsqueeze(0)


def build_encoding(name: str, hidden_size: int, num_heads: int, window: int, init_std: float, **params) -> PositionEncoding:
    """The encoding `name` for a decoder of this shape, its parameters drawn from N(0, init_std);
    `params` are the family's own settings."""
    encoding = _build(name, hidden_size, num_heads, window, init_std, params)
    for param in encoding.parameters():
        nn.init.normal_(param, std=init_std)
    return encoding


def _build(name: str, hidden_size: int, num_heads: int, window: int, init_std: float, params: dict) -> PositionEncoding:
    if name == "learned":
        return LearnedAbsolute(hidden_size, window, **params)
    if name == "sinusoidal":
        return Sinusoidal(hidden_size, rms=init_std, **params)
    if name == "t5":
        return T5RelativeBias(num_heads, **params)
    if name == "deberta":
        return DebertaDisentangled(hidden_size, **params)
    if name == "alibi":
        return Alibi(num_heads, **params)
    raise ValueError(f"unknown position encoding {name!r}; compact ones: {', '.join(COMPACT_ENCODINGS)}")


COMPACT_ENCODINGS = ("learned", "sinusoidal", "t5", "deberta", "alibi")
