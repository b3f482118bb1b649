"""The rotation inside attention, for patches whose KV cache holds keys before rotation
(rope_ext.rotary): queries and keys are rotated here, with the frame the rotary module computed
for this forward, before the backend sees them."""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch
from transformers.cache_utils import DynamicLayer

from rope_ext.rotation import apply_rotary, cos_sin

from .interface import AttentionTransform, passed_cache
from .parts import causal_mask, hides_keys


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

    def __reduce__(self):
        return (RotatedKeys, ())

    def entries(self, cache) -> dict:
        """{(layer index, map name): (number of keys, (B, H, D), rotated keys in a buffer with room
        for more, weak reference to the key tensor they came from)}."""
        found = next((entries for ref, entries in self._caches if ref() is cache), None)
        if found is None:
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
    The first HELD_GROUPS groups keep their keys' (cos, sin) for the whole forward; the others
    compute theirs in every layer and let them go, so a forward holds O(length) of them at any
    number of groups (a prompt of L tokens past the window at granularity 1 is L groups).

    One transform serves every layer: what every layer of a forward would compute alike (cos/sin
    of the same positions, the checks of the positions) it computes once per forward
    (`per_forward`)."""

    HELD_GROUPS = 4

    def __init__(self, rotary):
        self.rotary = rotary
        self._hooks: list = []
        self._forward: tuple = (None, {})
        self.rotated = RotatedKeys()

    def __getstate__(self):
        # pickled by torch.save(model): what a forward left (its frame, whose lru_cache does not
        # pickle, and what it computed from it) is not state
        return {**self.__dict__, "_forward": (None, {})}

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
        self._forward = (None, {})  # the forward's cos/sin would otherwise stay held until the next one

    def detach(self, site) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __call__(self, module, query, key, value, attention_mask, attend: Callable, **kwargs):
        query = self.scale_queries(query)
        frame = self.rotary.frame
        kv_len, q_len = key.shape[-2], query.shape[-2]
        written = frame.k_pos.shape[-1]
        if written < kv_len:
            raise RuntimeError(f"rope_ext: the KV cache returned {kv_len} keys but the patched model wrote {written}")
        first_key = written - kv_len  # sliding-window caches return only the most recent keys
        groups = self.per_forward(("groups", q_len), lambda: self._groups(frame.lengths))
        if len(groups) == 1:
            length = groups[0][0]
            kept = self.kept_keys(
                module,
                key,
                ("scaled", length),
                lambda start, stop: frame.rotation(length, True, first_key + start, first_key + stop, key.dtype),
                keep=self.per_forward(("scaling holds",), lambda: self._scaling_holds(frame)),
            )
            q_cos, q_sin = frame.rotation(length, False, 0, q_len, query.dtype)
            q_rotated = apply_rotary(query, q_cos, q_sin, self.rotary.geometry.layout)
            return attend(module, q_rotated, kept, value, attention_mask, **kwargs)
        offset = kv_len - q_len
        out = weights = None
        for index, (length, lo, hi, chosen) in enumerate(groups):
            end = offset + hi  # keys past the group's last query are masked anyway
            if attention_mask is not None:
                mask = attention_mask[:, :, lo:hi, :end]
            elif hi - lo > 1:
                mask = causal_mask(offset + lo, hi - lo, end, query.dtype, query.device)
            else:
                mask = None  # one row sees every key up to its own: nothing to hide
            part, part_weights = self._attend(
                module,
                query[:, :, lo:hi],
                key[:, :, :end],
                value[:, :, :end],
                mask,
                attend,
                frame,
                length,
                (lo, hi),
                (first_key, first_key + end),
                kwargs,
                held=index < self.HELD_GROUPS,
            )
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
        frame = self.rotary.frame
        if self._forward[0] is not frame:
            self._forward = (frame, {})
        memo = self._forward[1]
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def scale_queries(self, query: torch.Tensor) -> torch.Tensor:
        """query [B, H, Sq, D] with the `logn` parameter on (docs/logn.md): each row at a position p
        past the trained window L times log(p + 1) / log(L), Qwen's log-n scale, so that attention
        over more keys than L stays about as sharp as over L; the rest times exactly 1, so the rows
        inside the window keep their bits. The scale commutes with the rotation: applied first, it
        reaches every way the query is attended afterwards (in parts, at distances)."""
        if not self.rotary.params.get("logn"):
            return query
        scale = self.per_forward(("logn", query.dtype), lambda: self._logn_scale(query.dtype))
        return query if scale is None else query * scale

    def _logn_scale(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[B, 1, Sq, 1]: the log-n scale of each query row; None when every row is inside the window."""
        q_pos, window = self.rotary.frame.q_pos, self.rotary.geometry.original_window
        past = q_pos + 1 > window
        if not bool(past.any()):
            return None
        scale = torch.where(past, (q_pos + 1).float().log() / math.log(window), 1.0)  # fp32, as the angles
        return scale[:, None, :, None].to(dtype)

    def rotate_to(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, key=None) -> torch.Tensor:
        """x [B, H, S, D] rotated to `positions` [B or 1, S] with the given frequencies. With a
        `key` (which names the positions and frequencies: the same key, the same ones, in every
        layer of the forward), the (cos, sin) are computed once per forward."""
        if key is None:
            cos, sin = cos_sin(inv_freq, scale, positions, x.dtype)
        else:
            cos, sin = self.per_forward(("cos_sin", key, x.dtype), lambda: cos_sin(inv_freq, scale, positions, x.dtype))
        return apply_rotary(x, cos, sin, self.rotary.geometry.layout)

    def received(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the queries, scaled where `logn` is on; the positions [B, kv_len] of the keys) for a
        transform that rotates them itself."""
        return self.scale_queries(query), self.key_positions(key.shape[-2])

    def key_positions(self, kv_len: int) -> torch.Tensor:
        """[B, kv_len]: the positions of the keys attention received, the newest kv_len the patch wrote."""
        k_pos = self.rotary.frame.k_pos
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
        frame = self.rotary.frame
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
        self, module, key: torch.Tensor, name, k_pos: torch.Tensor, to_positions: Callable, inv_freq, scale
    ) -> torch.Tensor:
        """`key` (the keys attention received) rotated to to_positions(k_pos) [B or 1, kv_len] with the
        given frequencies: the position map `name`, kept between forwards (kept_keys). The map and
        the frequencies must be the patch's for the cache's life, and each key's position follow
        from its own position alone; the (cos, sin) of the keys a forward rotates are computed once
        per forward."""

        def rotation(start: int, stop: int):
            return self.per_forward(
                ("keys at", name, start, stop, key.dtype),
                lambda: cos_sin(inv_freq, scale, to_positions(k_pos[:, start:stop]), key.dtype),
            )

        return self.kept_keys(module, key, name, rotation)

    def kept_keys(self, module, key: torch.Tensor, name, rotation: Callable, keep: bool = True) -> torch.Tensor:
        """`key` (the keys attention received) rotated by `rotation(start, stop)`, the (cos, sin) of
        keys start:stop under the position map `name` (RotatedKeys). Where `key` is a DynamicLayer's
        whole cache in a forward without autograd, the keys before this forward come from the store
        (self.rotated) where it holds them under `name`, the new ones are rotated here, and the
        store then holds them all if `keep` (the next forward needs them); otherwise every key is
        rotated here."""
        layout, kv_len = self.rotary.geometry.layout, key.shape[-2]
        index = self._stored_layer(module, key)
        if index is None:
            return apply_rotary(key, *rotation(0, kv_len), layout)
        entries = self.rotated.entries(self.rotary.pending_cache)
        held = kv_len - self.rotary.frame.q_pos.shape[-1]
        shape = (*key.shape[:2], key.shape[-1])
        entry = entries.get((index, name))
        if entry is not None and entry[:2] == (held, shape) and entry[2].dtype == key.dtype and entry[2].device == key.device:
            buffer = entry[2]
            if buffer.shape[-2] < kv_len:
                buffer = self._grown(buffer, key, held)
            buffer[:, :, held:kv_len] = apply_rotary(key[:, :, held:], *rotation(held, kv_len), layout)
        else:
            # no room yet: a map the next step does not use (a dynamic scaling that moves at every
            # step past the window) would make room a copy for nothing
            buffer = apply_rotary(key, *rotation(0, kv_len), layout)
        if keep:
            entries[index, name] = (kv_len, shape, buffer, weakref.ref(key))
        else:
            entries.pop((index, name), None)
        return buffer[:, :, :kv_len]

    def _stored_layer(self, module, key: torch.Tensor) -> int | None:
        """The index of the DynamicLayer whose whole cache `key` is, in a forward without autograd;
        None where the store does not apply."""
        # the remote-code ChatGLM rotary module tracks no pending cache: its keys are rotated in full
        cache, index = getattr(self.rotary, "pending_cache", None), getattr(module, "layer_idx", None)
        cache_layers = getattr(cache, "layers", None)
        if torch.is_grad_enabled() or index is None or cache_layers is None or index >= len(cache_layers):
            return None
        if type(cache_layers[index]) is not DynamicLayer or cache_layers[index].keys is not key:
            return None
        if self.rotary.frame.k_pos.shape[-1] != key.shape[-2]:  # the positions of all the layer's keys, first at 0
            return None
        return index

    def _scaling_holds(self, frame) -> bool:
        """Whether the next token's scaling is this forward's (inside the window, or within a
        granularity step past it): only then are this forward's rotated keys of use to the next."""
        rotation = getattr(self.rotary, "rotation", None)
        if rotation is None:
            return True
        return bool((rotation.scaled_lengths(frame.q_pos[:, -1:] + 1) == frame.lengths[:, -1:]).all())

    @staticmethod
    def _grown(buffer: torch.Tensor, key: torch.Tensor, held: int) -> torch.Tensor:
        """Room for `key`'s keys and a quarter more (the next steps then write their keys in place,
        not a copy of the whole cache), holding `buffer`'s first `held`."""
        kv_len = key.shape[-2]
        grown = key.new_empty((*key.shape[:2], kv_len + kv_len // 4 + 64, key.shape[-1]))
        grown[:, :, :held] = buffer[:, :, :held]
        return grown

    def _attend(self, module, query, key, value, mask, attend, frame, length, q_span, k_span, kwargs, held=True):
        """Attention of `query` with `length`'s scaling; (cos, sin) kept for the forward when `held`,
        else computed here and let go."""
        layout = self.rotary.geometry.layout
        q_cos, q_sin = frame.rotation(length, False, *q_span, query.dtype)
        if held:
            k_cos, k_sin = frame.rotation(length, True, *k_span, key.dtype)
        else:
            inv_freq, scale = frame.angles(length)
            k_cos, k_sin = cos_sin(inv_freq, scale, frame.k_pos[:, slice(*k_span)], key.dtype)
        return attend(
            module, apply_rotary(query, q_cos, q_sin, layout), apply_rotary(key, k_cos, k_sin, layout), value, mask, **kwargs
        )
