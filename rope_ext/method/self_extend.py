"""self_extend: SelfExtend's grouped attention (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM
Context Window Without Tuning"; reference code datamllab/LongLM), training-free.

For a query at position i and a key at position j <= i, with group size G and neighbour window W:

    i - j <  W:  the usual positions i and j                                   (neighbour attention)
    i - j >= W:  key floor(j/G), query floor(i/G) + W - floor(W/G)             (grouped attention)

both kinds of logits in one softmax. Relative distances stay within the trained window L up to
G * (L - W + floor(W/G)) tokens (`capacity`). `factor` is the length the patch is meant for, as a
multiple of L; without one it is the capacity of the group and window given. `group_rule` picks a
group that is not given: "reach", the smallest whose capacity reaches the length, or "authors", the
smallest that also keeps W + (N - W) / G within 2/3 L (their rule); a group given that breaks the
rule warns. Parameters and measurements: docs/beat_builtins.md; how it runs: docs/concepts.md, "How
the attention-side methods run".
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from fractions import Fraction

import torch

from rope_ext.geometry import RotaryGeometry

from .attention_side import TwoPartMethod, capacity, default_window, reaching_group
from .base import AtLeast, FactorOr, ModelFacts, Param

NAME = "self_extend"
SUMMARY = "SelfExtend: exact positions for neighbours, grouped positions for distant tokens"
FORMULA = "i-j < W: positions (i, j); else (floor(i/G) + W - floor(W/G), floor(j/G)); one softmax"

# The share of the trained window the grouped span W + (N - W) / G should stay within: the upper
# end of the "1/2 to 2/3" of the empirical rule in the README of the authors' repository
# (datamllab/LongLM) for Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without
# Tuning"; that README also advises trying groups larger than the smallest that reaches the length.
# A Fraction, so that a span exactly at the limit (G=9, W=2048 at 32768 tokens of 8192) holds.
AUTHORS_FRACTION = Fraction(2, 3)

# How a group that is not given is chosen: "reach", the smallest group whose capacity reaches the
# target; "authors", the smallest that also keeps the grouped span within AUTHORS_FRACTION of L.
GROUP_RULES = ("reach", "authors")
DEFAULT_GROUP_RULE = "reach"

PARAMS = (
    Param("group", None, "size", lo=1, doc="G: distant positions are floor(i / G)"),
    Param("window", None, "size", lo=1, doc="W: keys within W tokens keep their positions"),
    Param("group_rule", None, "choice", choices=GROUP_RULES, doc="how a group that is not given is chosen"),
)
CONSTRAINTS = (
    AtLeast("group", 2, "group 1 is the unpatched model"),
    FactorOr("group", "a group size (e.g. group=4)"),
)


def grouped_span(target: int, group: int, window: int) -> Fraction:
    """W + (N - W) / G: the largest distance the grouped attention gives at N = `target` tokens."""
    return window + Fraction(target - window, group)


def rule_limit(window_tokens: int) -> Fraction:
    """The largest grouped span the authors' rule allows a model trained on `window_tokens`."""
    return AUTHORS_FRACTION * window_tokens


def follows_rule(window_tokens: int, target: int, group: int, window: int) -> bool:
    return grouped_span(target, group, window) <= rule_limit(window_tokens)


def choose_group(window_tokens: int, target: int, window: int, rule: str) -> int:
    """The group `rule` (one of GROUP_RULES) picks for `target` tokens at neighbour window `window`;
    ValueError for "authors" when no group follows the rule at this window."""
    if rule != "authors":
        return reaching_group(window_tokens, target, window)
    limit = rule_limit(window_tokens)
    if window >= limit:
        raise ValueError(
            f"{NAME}: no group follows its authors' rule at window {window}: W + (N - W)/G exceeds W for every "
            f"group, and W is not below {AUTHORS_FRACTION} x {window_tokens} = {float(limit):.6g}; lower the window"
        )
    # the span falls as the group grows, so every group from this one on follows the rule
    return reaching_group(window_tokens, target, window, max(2, math.ceil((target - window) / (limit - window))))


def choose(factor: float, window_tokens: int, rule: str = DEFAULT_GROUP_RULE, window: int | None = None) -> tuple[int, int]:
    """(group, window) for `factor` x a trained window of `window_tokens`: the window given or
    L / 4, and the group `rule` picks for max_length = ceil(factor x L) tokens."""
    window = default_window(window_tokens) if window is None else window
    return choose_group(window_tokens, math.ceil(window_tokens * factor), window, rule), window


def rule_notes(window_tokens: int, target: int, group: int, window: int) -> dict:
    """The authors' rule for (G, W) at N = `target` tokens, as PatchInfo.notes states it."""
    return {
        "authors_rule": {
            "statement": f"W + (N - W) / G <= {AUTHORS_FRACTION} L (Jin et al. 2024)",
            "target": target,
            "value": float(grouped_span(target, group, window)),
            "limit": float(rule_limit(window_tokens)),
            "holds": follows_rule(window_tokens, target, group, window),
        }
    }


def longest_within_rule(window_tokens: int, group: int, window: int) -> int:
    """The longest N at which (G, W) follows the authors' rule: W + G (2/3 L - W), rounded down."""
    return math.floor(window + group * (rule_limit(window_tokens) - window))


def rule_warning(window_tokens: int, target: int, group: int, window: int) -> str:
    """One line for a (G, W) that breaks the authors' rule at `target` tokens: the numbers and the fix."""
    span, limit = grouped_span(target, group, window), rule_limit(window_tokens)
    if window < limit:
        fix = f"for {target} tokens use group >= {choose_group(window_tokens, target, window, 'authors')} (what group_rule='authors' picks at this window)"
        longest = longest_within_rule(window_tokens, group, window)
        if longest > window_tokens:
            fix += f", or keep this pair to targets of at most {longest} tokens"
    else:
        fix = f"lower the window below {float(limit):.6g}: no group follows the rule at window {window}"
    return (
        f"{NAME}: group {group} with window {window} breaks its authors' rule at {target} tokens: W + (N - W)/G = "
        f"{float(span):.6g} > {AUTHORS_FRACTION} x {window_tokens} = {float(limit):.6g} (Jin et al. 2024); {fix}"
    )


@dataclass(frozen=True)
class SelfExtendMethod(TwoPartMethod):
    """SelfExtend's group and window, with the grouped positions as the two-part engine's distant
    positions."""

    factor_required: bool = False
    takes_query_scales: bool = True
    switches: str | None = "grouped attention"

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        """(factor, params with group, window and the group_rule that chose the group filled in) for
        this model; ValueError, changing nothing, when they do not fit its window. A group the
        caller gives that breaks the authors' rule warns."""
        trained = geometry.original_window
        window = self.neighbour_window(params, trained)
        group, rule = params["group"], params["group_rule"]
        if group is None:
            rule = DEFAULT_GROUP_RULE if rule is None else rule
            group, window = choose(factor, trained, rule, window)
        factor = self.reached(
            factor,
            capacity(trained, group, window),
            trained,
            f"group {group} with window {window}",
            "; raise the group, lower the window or the factor",
        )
        target = math.ceil(trained * factor)  # PatchInfo.max_length
        if params["group"] is not None and rule is not None:
            # a reload gives both, as resolved; a group the rule did not pick must not be recorded as its choice
            picked = choose_group(trained, target, window, rule)
            if group != picked:
                raise ValueError(
                    f"{NAME}: group {group} is not what group_rule={rule!r} picks for {target} tokens at window {window} "
                    f"({picked}); give group or group_rule, not both"
                )
        if rule is None and not follows_rule(trained, target, group, window):
            warnings.warn(rule_warning(trained, target, group, window), UserWarning, stacklevel=3)
        return float(factor), {**params, "group": group, "window": window, "group_rule": rule}

    def notes(self, geometry: RotaryGeometry, factor: float, params: dict) -> dict:
        """The authors' rule at max_length for the resolved group and window."""
        trained = geometry.original_window
        return rule_notes(trained, math.ceil(trained * factor), params["group"], params["window"])

    def distant_query(self, q_pos: torch.Tensor, params: dict) -> torch.Tensor:
        """The grouped position of queries at `q_pos`: floor(i/G) + W - floor(W/G)."""
        group, window = params["group"], params["window"]
        return torch.div(q_pos, group, rounding_mode="floor") + (window - window // group)

    def distant_key(self, k_pos: torch.Tensor, params: dict) -> torch.Tensor:
        """The grouped position of keys at `k_pos`: floor(j/G)."""
        return torch.div(k_pos, params["group"], rounding_mode="floor")


METHOD = SelfExtendMethod(NAME, SUMMARY, FORMULA, params=PARAMS, constraints=CONSTRAINTS)
