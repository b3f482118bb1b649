"""rerope: ReRoPE and Leaky ReRoPE (Jianlin Su 2023, "Transformer Upgrade Road 12: ReRoPE with
Infinite Extrapolation", kexue.fm/archives/9708; reference code github.com/bojone/rerope),
training-free.

For a query at position i and a key at position j <= i, with neighbour window w and leak k > 1:

    i - j <  w:  relative distance i - j                    (neighbour attention, the usual RoPE)
    i - j >= w:  relative distance w + (i - j - w) / k      (Leaky ReRoPE)
                 relative distance w                        (ReRoPE, k = infinity)

both kinds of logits in one softmax: SelfExtend's two-part attention without the floor, distant
keys at j / k and the query at i / k + w - w / k (ReRoPE: keys at 0, the query at w), fractional
positions. ReRoPE reaches every length; Leaky ReRoPE stays within the trained distances up to
floor(w + 1 + k (L - 1 - w)) tokens (`capacity`). Parameters, `factor` and measurements:
docs/rerope.md; how it runs: docs/concepts.md, "How the attention-side methods run".
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
    Param("window", None, "size", lo=1, doc="w: distances below it are exact"),
    Param(
        "leak",
        None,
        lo=1,
        lo_open=True,
        hi=MAX_FACTOR,
        words=(AUTO,),
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

    factor_required: bool = False
    takes_query_scales: bool = True
    switches: str | None = "rectified distances"

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
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


METHOD = ReRoPEMethod(NAME, SUMMARY, FORMULA, params=PARAMS, constraints=CONSTRAINTS)
