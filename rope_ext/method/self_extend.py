"""self_extend: SelfExtend's grouped attention (Jin et al. 2024, "LLM Maybe LongLM"), training-free.

For a query at position i and a key at position j <= i, with group size G and neighbour window W:

    i - j <  W:  the usual positions i and j                                   (neighbour attention)
    i - j >= W:  key floor(j/G), query floor(i/G) + W - floor(W/G)             (grouped attention)

and both kinds of logits share one softmax. Relative distances then never exceed what the model was
trained on up to a length of G * (L - W + floor(W/G)) ~ (L - W) * G + W tokens, L the trained window.

The rotary frequencies stay the trained ones. Under the causal schedule (the default) a query that
has seen no more than L tokens attends exactly as the unpatched model, so everything inside the
trained window is unchanged, and a query's output depends only on the tokens before it: a long
input gives the same numbers in one forward, in chunks through the KV cache, and token by token.
`causal=False` groups every query of a forward that goes past the window, as the paper does.

Meaning of `factor`: the length the patch is meant for, as a multiple of L (PatchInfo.max_length).
Give `group` and `window` and the factor is the capacity above, G * (L - W + W // G) / L; give a
factor and `group_rule` picks the group; give both and the factor must not exceed the capacity.
`window` defaults to L / 4. `logn=True` adds Qwen's log-n scale to the queries past L
(docs/logn.md).

The authors' rule: for N tokens, the grouped span W + (N - W) / G (the largest distance the grouped
attention gives) should stay within about 2/3 of L. `group_rule` names how a group that is not given
is chosen: "reach", the smallest group whose capacity reaches N; "authors", the smallest that also
follows the rule. None (the default) means DEFAULT_GROUP_RULE, and the resolved params name the rule
that chose the group, or None when the caller gave it. PatchInfo.notes states the rule's value at
N = max_length and whether it holds. A group the caller gives that breaks the rule warns, with the
group that follows it and the longest length the pair follows it for; without a factor the patch is
meant for the pair's whole capacity, where the span is about L, so a group given alone always warns
(give the factor the patch is for). A group that `group_rule` picks never warns, nor does its reload.

How it runs: the rotary module hands attention an identity rotation, so the KV cache keeps keys
before rotation (the mechanism of the dynamic methods, rope_ext.rotary), and the two-part engine
(rope_ext.method.attention_side.TwoPartAttention) rotates queries and keys twice, at their own and at their grouped positions. Rows inside the window
go through the model's own backend. Rows past it attend their neighbours (own positions) and the
distant keys (grouped positions) in attention calls of the model's own head size, merged by their
log-sum-exp into one softmax (rope_ext.attention.merge_by_lse), so each query attends every earlier
key once, as in plain attention. Where the model's mask is the causal one (one sequence, also in
chunks) these calls take no mask: the distant keys as those all rows see plus a causal square, the
neighbours in blocks of W rows (rope_ext.attention.window_parts). Otherwise (padding) queries go in
blocks whose masks stay under SCORE_BYTES, each for only the keys it can see. No [L, L] tensor is
built. A DynamicCache's keys are rotated once, to their own and to their grouped positions, and
kept rotated between forwards: two copies of the key cache (rope_ext.attention.keys.RotatedKeys),
so a decode step rotates only its query and its new key and attends in two calls, merged by
log-sum-exp.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from fractions import Fraction

import torch

from rope_ext.geometry import RotaryGeometry

from .attention_side import TwoPartMethod, default_window
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
    Param("group", None, "size", lo=1, none="the default", doc="G: distant positions are floor(i / G)"),
    Param("window", None, "size", lo=1, none="the default", doc="W: keys within W tokens keep their positions"),
    Param("group_rule", None, "choice", choices=GROUP_RULES, doc="how a group that is not given is chosen"),
)
CONSTRAINTS = (
    AtLeast("group", 2, "group 1 is the unpatched model"),
    FactorOr("group", "a group size (e.g. group=4)"),
)


def capacity(window_tokens: int, group: int, window: int) -> int:
    """Tokens a model trained on `window_tokens` reaches with group size G and neighbour window W:
    the farthest grouped distance, floor(i/G) + W - floor(W/G), stays below the trained window."""
    return group * (window_tokens - window + window // group)


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
    # capacity <= G * (L - W) + W, so no smaller group reaches the target
    group = max(2, math.ceil(Fraction(target - window, window_tokens - window)))
    if rule == "authors":
        limit = rule_limit(window_tokens)
        if window >= limit:
            raise ValueError(
                f"{NAME}: no group follows its authors' rule at window {window}: W + (N - W)/G exceeds W for every "
                f"group, and W is not below {AUTHORS_FRACTION} x {window_tokens} = {float(limit):.6g}; lower the window"
            )
        # the span falls as the group grows, so every group from this one on follows the rule
        group = max(group, math.ceil((target - window) / (limit - window)))
    while capacity(window_tokens, group, window) < target:
        group += 1
    return group


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

    def derive(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
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
            warnings.warn(rule_warning(trained, target, group, window), UserWarning, stacklevel=4)
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


METHOD = SelfExtendMethod(
    NAME,
    SUMMARY,
    FORMULA,
    params=PARAMS,
    constraints=CONSTRAINTS,
    factor_required=False,
    takes_query_scales=True,
    switches="grouped attention",
)
