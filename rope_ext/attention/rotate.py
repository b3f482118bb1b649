"""The rotation inside attention, for patches whose KV cache holds keys before rotation
(rope_ext.rotary): queries and keys are rotated here, with the frame the rotary module computed
for this forward, before the backend sees them."""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from typing import Callable

import torch
from transformers.cache_utils import DynamicLayer

from rope_ext.rotation import cos_sin, prepared, rotate_prepared

from .interface import PREFIX, AttentionTransform, passed_cache
from .parts import attend_with_lse, causal_mask, hides_keys, merge_by_lse


class RotatedKeys:
    """Each KV cache's keys (by the cache object's identity, weakly, as rotary.KeyPositions) rotated
    to one position map, per layer and map, kept between the forwards of a decode: a step rotates
    only its new keys. A map is named by what fixes each key's angles for the cache's life (a
    dynamic method's scaling; an attention-side method's own or grouped positions), so a name
    never serves other angles. Each map kept takes as much memory as the key cache again, and up
    to a quarter more (room for the next steps' keys).

    A layer's rotated keys hold while the layer's key tensor is the one they were rotated from:
    transformers' DynamicLayer replaces that tensor on every change (update, crop, reorder_cache,
    batch_repeat_interleave, batch_select_indices), so a cache changed between forwards is rotated
    again in full, never served stale, and a map a forward did not use is let go before the next.
    Other cache layers (which may write in place) are always rotated in full. A copy of the store
    (deepcopy or pickle of the model) starts empty."""

    def __init__(self):
        self._caches: list[tuple[weakref.ref, dict]] = []
        self._lock = threading.Lock()  # threads running the model at once, each with its own cache

    def __reduce__(self):
        return (RotatedKeys, ())

    def entries(self, cache) -> dict:
        """{(layer index, map name): (number of keys, (B, H, D), rotated keys in a buffer with room
        for more, weak reference to the key tensor they came from)}."""
        found = next((entries for ref, entries in self._caches if ref() is cache), None)
        if found is None:
            with self._lock:
                found = {}
                self._caches = [(ref, entries) for ref, entries in self._caches if ref() is not None]
                self._caches.append((weakref.ref(cache), found))
        return found

    def check(self, cache) -> None:
        """Before a forward: let go of the entries of `cache` whose layer changed since they were rotated."""
        cache_layers = getattr(cache, "layers", None)
        if cache_layers is None:
            return
        entries = self.entries(cache)
        for index, name in list(entries):
            if index >= len(cache_layers) or getattr(cache_layers[index], "keys", None) is not entries[index, name][-1]():
                del entries[index, name]


class RotateInAttention(AttentionTransform):
    """Rotates queries and keys inside attention for a dynamic rotary module (see rotary.py), the
    queries scaled first where the patch has `logn` on (`scale_queries`).

    Queries that use different scalings (causal schedule past the window) are attended in groups,
    each against keys rotated with that group's scaling; causality is by index, as in the model.
    On sdpa, with no mask to honour but the causal one, the groups attend in fused calls without a
    mask, their rotations batched (`_unmasked_groups`); otherwise (padding, eager, autograd) each
    group is a backend call with its mask. Either way a forward keeps the keys' (cos, sin) of its
    first groups only (HELD_GROUPS of them, or HELD_KEYS times a layer's keys) and computes the
    others' in every layer, so it holds O(length) of them at any number of groups (a prompt of L
    tokens past the window at granularity 1 is L groups).

    One transform serves every layer: what every layer of a forward would compute alike (cos/sin
    of the same positions, the checks of the positions) it computes once per forward
    (`per_forward`). The attention-side methods' transforms hold one as their rotation store
    (RotatesWithStore) and call it for what they need."""

    HELD_GROUPS = 4
    # a forward in more groups than this is told once what the schedule costs (PatchInfo.notes)
    MANY_GROUPS = 64

    def __init__(self, rotary):
        self.rotary = rotary
        self._hooks: list = []
        self.rotated = RotatedKeys()
        self._warned = False  # of many groups in a forward (_counted), once per patch

    def attach(self, site) -> None:
        """Track the KV cache around each forward of the decoder (see ExtendedRotaryEmbedding).
        The hooks are bound methods, not closures: `copy.deepcopy` of the model then gives hooks
        that call the copy's rotary module."""
        self._hooks = [
            site.decoder.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            site.decoder.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def _before_forward(self, module, args, kwargs) -> None:
        cache = passed_cache(kwargs)
        self.rotary.before_forward(cache)
        if cache is not None:
            self.rotated.check(cache)

    def _after_forward(self, module, args, kwargs, output) -> None:
        self.rotary.after_forward(getattr(output, "cache", None))
        self.rotary.rotation.state.memo = (None, {})  # the forward's cos/sin would otherwise stay held until the next one

    def detach(self, site) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def frame(self):
        """The frame of the calling thread's forward (rope_ext.rotary.ForwardState); where this
        thread ran none (autograd's thread re-running attention for gradient checkpointing on a
        GPU), the latest forward's: DynamicRotation.current, read here as values, so that a layer
        calls nothing in rope_ext/rotary.py."""
        rotation = self.rotary.rotation
        frame = rotation.state.frame
        return rotation.frame if frame is None else frame

    @property
    def pending_cache(self):
        """The KV cache the calling thread's forward extends (None: none, or a forward of
        remote-code ChatGLM, whose rotary module tracks none)."""
        return self.rotary.rotation.state.cache

    def __call__(self, module, query, key, value, attention_mask, attend: Callable, **kwargs):
        query = self.scale_queries(query)
        frame = self.frame
        kv_len, q_len = key.shape[-2], query.shape[-2]
        written = frame.k_pos.shape[-1]
        if written < kv_len:
            raise RuntimeError(f"rope_ext: the KV cache returned {kv_len} keys but the patched model wrote {written}")
        first_key = written - kv_len  # sliding-window caches return only the most recent keys
        groups = self.per_forward(("groups", q_len), lambda: self._counted(self._groups(frame.lengths)))
        if len(groups) == 1:
            length, pairing = groups[0][0], self.rotary.geometry.pairing
            kept = self.kept_keys(
                module,
                key,
                (("scaled", length),),
                lambda start, stop: self.frame_factors(length, True, first_key + start, first_key + stop, key.dtype),
                keep=self.per_forward(("scaling holds",), lambda: self._scaling_holds(frame)),
            )
            q_rotated = rotate_prepared(query.unsqueeze(2), *self.frame_factors(length, False, 0, q_len, query.dtype), *pairing)
            q_rotated = self.temper(q_rotated)
            return attend(module, q_rotated[:, :, 0], kept[:, :, 0], value, attention_mask, **kwargs)
        offset = kv_len - q_len
        if (
            all(chosen is None for *_, chosen in groups)
            and self.per_forward(
                ("causal only", kv_len, id(attention_mask)),  # the mask lives through the forward: its id names it there
                lambda: not hides_keys(attention_mask, kv_len),
            )
            and self._attends_last(module)
            and plain_softmax(module, query, kwargs)
        ):
            return self._unmasked_groups(query, key, value, groups, offset, first_key, kwargs.get("scaling")), None
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

    def _attends_last(self, module) -> bool:
        """Whether this transform hands its tensors to the backend itself: no transform after it in
        the module's chain (alibi_hybrid's bias) changes what is attended."""
        chain = getattr(module, "rope_ext_attention", None)
        return chain is not None and chain.transforms[-1] is self

    def _unmasked_groups(self, query, key, value, groups: list, offset: int, first_key: int, scaling) -> torch.Tensor:
        """The groups of a forward ([(length, lo, hi, None)], every batch row alike) attended in calls
        without a mask, as [B, Sq, H, D] (the backends' layout): the queries rotated in one operation,
        each row at its group's scaling; the keys in blocks of groups (`_key_blocks`), each block one
        rotation of its longest key prefix to every scaling in it; for each group its causal square
        and the keys before it (which all its rows see) in one call each; all the rows' parts merged
        by log-sum-exp into one softmax at once. The same function as a call per group with its
        causal mask, in a few operations per group rather than some thirty: on a GPU a launch each."""
        pairing = self.rotary.geometry.pairing
        q_factors = self.per_forward(
            ("group queries", query.dtype),
            lambda: tuple(
                torch.cat(parts, dim=-2)
                for parts in zip(*(self.frame_factors(length, False, lo, hi, query.dtype) for length, lo, hi, _ in groups))
            ),
        )
        queries = self.temper(rotate_prepared(query.unsqueeze(2), *q_factors, *pairing)[:, :, 0])
        squares, earlier = [], []
        for start, stop, k_factors in self._key_blocks(key, groups, offset, first_key):
            keys = rotate_prepared(key[:, :, : k_factors[0].shape[-2]].unsqueeze(2), *k_factors, *pairing)
            for at, (_, lo, hi, _) in enumerate(groups[start:stop]):
                first, end = offset + lo, offset + hi  # the group's rows are key indices first .. end - 1
                rows = queries[:, :, lo:hi]
                squares.append(
                    attend_with_lse(rows, keys[:, :, at, first:end], value[:, :, first:end], causal=True, scale=scaling)
                )
                if first:
                    earlier.append(attend_with_lse(rows, keys[:, :, at, :first], value[:, :, :first], scale=scaling))
                else:  # no key before the group's first row (the first group of a prompt)
                    out, lse = squares[-1]
                    earlier.append((out.new_zeros(out.shape), lse.new_full(lse.shape, float("-inf"))))
        parts = [(torch.cat([o for o, _ in p], dim=2), torch.cat([l for _, l in p], dim=-1), None) for p in (squares, earlier)]
        return merge_by_lse(parts).transpose(1, 2)

    # The rotated keys of a block of groups (_key_blocks), in elements: on the CPU a block its caches
    # hold (the rotation is a few passes over it), elsewhere up to BLOCK_KEYS times one layer's keys
    # (fewer, larger operations: a launch each).
    CPU_BLOCK_ELEMENTS = 1 << 20
    BLOCK_KEYS = 2
    # the (cos, sin) a forward keeps of its groups' keys: at most HELD_KEYS times one layer's keys
    HELD_KEYS = 2

    def _key_blocks(self, key, groups: list, offset: int, first_key: int):
        """(start, stop, (cos, sin)): consecutive groups [start, stop) and the prepared (cos, sin)
        [B or 1, 1, stop - start, S, D] of the first S keys (through the last group's last row) under
        each group's scaling, one computation per block (CPU_BLOCK_ELEMENTS, BLOCK_KEYS). The (cos, sin) of the
        first blocks, up to HELD_KEYS times the layer's keys, are kept for the forward (every layer
        uses them), the others computed in each layer and let go, so a forward holds O(length) of
        them at any number of groups."""
        frame, (kv_len, dim), heads = self.rotary.rotation.frame, key.shape[-2:], key.shape[1]
        room = self.CPU_BLOCK_ELEMENTS if key.device.type == "cpu" else self.BLOCK_KEYS * kv_len * heads * dim
        held, start = 0, 0
        while start < len(groups):
            stop = start + 1
            while stop < len(groups) and (stop + 1 - start) * (offset + groups[stop][2]) * heads * dim <= room:
                stop += 1
            end = offset + groups[stop - 1][2]
            lengths = tuple(length for length, *_ in groups[start:stop])

            def compute(lengths=lengths, end=end):
                angles = [frame.angles(length) for length in lengths]
                inv_freq = torch.stack([f for f, _ in angles])
                scale = torch.tensor([s for _, s in angles], dtype=torch.float)
                cos, sin = cos_sin(inv_freq, scale, frame.k_pos[:, first_key : first_key + end], key.dtype)
                return prepared(cos, sin, self.rotary.geometry.layout)

            held += 2 * (stop - start) * end * dim
            if held <= self.HELD_KEYS * kv_len * heads * dim:
                factors = self.per_forward(("group keys", lengths, first_key, end, key.dtype), compute)
            else:
                factors = compute()
            yield start, stop, factors
            start = stop

    def _counted(self, groups: list) -> list:
        if len(groups) > self.MANY_GROUPS and not self._warned:
            self._warned = True
            method, step = self.rotary.method.name, self.rotary.params.get("granularity", 1)
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

    def per_forward(self, key, compute: Callable):
        """compute(), once per forward (per frame) and `key`: the layers of a forward share the
        positions, so what follows from them alone is the same in every layer."""
        frame, state = self.frame, self.rotary.rotation.state
        if state.memo[0] is not frame:
            state.memo = (frame, {})
        memo = state.memo[1]
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def scale_queries(self, query: torch.Tensor) -> torch.Tensor:
        """query [B, H, Sq, D] with the `logn` parameter on (docs/logn.md): each row at a position p
        past the trained window L times log(p + 1) / log(L), Qwen's log-n scale, so that attention
        over more keys than L stays about as sharp as over L; the rest times exactly 1, so the rows
        inside the window keep their bits. The scale commutes with the rotation: applied first, it
        reaches every way the query is attended afterwards (in parts, at other positions)."""
        if not self.rotary.params.get("logn"):
            return query
        scale = self.per_forward(("logn", query.dtype), lambda: self._logn_scale(query.dtype))
        return query if scale is None else query * scale

    def _logn_scale(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[B, 1, Sq, 1]: the log-n scale of each query row; None when every row is inside the window."""
        q_pos, window = self.frame.q_pos, self.rotary.geometry.original_window
        past = q_pos + 1 > window
        if not bool(past.any()):
            return None
        scale = torch.where(past, (q_pos + 1).float().log() / math.log(window), 1.0)  # fp32, as the angles
        return scale[:, None, :, None].to(dtype)

    def temper(self, rotated: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rotated query rows [lo, hi) ([B, H, rows, D], or [B, H, P, rows, D] at P positions each)
        times Llama 4's attention temperature where `attn_scale` is set. Applied after the rotation
        and rounded to the query's dtype, as transformers' Llama4TextAttention and Ministral3Attention
        apply it, so that the bits agree with theirs."""
        if not self.rotary.params.get("attn_scale"):
            return rotated
        scales = self.per_forward(("attn scales",), self._attn_scales)[..., lo:hi, :]
        return (rotated * (scales.unsqueeze(2) if rotated.dim() == 5 else scales)).to(rotated.dtype)

    def _attn_scales(self) -> torch.Tensor:
        """[B, 1, Sq, 1] fp32: 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) for each query
        position p, in the operations of transformers' Llama4TextAttention (a step every floor_scale
        tokens; the first step at p + 1 = floor_scale)."""
        params = self.rotary.params
        floor = params["floor_scale"] or self.rotary.geometry.original_window
        positions = self.frame.q_pos
        return (torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * params["attn_scale"] + 1.0)[:, None, :, None]

    def rotate_to(
        self, x: torch.Tensor, key, positions: Callable, inv_freq: torch.Tensor, scale: float, grouped: bool = False
    ) -> torch.Tensor:
        """x [B, H, S, D] rotated to each of `positions()`, a tuple of P position tensors [B or 1, S]
        (with `grouped`, [B or 1, S, G]: a position for each group of frequencies, rope_ext.rotation.cos_sin),
        with the given frequencies: [B, H, P, S, D], one rotation for all P. `key` names the
        positions and frequencies (the same key, the same ones, in every layer of the forward): their
        (cos, sin), and the positions themselves, are computed once per forward."""
        factors = self._factors(("queries", key), positions, inv_freq, scale, x.dtype, grouped)
        return rotate_prepared(x.unsqueeze(2), *factors, *self.rotary.geometry.pairing)

    def _factors(self, key, positions: Callable, inv_freq, scale, dtype, grouped=False) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B or 1, 1, P, S, D] of each of `positions()`, prepared (rope_ext.rotation), once
        per forward and `key`. Each position tensor's (cos, sin) are computed apart, as they would be
        alone, so that their bits do not depend on what else is rotated with them."""

        def compute():
            pairs = [cos_sin(inv_freq, scale, at, dtype, grouped) for at in positions()]
            return prepared(
                torch.stack([c for c, _ in pairs], 1), torch.stack([s for _, s in pairs], 1), self.rotary.geometry.layout
            )

        return self.per_forward((key, dtype), compute)

    def received(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the queries, scaled where `logn` is on; the positions [B, kv_len] of the keys) for a
        transform that rotates them itself."""
        return self.scale_queries(query), self.key_positions(key.shape[-2])

    def key_positions(self, kv_len: int) -> torch.Tensor:
        """[B, kv_len]: the positions of the keys attention received, the newest kv_len the patch wrote."""
        k_pos = self.frame.k_pos
        if k_pos.shape[-1] < kv_len:
            raise RuntimeError(f"rope_ext: the KV cache returned {kv_len} keys but the patched model wrote {k_pos.shape[-1]}")
        return k_pos[..., -kv_len:]

    def one_sequence(self, attention_mask, kv_len: int, q_len: int, method: str, from_zero: bool = False) -> int:
        """The position of the first of the kv_len keys, after checking that the positions are
        those of one unpadded sequence (the same in every row, consecutive; with `from_zero`, every
        key written since position 0, of which a cache may have let some go). Methods that choose
        keys by index need it: a mask that hides keys from the newest query (padding, a sliding
        window) cannot be honoured either. Checked once per forward and mask: the layers share both."""
        # the mask lives through the forward, so its id names it there
        return self.per_forward(
            ("one sequence", kv_len, q_len, from_zero, id(attention_mask)),
            lambda: self._one_sequence(attention_mask, kv_len, q_len, method, from_zero),
        )

    def _one_sequence(self, attention_mask, kv_len: int, q_len: int, method: str, from_zero: bool) -> int:
        frame = self.frame
        k_pos, q_pos = (frame.k_pos if from_zero else frame.k_pos[..., -kv_len:]), frame.q_pos
        first = 0 if from_zero else int(k_pos[0, 0])
        expected = torch.arange(first, first + k_pos.shape[-1], device=k_pos.device)
        consecutive = bool((k_pos == expected).all()) and bool((q_pos == expected[expected.numel() - q_len :]).all())
        if hides_keys(attention_mask, kv_len) or not consecutive:
            start = " from position 0" if from_zero else ""
            raise ValueError(
                f"{method}: positions must be those of one unpadded sequence{start} (padded batches and sliding "
                "windows are not supported); run one sequence at a time"
            )
        return first

    def keys_at(
        self, module, key: torch.Tensor, names: tuple, k_pos: torch.Tensor, maps: tuple, inv_freq, scale, grouped: bool = False
    ) -> torch.Tensor:
        """`key` (the keys attention received) rotated to each position map maps[m](k_pos) [B or 1,
        kv_len] (with `grouped`, [B or 1, kv_len, G], as rotate_to), named names[m], with the given
        frequencies: [B, H, M, kv_len, D], kept between forwards (kept_keys). The maps and the
        frequencies must be the patch's for the cache's life, and each key's positions follow from
        its own position alone."""

        def rotation(start: int, stop: int):
            return self._factors(
                ("keys", names, start, stop),
                lambda: [at(k_pos[:, start:stop]) for at in maps],
                inv_freq,
                scale,
                key.dtype,
                grouped,
            )

        return self.kept_keys(module, key, names, rotation)

    def kept_keys(self, module, key: torch.Tensor, names, rotation: Callable, keep: bool = True) -> torch.Tensor:
        """`key` (the keys attention received, [B, H, kv_len, D]) rotated by `rotation(start, stop)`,
        the prepared (cos, sin) [B or 1, 1, M, stop - start, D] of keys start:stop under the position
        maps `names` (RotatedKeys): [B, H, M, kv_len, D]. Where `key` is a DynamicLayer's whole
        cache in a forward without autograd, the keys before this forward come from the store
        (self.rotated) where it holds them under `names`, the new ones are rotated here, and the
        store then holds them all if `keep` (the next forward needs them); otherwise every key is
        rotated here."""
        pairing, kv_len = self.rotary.geometry.pairing, key.shape[-2]
        index = self._stored_layer(module, key)
        if index is None:
            return rotate_prepared(key.unsqueeze(2), *rotation(0, kv_len), *pairing)
        entries = self.rotated.entries(self.pending_cache)
        held = kv_len - self.frame.q_pos.shape[-1]
        entry = entries.get((index, names))
        if (
            entry is not None
            and entry[0] == held
            and entry[1].shape[:3] == (*key.shape[:2], len(names))
            and entry[1].shape[-1] == key.shape[-1]
            and entry[1].dtype == key.dtype
            and entry[1].device == key.device
        ):
            buffer = entry[1]
            if buffer.shape[-2] < kv_len:
                buffer = self._grown(buffer, kv_len, held)
            new_keys = key.narrow(-2, held, kv_len - held).unsqueeze(2)
            rotate_prepared(new_keys, *rotation(held, kv_len), *pairing, out=buffer.narrow(-2, held, kv_len - held))
        else:
            # no room yet: a map the next step does not use (a dynamic scaling that moves at every
            # step past the window) would make room a copy for nothing
            buffer = rotate_prepared(key.unsqueeze(2), *rotation(0, kv_len), *pairing)
        if keep:
            entries[index, names] = (kv_len, buffer, weakref.ref(key))
        else:
            entries.pop((index, names), None)
        return buffer[..., :kv_len, :]

    def _stored_layer(self, module, key: torch.Tensor) -> int | None:
        """The index of the DynamicLayer whose whole cache `key` is, in a forward without autograd;
        None where the store does not apply."""
        # the remote-code ChatGLM rotary module tracks no pending cache: its keys are rotated in full
        cache, index = self.pending_cache, getattr(module, "layer_idx", None)
        cache_layers = getattr(cache, "layers", None)
        if torch.is_grad_enabled() or index is None or cache_layers is None or index >= len(cache_layers):
            return None
        if type(cache_layers[index]) is not DynamicLayer or cache_layers[index].keys is not key:
            return None
        if self.frame.k_pos.shape[-1] != key.shape[-2]:  # the positions of all the layer's keys, first at 0
            return None
        return index

    def frame_factors(self, length: int, keys: bool, start: int, stop: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The frame's (cos, sin) for queries (or keys) start:stop under `length`'s scaling, prepared
        (rope_ext.rotation) with one map: [B, 1, 1, stop - start, D], once per forward."""
        return self.per_forward(
            ("frame", length, keys, start, stop, dtype),
            lambda: prepared(
                *(t.unsqueeze(1) for t in self.frame.rotation(length, keys, start, stop, dtype)),
                self.rotary.geometry.layout,
            ),
        )

    def _scaling_holds(self, frame) -> bool:
        """Whether the next token's scaling is this forward's (inside the window, or within a
        granularity step past it): only then are this forward's rotated keys of use to the next."""
        rotation = getattr(self.rotary, "rotation", None)
        if rotation is None:
            return True
        return bool((rotation.scaled_lengths(frame.q_pos[:, -1:] + 1) == frame.lengths[:, -1:]).all())

    @staticmethod
    def _grown(buffer: torch.Tensor, kv_len: int, held: int) -> torch.Tensor:
        """Room for kv_len keys and a quarter more (the next steps then write their keys in place,
        not a copy of the whole cache), holding `buffer`'s first `held`."""
        grown = buffer.new_empty((*buffer.shape[:-2], kv_len + kv_len // 4 + 64, buffer.shape[-1]))
        grown[..., :held, :] = buffer[..., :held, :]
        return grown

    def _rotated(self, query, key, frame, length, q_span, k_span, held=True) -> tuple[torch.Tensor, torch.Tensor]:
        """(query, key) rotated with `length`'s scaling, the query tempered; (cos, sin) kept for the
        forward when `held`, else computed here and let go."""
        pairing = self.rotary.geometry.pairing
        q_factors = self.frame_factors(length, False, *q_span, query.dtype)
        if held:
            k_factors = self.frame_factors(length, True, *k_span, key.dtype)
        else:
            inv_freq, scale = frame.angles(length)
            k_cos, k_sin = cos_sin(inv_freq, scale, frame.k_pos[:, slice(*k_span)], key.dtype)
            k_factors = prepared(k_cos.unsqueeze(1), k_sin.unsqueeze(1), self.rotary.geometry.layout)
        q_rotated = self.temper(rotate_prepared(query.unsqueeze(2), *q_factors, *pairing)[:, :, 0], *q_span)
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


class RotatesWithStore(AttentionTransform):
    """An attention transform that rotates queries and keys itself, in place of RotateInAttention
    (`rotates`), and holds one as its rotation store (`store`): the store's hooks track the KV
    cache around each forward (attach/detach are handed to it), and the transform calls it for what
    it needs (positions, rotations, keys kept rotated between forwards, what a forward computes
    once). One store per transform: every layer of a forward shares its per-forward cache."""

    rotates = True

    def __init__(self, rotary):
        self.rotary = rotary
        self.store = RotateInAttention(rotary)

    def attach(self, site) -> None:
        self.store.attach(site)

    def detach(self, site) -> None:
        self.store.detach(site)
