"""rerope: ReRoPE and Leaky ReRoPE (Jianlin Su 2023, "Transformer Upgrade Road 12: ReRoPE with
Infinite Extrapolation", kexue.fm/archives/9708; reference code in github.com/bojone/rerope),
training-free.

For a query at position i and a key at position j <= i, with neighbour window w and leak k > 1:

    i - j <  w:  relative distance i - j                    (neighbour attention, the usual RoPE)
    i - j >= w:  relative distance w + (i - j - w) / k      (Leaky ReRoPE)
                 relative distance w                        (ReRoPE, k = infinity)

and both kinds of logits share one softmax. This is SelfExtend's two-part attention
(rope_ext.method.self_extend) without the floor: distant keys sit at j / k and the query at
i / k + w - w / k (ReRoPE: the keys at 0, the query at w). Positions are fractional; RoPE angles
take them as they are (computed in fp32, rope_ext.rotation.cos_sin).

ReRoPE's largest distance is w at any length, so it reaches every length. Leaky ReRoPE's largest
distance at N tokens is w + (N - 1 - w) / k (the last query and the first key); it stays within
the trained distances 0 .. L - 1 up to a capacity of floor(w + 1 + k (L - 1 - w)) tokens, L the
trained window.

Parameters:

- `window` (w): defaults to L / 4, the window of the measurement in the README of bojone/rerope
  (ReRoPE-w1024 on LLaMA-2, L = 4096; the patches there set 512). It must be below L.
- `leak` (k): None (the default) is ReRoPE; a number > 1 is Leaky ReRoPE with that leak;
  "auto" is Leaky ReRoPE with the smallest integer k >= 2 whose largest distance at
  N = ceil(factor x L) stays within L - 1, i.e. k = max(2, ceil((N - 1 - w) / (L - 1 - w)))
  (bojone/rerope's Leaky ReRoPE patch sets k = 16 for a 4096-token window).
- `causal`: as self_extend. True (the default): a query that has seen at most L tokens attends
  exactly as the unpatched model, so everything inside the trained window is unchanged and one
  forward, chunked prefill and token-by-token decoding give the same numbers. False: every query
  of a forward that goes past the window takes the rectified distances, as Su's patches do at
  every length. `granularity` does not apply.
- `logn`: True multiplies queries past L by log(i + 1) / log(L), as Su's patches also do (Qwen's
  log-n scale, docs/logn.md); False (the default) keeps the model's logit scale.

Meaning of `factor`: the length the patch is meant for, as a multiple of L (PatchInfo.max_length).
ReRoPE attends the same way at any length, so its factor only sets max_length, and ReRoPE needs
one. Leaky ReRoPE with a leak and no factor is meant for its capacity (factor = capacity / L);
with both, the factor must not exceed the capacity; leak="auto" needs a factor.

How it runs: as self_extend, by the two-part engine (rope_ext.method.attention_side) with the
distant positions above in place of the grouped ones: rows inside the window through the model's own backend,
rows past it in attention calls of the model's head size merged by log-sum-exp. A DynamicCache's
keys are kept rotated to their own and to their rectified positions (two copies of the key cache,
rope_ext.attention.keys.RotatedKeys): a decode step rotates only its query and its new key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from rope_ext.geometry import RotaryGeometry

from .attention_side import TwoPartMethod
from .base import MAX_FACTOR, FactorOr, ModelFacts, Param

NAME = "rerope"
SUMMARY = "ReRoPE / Leaky ReRoPE: exact distances inside a window, w + (d - w)/k past it (k = infinity: w)"
FORMULA = "i-j < w: distance i-j; else w + (i-j-w)/k (leak k), or w (ReRoPE, leak None); one softmax"
AUTO = "auto"  # leak: the smallest integer leak that reaches the factor
PARAMS = (
    Param("window", None, "size", lo=1, none="the default", doc="w: distances below it are exact"),
    Param(
        "leak",
        None,
        lo=1,
        lo_open=True,
        hi=MAX_FACTOR,
        none="ReRoPE",
        words=(AUTO,),
        phrase="a finite number {lower} and {upper}",
        doc="leak=None is ReRoPE, the limit of a large leak",
    ),
)
CONSTRAINTS = (
    FactorOr(
        "leak",
        "a leak (e.g. leak=8) and the factor is its capacity",
        (
            (None, "ReRoPE (leak=None) reaches any length, the factor states the length it is meant for"),
            (AUTO, f"leak={AUTO!r} picks the leak that reaches it"),
        ),
    ),
)


def capacity(window_tokens: int, window: int, leak) -> int:
    """Tokens a model trained on `window_tokens` reaches with Leaky ReRoPE at window w and leak k:
    the largest N whose largest distance w + (N - 1 - w) / k is at most L - 1."""
    return math.floor(window + 1 + Fraction(leak) * (window_tokens - 1 - window))


def largest_distance(target: int, window: int, leak) -> Fraction:
    """The largest relative distance at N = `target` tokens: w + (N - 1 - w) / k, w for ReRoPE."""
    if leak is None or target - 1 <= window:
        return Fraction(min(window, max(target - 1, 0)))
    return window + Fraction(target - 1 - window) / Fraction(leak)


def choose_leak(window_tokens: int, target: int, window: int) -> int:
    """The smallest integer leak k >= 2 whose capacity reaches `target` tokens."""
    if window >= window_tokens - 1:
        raise ValueError(
            f"{NAME}: Leaky ReRoPE at window {window} reaches only {window_tokens} tokens (its distances past the window "
            f"exceed L - 1 = {window_tokens - 1} at once); lower the window or use leak=None (ReRoPE)"
        )
    leak = max(2, math.ceil(Fraction(target - 1 - window, window_tokens - 1 - window)))
    while capacity(window_tokens, window, leak) < target:  # guards the rounding of the ceiling above
        leak += 1
    return leak


@dataclass(frozen=True)
class ReRoPEMethod(TwoPartMethod):
    """rerope's window and leak, with the rectified positions as the two-part engine's distant
    positions: keys at j / k and queries at i / k + w - w / k (fp32, fractional), or keys at 0 and
    queries at w for ReRoPE."""

    def derive(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        """(factor, params with the window and, for leak="auto", the leak filled in); ValueError,
        changing nothing, when they do not fit the model's window."""
        trained = geometry.original_window
        window = self.neighbour_window(params, trained)
        leak = params["leak"]
        if isinstance(leak, str):  # AUTO, the one string validate lets through
            leak = choose_leak(trained, math.ceil(trained * factor), window)
        if leak is not None:
            factor = self.reached(
                factor,
                capacity(trained, window, leak),
                trained,
                f"leak {leak!r} with window {window}",
                f" (its largest distance w + (N - 1 - w)/k must stay within {trained - 1}); raise the leak, lower the "
                f"window or the factor, or use leak={AUTO!r} or leak=None (ReRoPE)",
            )
        return float(factor), {**params, "window": window, "leak": leak}

    def notes(self, geometry: RotaryGeometry, factor: float, params: dict) -> dict:
        """The largest relative distance at max_length, against the largest trained one."""
        trained = geometry.original_window
        target = math.ceil(trained * factor)
        value = largest_distance(target, params["window"], params["leak"])
        return {
            "largest_distance": {
                "statement": "w (ReRoPE) or w + (N - 1 - w) / k (Leaky ReRoPE) <= L - 1",
                "target": target,
                "value": float(value),
                "limit": trained - 1,
                "holds": value <= trained - 1,
            }
        }

    def distant_query(self, q_pos: torch.Tensor, params: dict) -> torch.Tensor:
        window, leak = params["window"], params["leak"]
        if leak is None:
            return torch.full_like(q_pos, window)
        return q_pos.float() / leak + (window - window / leak)

    def distant_key(self, k_pos: torch.Tensor, params: dict) -> torch.Tensor:
        leak = params["leak"]
        if leak is None:
            return torch.zeros_like(k_pos)
        return k_pos.float() / leak


METHOD = ReRoPEMethod(
    NAME,
    SUMMARY,
    FORMULA,
    params=PARAMS,
    constraints=CONSTRAINTS,
    factor_required=False,
    takes_query_scales=True,
    switches="rectified distances",
)
