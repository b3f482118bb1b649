"""LongRoPE (Ding et al. 2024): a rescale factor for each rotated pair, one set for inputs inside
the trained window (`short_factor`) and one past it (`long_factor`), theta_i / lambda_i, with the
attention factor sqrt(1 + ln(s) / ln(L)) on cos and sin. The lists are the user's (or
`rope-ext search`'s): the method itself searches nothing.

The arithmetic is transformers' `_compute_longrope_parameters` in the same order and dtype, so a
single forward matches a LLaMA natively configured with `rope_type: longrope` bit for bit, and the
patch writes that `rope_parameters`. Where the three differ is the schedule under a KV cache:

- transformers picks one set per forward from its longest position: the long set once the input
  passes L tokens, for every row. With a KV cache, the keys cached before are left rotated with
  the short set (Phi-3 re-runs the whole prompt at the (L+1)th token instead; LLaMA does not);
- vLLM picks one set at start-up: the long one for every token whenever max_model_len > L;
- here (`causal=True`, the default) the row at position p uses the short set when p < L and the
  long set past it, with every key rotated inside attention with the set of the query that reads
  it, so one forward, chunked prefill and token-by-token decoding give the same logits (within
  fp32 rounding: tests/method/test_longrope.py). `causal=False` is transformers' schedule: one set per
  forward, from its longest position; under a KV cache the rows computed before keep their values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rope_ext.geometry import RotaryGeometry

from .base import MAX_FACTOR, Method, ModelFacts, Param
from .rope import ATTENTION_FACTOR

NAME = "longrope"
FACTOR_LISTS = ("short_factor", "long_factor")


def longrope_attention_factor(factor: float, window: int) -> float:
    """LongRoPE's attention factor sqrt(1 + ln(s) / ln(L)), 1 for s <= 1 (transformers' default)."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(window))


def longrope_powers(geom: RotaryGeometry) -> torch.Tensor:
    """base^(2i/D) in fp32, as transformers' longrope computes it: its frequencies are 1 / (lambda_i
    times these)."""
    return geom.base ** (torch.arange(0, geom.rotary_dim, 2, dtype=torch.int64).float() / geom.rotary_dim)


def longrope(
    geom: RotaryGeometry,
    seq_len: int | None = None,
    *,
    factor: float,
    short_factor: list[float],
    long_factor: list[float],
    attention_factor: float | None = None,
) -> tuple[torch.Tensor, float]:
    """theta_i / lambda_i with lambda = long_factor when seq_len > L, else short_factor; the same
    attention factor for both sets."""
    chosen = long_factor if seq_len and seq_len > geom.original_window else short_factor
    inv_freq = 1.0 / (torch.tensor(chosen, dtype=torch.float32) * longrope_powers(geom))
    scale = longrope_attention_factor(factor, geom.original_window) if attention_factor is None else attention_factor
    return inv_freq, scale


# A rescale factor: one that rounds to 0 or to a subnormal in fp32 (1e-40, 1e-300) would give
# infinite frequencies and NaN logits.
RESCALE = Param("rescale", kind="float", lo=1 / MAX_FACTOR, hi=MAX_FACTOR)


@dataclass(frozen=True)
class LongRopeMethod(Method):
    """The factor lists are checked as lists by their Params and against the rotary dim in
    `resolve`; `short_factor` defaults to ones (the trained frequencies inside the window)."""

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        factor, params = super().resolve(facts, geometry, factor, params)
        pairs = geometry.rotary_dim // 2
        params = {**params, "short_factor": params.get("short_factor") or [1.0] * pairs}
        for key in FACTOR_LISTS:
            if len(params[key]) != pairs:
                raise ValueError(
                    f"{self.name}: {key} has {len(params[key])} entries; this model rotates {pairs} pairs "
                    f"(rotary dim {geometry.rotary_dim})"
                )
        return factor, params

    def native(self, geometry: RotaryGeometry, factor: float, params: dict, rope: dict) -> dict:
        # transformers' own keys, also what vLLM's reader takes (docs/longrope.md); written for
        # either schedule: the plain reload is transformers' schedule (docs/longrope.md)
        temperature = {} if params["attention_factor"] is None else {"attention_factor": params["attention_factor"]}
        partial = {k: v for k, v in rope.items() if k == "partial_rotary_factor"}
        return {
            "rope_type": "longrope",
            "rope_theta": geometry.base,
            **partial,
            "factor": factor,
            "original_max_position_embeddings": geometry.original_window,
            "short_factor": list(params["short_factor"]),
            "long_factor": list(params["long_factor"]),
            **temperature,
        }


METHOD = LongRopeMethod(
    NAME,
    longrope,
    "LongRoPE: per-pair rescale factors, short inside the window, long past it",
    "theta_i / short_i at p < L, theta_i / long_i past it; cos, sin * sqrt(1 + ln s / ln L)",
    params=(
        Param(
            "short_factor", None, "list", item=RESCALE, doc="D/2 rescale factors inside the window, D the rotary dim; None: ones"
        ),
        Param(
            "long_factor", None, "list", item=RESCALE, required=True, doc="D/2 rescale factors past the window, D the rotary dim"
        ),
        ATTENTION_FACTOR,
    ),
    rotation="attention",
    follows_length=True,
    window_step=True,
)
