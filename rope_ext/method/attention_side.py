"""Attention-side methods: what self_extend, rerope, string, dpe, dca and sink_window share, declared once.

An `AttentionMethod` changes the positions at which queries and keys meet inside attention, with
the trained frequencies unless it declares its own `fn` (string, past the window); how every such
method runs is docs/concepts.md, "How the attention-side methods run". A plain reload of a saved
checkpoint is the unpatched model (no native form), so the config keeps its trained window. The
base owns:

- its parameters are Params like every method's (rope_ext.method.base), checked by Method.validate;
  `causal` applies where the method `switches`, the query scales where `takes_query_scales`;
- what it requires of the model (`requires`, checked by rope_ext.method.base.refusal): its
  attention backends (`backends`), causal softmax attention over every key of the patch's length,
  and where it chooses keys by position (`chooses_keys`), no sliding window that hides one;
- the parameters it derives from the model (`resolve`, the hook of every method), with what the
  two-part methods share (`default_window`, and self_extend's and dpe's `reaching_group`);
- the transform installed in attention (`transform`, a rope_ext.attention.RotatingTransform), handed
  a rotator over the patch's rotary module (rope_ext.attention.Rotator).

`TwoPartMethod` is the two-part engine of self_extend, rerope, string and dpe (and any method of
that shape): for the queries the method `switched`, keys within its `near_window` keep their own
positions and the others meet the query at the method's `distant_query` / `distant_key` positions
(with `grouped`, one for each group of frequencies: dpe's), both parts in one softmax. A new method
of that shape is one class with those maps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import ClassVar

import torch

from rope_ext.attention.parts import (
    SCORE_BYTES,
    attend_one_row,
    attend_with_lse,
    exact_rows,
    hides_keys,
    merge_by_lse,
    window_parts,
)
from rope_ext.attention.rotator import KeyMaps, RotatingTransform, Rotator
from rope_ext.attention.schedule import RotateInAttention
from rope_ext.geometry import RotaryGeometry
from rope_ext.rotation import rotate_prepared

from .base import FrequencyFn, Method, ModelFacts, Requires, default_inv_freq


def trained_frequencies(geom: RotaryGeometry, seq_len=None, *, factor, **params) -> tuple[torch.Tensor, float]:
    """The model's own frequencies, for methods that change attention rather than the rotation."""
    return default_inv_freq(geom), 1.0


@dataclass(frozen=True)
class AttentionMethod(Method):
    """A method that attends at other positions (with the trained frequencies unless it gives its
    own `fn`). A subclass sets `transform` (its attention transform) and overrides `resolve` for what
    it derives from the model."""

    fn: FrequencyFn = field(default=trained_frequencies, kw_only=True)
    rotation: str = "attention"
    # What a query switches to once it has seen more than the trained window (e.g. "grouped
    # attention"), for a method where `causal` chooses when; None: every query's positions follow
    # from its own position, and the causal schedule does not apply.
    switches: str | None = None

    backends: ClassVar[tuple[str, ...]] = ("eager", "sdpa")  # take the [B, 1, Sq, Sk] masks the parts build
    # The method chooses the keys each query attends by their positions, so it cannot honour a mask
    # that hides keys (rope_ext.attention.Rotator.one_sequence): a model with sliding-window layers is refused.
    chooses_keys: ClassVar[bool] = False
    transform: ClassVar[type] = RotateInAttention

    @property
    def schedule(self) -> tuple[str, ...]:
        return ("causal",) if self.switches else ()

    def by_forward(self, params: dict) -> str | None:
        if self.switches and params.get("causal", True) is False:
            return f"switches every query of a forward to {self.switches} once that forward passes the trained window"
        return None

    @property
    def requires(self) -> Requires:
        """The base's, and: the backends it declares, plain causal softmax attention over every key
        of the patch's length, and, where it chooses keys by position, no sliding window shorter."""
        return replace(super().requires, backends=self.backends, own_attention=True, keys_by_position=self.chooses_keys)

    def attention(self, rotary, facts: ModelFacts, params: dict) -> list:
        return [self.transform(Rotator(rotary))]


def default_window(window_tokens: int) -> int:
    """The neighbour window of the two-part methods: a quarter of the trained window."""
    return max(1, window_tokens // 4)


def capacity(window_tokens: int, group: int, window: int) -> int:
    """Tokens a model trained on `window_tokens` reaches with grouped positions floor(i/G) past a
    neighbour window W (self_extend's, and dpe's in each group of frequencies): the farthest grouped
    distance, floor(i/G) + W - floor(W/G), stays below the trained window."""
    return group * (window_tokens - window + window // group)


def reaching_group(window_tokens: int, target: int, window: int, least: int = 2) -> int:
    """The smallest group from `least` on whose capacity reaches `target` tokens at neighbour
    window `window`."""
    # capacity <= G * (L - W) + W, so no smaller group reaches the target
    group = max(least, math.ceil(Fraction(target - window, window_tokens - window)))
    while capacity(window_tokens, group, window) < target:
        group += 1
    return group


@dataclass
class TwoParts:
    """What the layers of a forward share in TwoPartAttention (`shared`): which queries attend in two
    parts (`extended` [B, Sq]; `first`, the first row that does, None: none does), the neighbour
    window, the queries' prepared (cos, sin), the key maps with the forward's new keys' (cos, sin)
    (KeyMaps), and whether the rows past the window attend without masks."""

    first: int | None
    extended: torch.Tensor
    window: int
    queries: tuple
    keys: KeyMaps
    unmasked: bool


class TwoPartAttention(RotatingTransform):
    """Rotates queries and keys itself with its rotator (the KV-cache tracking, the rotations, the
    keys kept between forwards) and attends with the method's neighbour and distant positions in
    one softmax. Causality is by key index, as in the model: with left padding the real tokens are
    contiguous, so index distances are position distances."""

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        rotator = self.rotator
        query = rotator.scale_queries(query)
        kv_len, q_len = key.shape[-2], query.shape[-2]
        step = self.step("two parts", query, key, attention_mask)
        # every query rotated to its own (and, from `first` on, its distant) position, every key
        # (kept between forwards) to its own and, where the method moves it, its distant one
        queries = rotator.temper(rotate_prepared(query.unsqueeze(2), *step.queries, *rotator.pairing))
        keys = rotator.keys_at(module, key, step.keys)
        first, window = step.first, step.window
        if first is None:
            return attend(module, queries[:, :, 0], keys[:, :, 0], value, attention_mask, **kwargs)
        offset = kv_len - q_len  # query row r is key index offset + r
        (q_own, q_group), k_maps = queries.unbind(2), keys.unbind(2)
        q_group, k_group, k_own = (q_group[:, :, first:] if first else q_group), k_maps[0], k_maps[-1]
        extended = step.extended
        outputs = []
        if first:
            outputs.append(exact_rows(module, q_own, k_own, value, attention_mask, attend, offset, first, kwargs))
        scaling = kwargs.get("scaling")
        if step.unmasked:
            outputs.append(
                self._unmasked_rows(
                    q_own[:, :, first:] if first else q_own, k_own, q_group, k_group, value, offset + first, window, scaling
                )
            )
        else:
            rows = max(1, SCORE_BYTES // (query.shape[0] * query.shape[1] * (kv_len + window) * 4))
            for lo in range(first, q_len, rows):
                hi = min(lo + rows, q_len)
                outputs.append(
                    self._masked_rows(
                        (q_own, k_own),
                        (q_group, k_group),
                        value,
                        attention_mask,
                        extended,
                        offset,
                        first,
                        lo,
                        hi,
                        window,
                        scaling,
                    ).transpose(1, 2)
                )
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None

    def shared(self, q_len: int, kv_len: int, q_dtype, k_dtype, attention_mask) -> TwoParts:
        """What every layer of a forward with these lengths, dtypes and mask shares: computed by the
        first such layer, in this one call, and read by the others."""
        rotator = self.rotator
        frame, method, params = rotator.frame, rotator.method, rotator.params
        trained = rotator.geometry.original_window
        k_pos = rotator.key_positions(kv_len)
        inv_freq, scale = frame.angles(trained)  # the method's frequencies (the trained ones, or string's over YaRN)
        # [B, Sq]: queries that attend in two parts; the first row that does (None: none does)
        extended = method.switched(frame, trained, params)
        rows = extended.any(0).nonzero()
        first = int(rows[0]) if rows.numel() else None
        grouped = method.grouped and first is not None
        # with grouped distant positions, the own ones as one group: one rotation serves both
        own = (lambda at: at[..., None]) if grouped else (lambda at: at)
        q_maps = (own,) if first is None else (own, lambda at: method.distant_query(at, params))
        if first is None or method.distant_keys_own:
            names, k_maps = ("own",), (own,)
        else:  # the distant map first: the keys' maps and the queries' are then one run, (distant, own, distant)
            names, k_maps = ("distant", "own"), (lambda at: method.distant_key(at, params), own)
        window, held = method.near_window(params), kv_len - q_len
        if q_dtype == k_dtype:
            # the new keys sit at the queries' positions: one computation for both, their own map's once
            maps = rotator.factors([at(frame.q_pos) for at in k_maps + q_maps[1:]], inv_freq, scale, q_dtype, grouped)
            split = len(k_maps) - 1
            queries, new_keys = tuple(t[:, :, split:] for t in maps), tuple(t[:, :, : split + 1] for t in maps)
        else:
            queries = rotator.factors([at(frame.q_pos) for at in q_maps], inv_freq, scale, q_dtype, grouped)
            new_keys = rotator.factors([at(k_pos[:, held:]) for at in k_maps], inv_freq, scale, k_dtype, grouped)
        return TwoParts(
            first=first,
            extended=extended,
            window=window,
            queries=queries,
            keys=KeyMaps(names, k_pos, k_maps, (inv_freq, scale), grouped, (held, new_keys)),
            # with no mask to honour but the causal one and every row from `first` on past the window
            # (one sequence), the parts need no mask of their own; otherwise (padding) each block of
            # rows gets one
            unmasked=first is not None
            and not hides_keys(attention_mask, kv_len)
            and bool(extended[:, first:].all())
            and held + first >= window,
        )

    @staticmethod
    def _unmasked_rows(q_own, k_own, q_group, k_group, value, first, window, scaling):
        """Query rows that are key indices first, first + 1, ... (first >= window), all past the
        trained window and with no mask to honour but the causal one, as [B, rows, H, D], in calls
        without a mask: the neighbours (rope_ext.attention.window_parts), and the distant keys
        j <= q - window as the keys every row has, j < first - window, and a causal square after them.
        A single row (a decode step) is one call for each part."""
        rows = q_own.shape[-2]
        far = first - window  # the last distant key of row r is far + r
        if rows == 1:
            near = slice(far + 1, first + 1)
            return attend_one_row(
                [(q_group, k_group[:, :, : far + 1], value[:, :, : far + 1]), (q_own, k_own[:, :, near], value[:, :, near])],
                scaling,
            )
        distant = []
        if far:
            distant.append(attend_with_lse(q_group, k_group[:, :, :far], value[:, :, :far], scale=scaling))
        ahead = slice(far, far + rows)
        distant.append(attend_with_lse(q_group, k_group[:, :, ahead], value[:, :, ahead], causal=True, scale=scaling))
        outputs = [
            merge_by_lse([(out[:, :, lo:hi], lse[:, :, lo:hi], None) for out, lse in distant] + near)
            for lo, hi, near in window_parts(q_own, k_own, value, first, window, scaling)
        ]
        return torch.cat(outputs, dim=2).transpose(1, 2)

    def _masked_rows(self, own, grouped, value, mask, extended, offset, first, lo, hi, window, scaling):
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
        out, lse = attend_with_lse(
            q_own[:, :, lo:hi], k_own[:, :, near_lo:end], value[:, :, near_lo:end], mask=near_mask, scale=scaling
        )
        parts = [(out, lse, (near_mask > torch.finfo(dtype).min).any(-1))]
        if far_end:
            far_ok = (rows_extended[:, :, None] & ((q_index[:, None] - far[None, :]) >= window)[None])[:, None]
            far_mask = self._additive(far_ok, None if mask is None else mask[:, :, lo:hi, :far_end], dtype)
            out, lse = attend_with_lse(
                q_group[:, :, lo - first : hi - first],
                k_group[:, :, :far_end],
                value[:, :, :far_end],
                mask=far_mask,
                scale=scaling,
            )
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


@dataclass(frozen=True)
class TwoPartMethod(AttentionMethod):
    """The two-part engine's method: `near_window`, `distant_query` and `distant_key` (positions as
    int or fp32 tensors; RoPE takes fractional positions as they are). The engine keeps the keys
    rotated to their own positions and, unless `distant_keys_own` (distant keys at their own
    positions too), to their distant ones: one or two copies of the key cache (RotatedKeys)."""

    transform: ClassVar[type] = TwoPartAttention
    distant_keys_own: ClassVar[bool] = False
    # The distant maps give [..., S, G], a position for each of G equal groups of frequencies
    # (rope_ext.rotation.cos_sin), not one for every frequency: dpe's dimension groups.
    grouped: ClassVar[bool] = False

    def near_window(self, params: dict) -> int:
        """The index distance from which a key is attended at the distant positions."""
        return params["window"]

    def switched(self, frame, trained: int, params: dict) -> torch.Tensor:
        """[B, Sq]: the queries that attend in two parts, here those past the trained window under
        the method's schedule (`frame.lengths`, rope_ext.rotary); the others attend as the
        unpatched model."""
        return frame.lengths > trained

    def distant_query(self, q_pos: torch.Tensor, params: dict) -> torch.Tensor:
        raise NotImplementedError

    def distant_key(self, k_pos: torch.Tensor, params: dict) -> torch.Tensor:
        raise NotImplementedError

    def reached(self, factor: float | None, reach: int, trained: int, setting: str, remedy: str) -> float:
        """The factor of a setting that reaches `reach` tokens: its capacity when no factor is given,
        else `factor` after checking the setting reaches it; ValueError naming `setting` (and
        `remedy` when it falls short) otherwise."""
        if factor is None:
            factor = reach / trained
        elif reach < factor * trained * (1 - 1e-12):
            raise ValueError(f"{self.name}: {setting} reaches {reach} tokens, less than factor {factor:g} x {trained}{remedy}")
        if not factor > 1:
            raise ValueError(f"{self.name}: {setting} does not extend a {trained}-token window")
        return factor

    def neighbour_window(self, params: dict, trained: int) -> int:
        """`window`, or its default, checked against the trained window."""
        window = params["window"] if params["window"] is not None else default_window(trained)
        if window >= trained:
            raise ValueError(f"{self.name}: the neighbour window ({window}) must be smaller than the trained window ({trained})")
        return window
