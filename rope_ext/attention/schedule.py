"""The dynamic methods' transform (`RotateInAttention`): queries and keys rotated with the scaling
of the causal schedule, its queries attended in groups, one per scaling."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rope_ext.rotation import channel_split, cos_sin, prepared, rotate_prepared, swap

from .interface import PREFIX
from .parts import attend_with_lse, causal_mask, hides_keys, merge_by_lse
from .rotator import RotatingTransform


@dataclass
class Schedule:
    """What the layers of a forward share in RotateInAttention (`shared`): the groups of its queries
    (`_groups`) and the index of the first key attention receives among those written
    (sliding-window caches return only the most recent); in one group, the queries' prepared
    (cos, sin) and whether the rotated keys are kept for the next forward; in several, whether
    they attend with no mask but the causal one."""

    groups: list
    first_key: int
    queries: tuple | None = None
    keep: bool = True
    causal_only: bool = False


class RotateInAttention(RotatingTransform):
    """Rotates queries and keys inside attention for a dynamic rotary module (see rotary.py), the
    queries scaled first where the patch has `logn` on (Rotator.scale_queries).

    Queries that use different scalings (causal schedule past the window) are attended in groups,
    each against keys rotated with that group's scaling; causality is by index, as in the model.
    On sdpa, with no mask to honour but the causal one, the groups attend in fused calls without a
    mask, their rotations batched (`_unmasked_groups`); otherwise (padding, eager, autograd) each
    group is a backend call with its mask. Either way a forward keeps the keys' (cos, sin) of its
    first groups only (HELD_GROUPS of them, or HELD_KEYS times a layer's keys) and computes the
    others' in every layer, so it holds O(length) of them at any number of groups (a prompt of L
    tokens past the window at granularity 1 is L groups).

    One transform serves every layer: what every layer of a forward would compute alike (the
    groups, their cos/sin) its rotator keeps for the forward (Rotator.per_forward). It is one
    rotating transform among others (the attention-side methods' own, rope_ext.method), handed
    its rotator as they are."""

    HELD_GROUPS = 4
    # a forward in more groups than this is told once what the schedule costs (PatchInfo.notes)
    MANY_GROUPS = 64

    def __init__(self, rotator):
        super().__init__(rotator)
        self._warned = False  # of many groups in a forward (_counted), once per patch

    def __call__(self, module, query, key, value, attention_mask, attend: Callable, **kwargs):
        rotator = self.rotator
        query = rotator.scale_queries(query)
        kv_len, q_len = key.shape[-2], query.shape[-2]
        step = self.step("schedule", query, key, attention_mask)
        groups, first_key = step.groups, step.first_key
        if len(groups) == 1:
            length = groups[0][0]
            kept = rotator.kept_keys(
                module,
                key,
                (("scaled", length),),
                lambda start, stop: rotator.frame_factors(length, True, first_key + start, first_key + stop, key.dtype),
                keep=step.keep,
            )
            q_rotated = rotator.temper(rotate_prepared(query.unsqueeze(2), *step.queries, *rotator.pairing))
            return attend(module, q_rotated[:, :, 0], kept[:, :, 0], value, attention_mask, **kwargs)
        offset = kv_len - q_len
        if step.causal_only and self._attends_last(module) and plain_softmax(module, query, kwargs):
            return self._unmasked_groups(query, key, value, groups, offset, first_key, kwargs.get("scaling")), None
        frame = rotator.frame
        out = weights = None
        for index, (length, lo, hi, chosen) in enumerate(groups):
            end = offset + hi  # keys past the group's last query are masked anyway
            if attention_mask is not None:
                mask = attention_mask[:, :, lo:hi, :end]
            elif hi - lo > 1:
                mask = causal_mask(offset + lo, hi - lo, end, query.dtype, query.device)
            else:
                mask = None  # one row sees every key up to its own: nothing to hide
            q_rotated, k_rotated = self._rotated(
                query[:, :, lo:hi],
                key[:, :, :end],
                frame,
                length,
                (lo, hi),
                (first_key, first_key + end),
                index < self.HELD_GROUPS,
            )
            part, part_weights = attend(module, q_rotated, k_rotated, value[:, :, :end], mask, **kwargs)
            if out is None:
                out = part.new_empty((part.shape[0], q_len, *part.shape[2:]))
            out[:, lo:hi] = part if chosen is None else torch.where(chosen, part, out[:, lo:hi])
            if part_weights is not None:  # a backend that gives them (eager): each row's from its group
                if weights is None:
                    weights = part_weights.new_zeros((*part_weights.shape[:2], q_len, kv_len))
                if chosen is None:
                    weights[:, :, lo:hi, :end] = part_weights
                else:
                    rows_chosen = chosen.transpose(1, 2)  # [B, 1, rows, 1]
                    weights[:, :, lo:hi, :end] = torch.where(rows_chosen, part_weights, weights[:, :, lo:hi, :end])
        return out, weights

    def shared(self, q_len: int, kv_len: int, q_dtype, k_dtype, attention_mask) -> Schedule:
        """What every layer of a forward with these lengths, query dtype and mask shares: computed by
        the first such layer, in this one call, and read by the others."""
        rotator = self.rotator
        frame = rotator.frame
        written = frame.k_pos.shape[-1]
        if written < kv_len:
            raise RuntimeError(f"rope_ext: the KV cache returned {kv_len} keys but the patched model wrote {written}")
        groups = self._counted(self._groups(frame.lengths))
        if len(groups) > 1:
            # every row of every group in one sequence, with no mask to honour but the causal one
            causal_only = all(chosen is None for *_, chosen in groups) and not hides_keys(attention_mask, kv_len)
            return Schedule(groups, written - kv_len, causal_only=causal_only)
        length, first_key = groups[0][0], written - kv_len
        # the (cos, sin) of the keys the layers rotate, the new ones where the store holds this
        # scaling's, else all, kept for the forward by frame_factors, where kept_keys finds them
        start = kv_len - q_len if rotator.holds((("scaled", length),)) else 0
        rotator.frame_factors(length, True, first_key + start, first_key + kv_len, k_dtype)
        return Schedule(
            groups,
            first_key,
            queries=rotator.frame_factors(length, False, 0, q_len, q_dtype),
            keep=self._scaling_holds(frame),
        )

    def _attends_last(self, module) -> bool:
        """Whether this transform hands its tensors to the backend itself: no transform after it in
        the module's chain (alibi_hybrid's bias) changes what is attended."""
        chain = getattr(module, "rope_ext_attention", None)
        return chain is not None and chain.transforms[-1] is self

    def _unmasked_groups(self, query, key, value, groups: list, offset: int, first_key: int, scaling) -> torch.Tensor:
        """The groups of a forward ([(length, lo, hi, None)], every batch row alike) attended in calls
        without a mask, as [B, Sq, H, D] (the backends' layout): the queries rotated in one operation,
        each row at its group's scaling; for each group its key prefix rotated to its scaling
        (`PrefixRotation`), its causal square and the keys before it (which all its rows see)
        attended in one call each; all the rows' parts merged by log-sum-exp into one softmax at
        once. The same function as a call per group with its causal mask, in a few operations per
        group rather than some thirty: on a GPU a launch each."""
        rotator = self.rotator
        q_factors = rotator.per_forward(("group queries", query.dtype), lambda: self._query_factors(groups, query.dtype))
        queries = rotator.temper(rotate_prepared(query.unsqueeze(2), *q_factors, *rotator.pairing)[:, :, 0])
        rotate = PrefixRotation(key, rotator.geometry.rotary_dim, *rotator.pairing)
        squares, earlier = [], []
        for (_, lo, hi, _), factors in zip(groups, self._key_factors(key, groups, offset, first_key)):
            first, end = offset + lo, offset + hi  # the group's rows are key indices first .. end - 1
            keys, rows = rotate(end, *factors), queries[:, :, lo:hi]
            squares.append(attend_with_lse(rows, keys[:, :, first:end], value[:, :, first:end], causal=True, scale=scaling))
            if first:
                earlier.append(attend_with_lse(rows, keys[:, :, :first], value[:, :, :first], scale=scaling))
            else:  # no key before the group's first row (the first group of a prompt)
                out, lse = squares[-1]
                earlier.append((out.new_zeros(out.shape), lse.new_full(lse.shape, float("-inf"))))
        parts = [(torch.cat([o for o, _ in p], dim=2), torch.cat([l for _, l in p], dim=-1), None) for p in (squares, earlier)]
        return merge_by_lse(parts).transpose(1, 2)

    def _query_factors(self, groups: list, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The prepared (cos, sin) [B, 1, 1, Sq, D] of every query row at its group's scaling, in one
        computation: each row its group's frequencies and attention factor (cos_sin's per_position),
        every operation elementwise, so the bits of a computation per group."""
        frame = self.rotator.frame
        inv_freqs, scales = zip(*(frame.angles(length) for length, _, _, _ in groups))
        rows = torch.tensor([hi - lo for _, lo, hi, _ in groups], device=inv_freqs[0].device)
        inv_freq = torch.stack(inv_freqs).repeat_interleave(rows, dim=0)
        scale = torch.tensor(scales, dtype=torch.float, device=inv_freq.device).repeat_interleave(rows)
        cos, sin = cos_sin(inv_freq, scale[:, None], frame.q_pos, dtype, per_position=True)
        return prepared(cos.unsqueeze(1), sin.unsqueeze(1), self.rotator.layout)

    # the (cos, sin) a forward keeps of its groups' keys, for every layer: at most HELD_KEYS times
    # one layer's keys; the other groups' are computed in each layer
    HELD_KEYS = 2

    def _key_factors(self, key, groups: list, offset: int, first_key: int):
        """For each group, the prepared (cos, sin) [B or 1, 1, S, D] of the first S keys (through its
        last row) under its scaling. Those of the first groups, up to HELD_KEYS times the layer's
        keys, are kept for the forward (every layer uses them), the others computed in each layer
        and let go, so that a forward holds O(length) of them at any number of groups."""
        frame, (kv_len, dim), heads = self.rotator.frame, key.shape[-2:], key.shape[1]
        held = 0
        for length, _, hi, _ in groups:
            end = offset + hi
            held += 2 * end * dim

            def compute(length=length, end=end):
                inv_freq, scale = frame.angles(length)
                cos, sin = cos_sin(inv_freq, scale, frame.k_pos[:, first_key : first_key + end], key.dtype)
                return prepared(cos, sin, self.rotator.layout)

            if held <= self.HELD_KEYS * kv_len * heads * dim:
                yield self.rotator.per_forward(("group keys", length, first_key, end, key.dtype), compute)
            else:
                yield compute()

    def _counted(self, groups: list) -> list:
        if len(groups) > self.MANY_GROUPS and not self._warned:
            self._warned = True
            method, step = self.rotator.method.name, self.rotator.params.get("granularity", 1)
            warnings.warn(
                f"{method}: this forward attends its rows past the trained window in {len(groups)} groups (the causal "
                f"schedule at granularity {step}: one per scaling, each against its whole key prefix), so it takes "
                "several times plain attention's time; patch with a larger granularity=g to re-scale every g tokens "
                f"(about {len(groups) * step} / g groups, still exact between one forward and decoding) or causal=False "
                "for transformers' one scaling per forward",
                stacklevel=2,
            )
        return groups

    @staticmethod
    def _groups(lengths: torch.Tensor) -> list:
        """[(length, lo, hi, chosen)]: each scaling the queries use, the rows [lo, hi) that span
        its queries, and which of them (in each batch row) use it, [B, rows, 1, 1], or None where
        all do."""
        groups = []
        for length in torch.unique(lengths).tolist():
            rows = (lengths == length).any(0).nonzero()
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            chosen = lengths[:, lo:hi] == length
            groups.append((length, lo, hi, None if bool(chosen.all()) else chosen[..., None, None]))
        return groups

    def _scaling_holds(self, frame) -> bool:
        """Whether the next token's scaling is this forward's (inside the window, or within a
        granularity step past it): only then are this forward's rotated keys of use to the next."""
        return bool((self.rotator.rotation.scaled_lengths(frame.q_pos[:, -1:] + 1) == frame.lengths[:, -1:]).all())

    def _rotated(self, query, key, frame, length, q_span, k_span, held=True) -> tuple[torch.Tensor, torch.Tensor]:
        """(query, key) rotated with `length`'s scaling, the query tempered; (cos, sin) kept for the
        forward when `held`, else computed here and let go."""
        pairing = self.rotator.pairing
        q_factors = self.rotator.frame_factors(length, False, *q_span, query.dtype)
        if held:
            k_factors = self.rotator.frame_factors(length, True, *k_span, key.dtype)
        else:
            inv_freq, scale = frame.angles(length)
            k_cos, k_sin = cos_sin(inv_freq, scale, frame.k_pos[:, slice(*k_span)], key.dtype)
            k_factors = prepared(k_cos.unsqueeze(1), k_sin.unsqueeze(1), self.rotator.layout)
        q_rotated = self.rotator.temper(rotate_prepared(query.unsqueeze(2), *q_factors, *pairing)[:, :, 0], *q_span)
        return q_rotated, rotate_prepared(key.unsqueeze(2), *k_factors, *pairing)[:, :, 0]


def plain_softmax(module, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether the backend computes what attend_with_lse computes of the tensors it is handed:
    transformers' sdpa on a causal layer, without dropout, a position bias, a soft cap or sinks,
    outside autograd (the fused kernels' log-sum-exp carries no gradient, so parts merged by it
    would not either)."""
    config = getattr(module, "config", None)
    return (
        getattr(config, "_attn_implementation", None) == PREFIX + "sdpa"
        and getattr(module, "is_causal", True)
        and kwargs.get("is_causal") is not False
        and not kwargs.get("dropout")
        and all(kwargs.get(name) is None for name in ("softcap", "position_bias", "s_aux"))
        and not (torch.is_grad_enabled() and query.requires_grad)
    )


class PrefixRotation:
    """Keys [B, H, kv_len, D] rotated to one scaling after another, each time over a prefix of them
    (the causal schedule's groups), into one buffer: their swapped channels computed once, each
    rotation two products and a sum written in place (rope_ext.rotation.rotate_prepared, so its
    bits), each prefix's rotated keys contiguous, so that a short one stays in the CPU's caches
    for the attention that reads it."""

    def __init__(self, key: torch.Tensor, dim: int, layout: str, channels: str):
        self.key, self.layout = key, layout
        width = key.shape[-1]
        self.turned, self.kept = channel_split(width, dim, channels)
        self.swapped = swap(key[..., self.turned], layout)
        self.buffer = key.new_empty(key.numel())

    def __call__(self, end: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The first `end` keys rotated with the prepared (cos, sin) [B or 1, 1, end, dim]: a view of
        the buffer, valid until the next call."""
        batch, heads, _, width = self.key.shape
        out = self.buffer[: batch * heads * end * width].view(batch, heads, end, width)
        if self.kept.stop > self.kept.start:
            out[..., self.kept] = self.key[:, :, :end, self.kept]
        keys = self.key[:, :, :end, self.turned]
        rotate_prepared(keys, cos, sin, self.layout, out=out[..., self.turned], swapped=self.swapped[:, :, :end])
        return out
