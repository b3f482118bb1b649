"""Attention in three rooms: `interface` hooks rope-ext into transformers' AttentionInterface (what
family adapters use), `rotate` rotates queries and keys inside attention, `parts` holds the
split-softmax kernels attention-side methods build on. The names below keep `rope_ext.attention.X`
working for every X of the three."""

from .interface import (
    PREFIX,
    AttentionChain,
    AttentionTransform,
    BeforeDecoder,
    FlashView,
    StaticCacheError,
    backend,
    base_name,
    registered_name,
)
from .parts import (
    SCORE_BYTES,
    attend_with_lse,
    attend_with_lse_by_scores,
    causal_mask,
    exact_rows,
    hides_keys,
    merge_by_lse,
    window_parts,
)
from .rotate import RotateInAttention, RotatesWithStore

__all__ = [
    "PREFIX",
    "AttentionChain",
    "AttentionTransform",
    "BeforeDecoder",
    "FlashView",
    "StaticCacheError",
    "backend",
    "base_name",
    "registered_name",
    "SCORE_BYTES",
    "attend_with_lse",
    "attend_with_lse_by_scores",
    "causal_mask",
    "exact_rows",
    "hides_keys",
    "merge_by_lse",
    "window_parts",
    "RotateInAttention",
    "RotatesWithStore",
]
