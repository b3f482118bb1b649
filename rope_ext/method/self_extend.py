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
factor and the group is the smallest that reaches it; give both and the factor must not exceed
the capacity. `window` defaults to L / 4.

How it runs: the rotary module hands attention an identity rotation, so the KV cache keeps keys
before rotation (the mechanism of the dynamic methods, rope_ext.rotary), and `GroupedAttention`
rotates queries and keys twice, at their own and at their grouped positions. Rows past the window
attend their neighbours (own positions) and the distant keys (grouped positions) in two attention
calls of the model's own head size, merged by their log-sum-exp into one softmax
(rope_ext.attention.merge_by_lse), so each query attends every earlier key once, as in plain
attention. Queries go in blocks whose masks stay under SCORE_BYTES, each for only the keys it can
see: no [L, L] tensor is built. Rows inside the window go through the model's own backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rope_ext.attention import RotateInAttention, attend_with_lse, exact_rows, merge_by_lse
from rope_ext.geometry import RotaryGeometry

from .base import SCHEDULE_PARAMS, Method, ModelFacts, as_size, require_backend, trained_frequencies

NAME = "self_extend"
PARAMS = {"group": None, "window": None}
SUMMARY = "SelfExtend: exact positions for neighbours, grouped positions for distant tokens"
FORMULA = "i-j < W: positions (i, j); else (floor(i/G) + W - floor(W/G), floor(j/G)); one softmax"
BACKENDS = ("eager", "sdpa")  # take a [B, 1, Sq, Sk] mask for the block-wise masks below

# The largest attention-score block ([B, heads, rows, keys], fp32) one backend call may build.
SCORE_BYTES = 128 << 20


def capacity(window_tokens: int, group: int, window: int) -> int:
    """Tokens a model trained on `window_tokens` reaches with group size G and neighbour window W:
    the farthest grouped distance, floor(i/G) + W - floor(W/G), stays below the trained window."""
    return group * (window_tokens - window + window // group)


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
        if factor is None and merged["group"] is None:
            raise ValueError(f"{NAME} needs a factor (e.g. factor=4) or a group size (e.g. group=4)")
        if not isinstance(merged["causal"], bool):
            raise ValueError(f"{NAME}: causal must be True or False, got {merged['causal']!r}")
        if merged["granularity"] != 1:
            raise ValueError(
                f"{NAME}: granularity does not apply (a query switches to grouped attention once it has seen more "
                f"than the trained window); got {merged['granularity']!r}"
            )
        if factor is not None:
            super().validate(factor, {k: v for k, v in params.items() if k in SCHEDULE_PARAMS})
        return merged

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        """(factor, params with group and window filled in) for this model; ValueError, changing
        nothing, when they do not fit its window or the model cannot run the grouped attention."""
        require_backend(NAME, facts, BACKENDS)
        trained = geometry.original_window
        window = params["window"] if params["window"] is not None else max(1, trained // 4)
        if window >= trained:
            raise ValueError(f"{NAME}: the neighbour window ({window}) must be smaller than the trained window ({trained})")
        group = params["group"]
        if group is None:
            group = 2
            while capacity(trained, group, window) < factor * trained:
                group += 1
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
        return float(factor), {**params, "group": group, "window": window}

    def attention(self, rotary, facts: ModelFacts, params: dict) -> list:
        return [GroupedAttention(rotary)]


METHOD = SelfExtendMethod(
    NAME, trained_frequencies, SUMMARY, FORMULA, params=dict(PARAMS), dynamic=True,
    # no native form: a plain reload is the unscaled model, so the config keeps its window
    needs_attention_interface=True, keeps_config_window=True, factor_required=False,
)


class GroupedAttention(RotateInAttention):
    """Rotates queries and keys itself (in place of RotateInAttention, whose KV-cache tracking it
    keeps) and attends with SelfExtend's neighbour and grouped positions in one softmax. Causality
    is by key index, as in the model: with left padding the real tokens are contiguous, so index
    distances are position distances."""

    rotates = True

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        rotary = self.rotary
        frame = rotary.frame
        kv_len, q_len = key.shape[-2], query.shape[-2]
        k_pos = self.key_positions(kv_len)
        trained = rotary.geometry.original_window
        group, window = rotary.params["group"], rotary.params["window"]
        inv_freq, scale = frame.angles(trained)  # the trained frequencies
        q_own = self.rotate_to(query, frame.q_pos, inv_freq, scale)
        k_own = self.rotate_to(key, k_pos, inv_freq, scale)
        extended = frame.lengths > trained  # [B, Sq]: queries past the trained window
        if not bool(extended.any()):
            return attend(module, q_own, k_own, value, attention_mask, **kwargs)

        offset = kv_len - q_len  # query row r is key index offset + r
        first = int(extended.any(0).nonzero()[0])
        q_group = self.rotate_to(query, torch.div(frame.q_pos, group, rounding_mode="floor") + (window - window // group), inv_freq, scale)
        k_group = self.rotate_to(key, torch.div(k_pos, group, rounding_mode="floor"), inv_freq, scale)
        outputs = []
        if first:
            outputs.append(exact_rows(module, q_own, k_own, value, attention_mask, attend, offset, first, kwargs))
        rows = max(1, SCORE_BYTES // (query.shape[0] * query.shape[1] * (kv_len + window) * 4))
        for lo in range(first, q_len, rows):
            hi = min(lo + rows, q_len)
            outputs.append(self._grouped_rows(
                (q_own, k_own), (q_group, k_group), value, attention_mask, extended, offset, lo, hi, window, kwargs.get("scaling")
            ).transpose(1, 2))
        return torch.cat(outputs, dim=1), None

    def _grouped_rows(self, own, grouped, value, mask, extended, offset, lo, hi, window, scaling):
        """Query rows [lo, hi) as [B, H, rows, D]: attention to the distant keys they group
        ([0, far_end), grouped positions) and to the keys they see with their own positions
        ([near_lo, end)), one call each, merged by log-sum-exp into one softmax."""
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
            out, lse = attend_with_lse(q_group[:, :, lo:hi], k_group[:, :, :far_end], value[:, :, :far_end], mask=far_mask, scale=scaling)
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
