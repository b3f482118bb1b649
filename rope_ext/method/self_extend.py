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
before rotation (the mechanism of the dynamic methods, rope_ext.rotary), and `GroupedAttention`
rotates queries and keys twice, at their own and at their grouped positions. Rows inside the window
go through the model's own backend. Rows past it attend their neighbours (own positions) and the
distant keys (grouped positions) in attention calls of the model's own head size, merged by their
log-sum-exp into one softmax (rope_ext.attention.merge_by_lse), so each query attends every earlier
key once, as in plain attention. Where the model's mask is the causal one (one sequence, also in
chunks) these calls take no mask: the distant keys as those all rows see plus a causal square, the
neighbours in blocks of W rows (rope_ext.attention.window_parts). Otherwise (padding) queries go in
blocks whose masks stay under SCORE_BYTES, each for only the keys it can see. A decode step is one
backend call, each key rotated by its distance to the query. No [L, L] tensor is built.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from fractions import Fraction

import torch

from rope_ext.attention import SCORE_BYTES, RotateInAttention, attend_with_lse, exact_rows, hides_keys, merge_by_lse, window_parts
from rope_ext.geometry import RotaryGeometry

from .base import SCHEDULE_PARAMS, Method, ModelFacts, as_size, check_logn, check_switch_schedule, require_backend, trained_frequencies

NAME = "self_extend"
PARAMS = {"group": None, "window": None, "group_rule": None}
SUMMARY = "SelfExtend: exact positions for neighbours, grouped positions for distant tokens"
FORMULA = "i-j < W: positions (i, j); else (floor(i/G) + W - floor(W/G), floor(j/G)); one softmax"
BACKENDS = ("eager", "sdpa")  # take a [B, 1, Sq, Sk] mask for the block-wise masks below

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


def capacity(window_tokens: int, group: int, window: int) -> int:
    """Tokens a model trained on `window_tokens` reaches with group size G and neighbour window W:
    the farthest grouped distance, floor(i/G) + W - floor(W/G), stays below the trained window."""
    return group * (window_tokens - window + window // group)


def default_window(window_tokens: int) -> int:
    return max(1, window_tokens // 4)


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
    return {"authors_rule": {
        "statement": f"W + (N - W) / G <= {AUTHORS_FRACTION} L (Jin et al. 2024)",
        "target": target,
        "value": float(grouped_span(target, group, window)),
        "limit": float(rule_limit(window_tokens)),
        "holds": follows_rule(window_tokens, target, group, window),
    }}


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
class SelfExtendMethod(Method):
    """self_extend as a Method: the trained frequencies and SelfExtend's parameters. It is dynamic
    in rope-ext's sense (what a query sees depends on the length it has seen), so the rotary module
    keeps keys un-rotated; the grouped attention is installed as a transform (`GroupedAttention`)."""

    @property
    def rescales(self) -> bool:
        return False  # the trained frequencies at every length: one group per forward past the window

    def validate(self, factor, params: dict) -> dict:
        self.check_known(params)
        merged = {**self.all_params, **params}
        for key in ("group", "window"):
            if merged[key] is not None:
                merged[key] = as_size(merged[key], f"{NAME}: {key} (or None for the default)")
        if merged["group"] is not None and merged["group"] < 2:
            raise ValueError(f"{NAME}: group must be >= 2 (group 1 is the unpatched model), got {merged['group']}")
        if merged["group_rule"] is not None and merged["group_rule"] not in GROUP_RULES:
            raise ValueError(f"{NAME}: group_rule must be None or one of {', '.join(map(repr, GROUP_RULES))}, got {merged['group_rule']!r}")
        if factor is None and merged["group"] is None:
            raise ValueError(f"{NAME} needs a factor (e.g. factor=4) or a group size (e.g. group=4)")
        check_switch_schedule(NAME, merged, "grouped attention")
        check_logn(NAME, merged)
        if factor is not None:
            super().validate(factor, {k: v for k, v in params.items() if k in SCHEDULE_PARAMS})
        return merged

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        """(factor, params with group, window and the group_rule that chose the group filled in) for
        this model; ValueError, changing nothing, when they do not fit its window or the model cannot
        run the grouped attention. A group the caller gives that breaks the authors' rule warns."""
        require_backend(NAME, facts, BACKENDS)
        trained = geometry.original_window
        window = params["window"] if params["window"] is not None else default_window(trained)
        if window >= trained:
            raise ValueError(f"{NAME}: the neighbour window ({window}) must be smaller than the trained window ({trained})")
        group, rule = params["group"], params["group_rule"]
        if group is None:
            rule = DEFAULT_GROUP_RULE if rule is None else rule
            group, window = choose(factor, trained, rule, window)
        reach = capacity(trained, group, window)
        if factor is None:
            factor = reach / trained
        elif reach < factor * trained * (1 - 1e-12):
            raise ValueError(
                f"{NAME}: group {group} with window {window} reaches {reach} tokens, less than factor {factor:g} x {trained}; "
                "raise the group, lower the window or the factor"
            )
        if not factor > 1:
            raise ValueError(f"{NAME}: group {group} with window {window} does not extend a {trained}-token window")
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

    def attention(self, rotary, facts: ModelFacts, params: dict) -> list:
        return [GroupedAttention(rotary)]


METHOD = SelfExtendMethod(
    NAME, trained_frequencies, SUMMARY, FORMULA, params=dict(PARAMS), dynamic=True,
    # no native form: a plain reload is the unscaled model, so the config keeps its window
    needs_attention_interface=True, keeps_config_window=True, factor_required=False, takes_logn=True,
)


class GroupedAttention(RotateInAttention):
    """Rotates queries and keys itself (in place of RotateInAttention, whose KV-cache tracking it
    keeps) and attends with SelfExtend's neighbour and grouped positions in one softmax. Causality
    is by key index, as in the model: with left padding the real tokens are contiguous, so index
    distances are position distances."""

    rotates = True

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        query = self.scale_queries(query)
        rotary = self.rotary
        frame = rotary.frame
        kv_len, q_len = key.shape[-2], query.shape[-2]
        k_pos = self.key_positions(kv_len)
        trained = rotary.geometry.original_window
        window = rotary.params["window"]
        inv_freq, scale = frame.angles(trained)  # the trained frequencies
        extended = frame.lengths > trained  # [B, Sq]: queries past the trained window
        # One query row (a decode step) attends all its keys in one backend call, each key rotated
        # by its distance to the query. Several rows would need a rotated copy of every key per
        # row, so the rows of a prefill (also a short chunk of one) attend in the parts below.
        if q_len == 1 and bool(extended.any()):
            return self.attend_at_distances(module, query, key, value, attention_mask, attend,
                                            self._distances(k_pos, extended), inv_freq, scale, kwargs)
        q_own = self.rotate_to(query, frame.q_pos, inv_freq, scale)
        k_own = self.rotate_to(key, k_pos, inv_freq, scale)
        if not bool(extended.any()):
            return attend(module, q_own, k_own, value, attention_mask, **kwargs)

        offset = kv_len - q_len  # query row r is key index offset + r
        first = int(extended.any(0).nonzero()[0])
        q_group = self.rotate_to(query[:, :, first:], self._grouped_query(frame.q_pos[:, first:]), inv_freq, scale)
        k_group = self.rotate_to(key, self._grouped_key(k_pos), inv_freq, scale)
        outputs = []
        if first:
            outputs.append(exact_rows(module, q_own, k_own, value, attention_mask, attend, offset, first, kwargs))
        scaling = kwargs.get("scaling")
        # With no mask to honour but the causal one and every row from `first` on past the window
        # (one sequence), the parts need no mask of their own; otherwise (padding) each block of
        # rows gets one.
        if not hides_keys(attention_mask, kv_len) and bool(extended[:, first:].all()) and offset + first >= window:
            outputs.append(self._unmasked_rows(q_own[:, :, first:], k_own, q_group, k_group, value, offset + first, window, scaling))
        else:
            rows = max(1, SCORE_BYTES // (query.shape[0] * query.shape[1] * (kv_len + window) * 4))
            for lo in range(first, q_len, rows):
                hi = min(lo + rows, q_len)
                outputs.append(self._grouped_rows(
                    (q_own, k_own), (q_group, k_group), value, attention_mask, extended, offset, first, lo, hi, window, scaling
                ).transpose(1, 2))
        return torch.cat(outputs, dim=1), None

    # The positions of the distant part, one method each, so that a method with other positions
    # for distant keys (rope_ext.method.rerope) reuses everything else here.
    def _grouped_query(self, q_pos: torch.Tensor) -> torch.Tensor:
        """The grouped position of queries at `q_pos`: floor(i/G) + W - floor(W/G)."""
        group, window = self.rotary.params["group"], self.rotary.params["window"]
        return torch.div(q_pos, group, rounding_mode="floor") + (window - window // group)

    def _grouped_key(self, k_pos: torch.Tensor) -> torch.Tensor:
        """The grouped position of keys at `k_pos`: floor(j/G)."""
        return torch.div(k_pos, self.rotary.params["group"], rounding_mode="floor")

    def _distances(self, k_pos: torch.Tensor, extended: torch.Tensor) -> torch.Tensor:
        """[B, kv_len]: each key's distance from a single query row (attend_at_distances): its own
        position minus the query's (neighbours, and every key of a row still inside the window),
        or its grouped position minus the query's grouped one (keys at an index distance of the
        window or more)."""
        window = self.rotary.params["window"]
        q_pos = self.rotary.frame.q_pos  # [B, 1]
        kv_len = k_pos.shape[-1]
        distant = (kv_len - 1 - torch.arange(kv_len, device=k_pos.device)) >= window  # [kv_len], by index
        grouped = self._grouped_key(k_pos) - self._grouped_query(q_pos)
        return torch.where(extended & distant[None, :], grouped, k_pos - q_pos)

    @staticmethod
    def _unmasked_rows(q_own, k_own, q_group, k_group, value, first, window, scaling):
        """Query rows that are key indices first, first + 1, ... (first >= window), all past the
        trained window and with no mask to honour but the causal one, as [B, rows, H, D], in calls
        without a mask: the neighbours (rope_ext.attention.window_parts), and the distant keys
        j <= q - window as the keys every row has, j < first - window, and a causal square after them."""
        rows = q_own.shape[-2]
        far = first - window  # the last distant key of row r is far + r
        distant = []
        if far:
            distant.append(attend_with_lse(q_group, k_group[:, :, :far], value[:, :, :far], scale=scaling))
        ahead = slice(far, far + rows)
        distant.append(attend_with_lse(q_group, k_group[:, :, ahead], value[:, :, ahead], causal=True, scale=scaling))
        outputs = [merge_by_lse([(out[:, :, lo:hi], lse[:, :, lo:hi], None) for out, lse in distant] + near)
                   for lo, hi, near in window_parts(q_own, k_own, value, first, window, scaling)]
        return torch.cat(outputs, dim=2).transpose(1, 2)

    def _grouped_rows(self, own, grouped, value, mask, extended, offset, first, lo, hi, window, scaling):
        """Query rows [lo, hi) as [B, H, rows, D]: attention to the distant keys they group
        ([0, far_end), grouped positions) and to the keys they see with their own positions
        ([near_lo, end)), one call each with a mask of their [rows, keys], merged by log-sum-exp into
        one softmax. `grouped` holds the queries from row `first` on."""
        (q_own, k_own), (q_group, k_group) = own, grouped
        device, dtype = q_own.device, q_own.dtype
        end = offset + hi
        q_index = torch.arange(offset + lo, end, device=device)  # [rows], as key indices
        rows_extended = extended[:, lo:hi]  # [B, rows]
        far_end = max(0, end - window)  # keys at distance >= window from the block's last query
        # rows still inside the window see every earlier key with its own position
        near_lo = 0 if not bool(rows_extended.all()) else max(0, offset + lo - window + 1)
        far = torch.arange(far_end, device=device)
        near = torch.arange(near_lo, end, device=device)
        distance = q_index[:, None] - near[None, :]
        near_ok = ((distance >= 0)[None] & ((distance < window)[None] | ~rows_extended[:, :, None]))[:, None]
        near_mask = self._additive(near_ok, None if mask is None else mask[:, :, lo:hi, near_lo:end], dtype)
        out, lse = attend_with_lse(q_own[:, :, lo:hi], k_own[:, :, near_lo:end], value[:, :, near_lo:end], mask=near_mask, scale=scaling)
        parts = [(out, lse, (near_mask > torch.finfo(dtype).min).any(-1))]
        if far_end:
            far_ok = (rows_extended[:, :, None] & ((q_index[:, None] - far[None, :]) >= window)[None])[:, None]
            far_mask = self._additive(far_ok, None if mask is None else mask[:, :, lo:hi, :far_end], dtype)
            out, lse = attend_with_lse(q_group[:, :, lo - first : hi - first], k_group[:, :, :far_end], value[:, :, :far_end],
                                       mask=far_mask, scale=scaling)
            parts.append((out, lse, (far_mask > torch.finfo(dtype).min).any(-1)))
        return merge_by_lse(parts)

    @staticmethod
    def _additive(allowed: torch.Tensor, given: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """An additive mask (what eager and sdpa both take): `given` (the model's mask: boolean, True
        = attend, or additive) where `allowed`, the dtype's minimum elsewhere."""
        low = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
        if given is None:
            return torch.zeros((), dtype=dtype, device=allowed.device).where(allowed, low)
        if given.dtype == torch.bool:
            return torch.zeros((), dtype=dtype, device=allowed.device).where(allowed & given, low)
        return given.to(dtype).where(allowed, low)
