"""Attention in rooms: `interface` hooks rope-ext into transformers' AttentionInterface (what family
adapters use); `rotator` holds the rotator that transforms rotating inside attention are handed
(the forward's frame, the geometry, the kept keys of `keys`); `schedule` the dynamic methods'
transform; `parts` the split-softmax kernels attention-side methods build on. The names below keep
`rope_ext.attention.X` working for every X of them."""

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
from .keys import RotatedKeys
from .parts import (
    SCORE_BYTES,
    attend_one_row,
    attend_with_lse,
    attend_with_lse_by_scores,
    causal_mask,
    exact_rows,
    hides_keys,
    merge_by_lse,
    window_parts,
)
from .rotator import KeyMaps, RotatingTransform, Rotator
from .schedule import RotateInAttention

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
    "attend_one_row",
    "attend_with_lse",
    "attend_with_lse_by_scores",
    "causal_mask",
    "exact_rows",
    "hides_keys",
    "merge_by_lse",
    "window_parts",
    "RotatedKeys",
    "KeyMaps",
    "Rotator",
    "RotatingTransform",
    "RotateInAttention",
]
