"""The rotator: what a transform that rotates queries and keys inside attention is handed, for a
patch whose KV cache holds keys before rotation (rope_ext.rotary). It holds the forward's frame
(positions and frequencies), the model's rotary geometry, the method as bound and the keys kept
rotated between forwards, and offers the rotations over them: a transform rotates, keeps and
attends in one pass, as flash-attention's `flash_attn_with_kvcache` rotates, appends and attends
in one call."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import torch
from transformers.cache_utils import DynamicLayer

from rope_ext.rotation import cos_sin, prepared, rotate_prepared

from .interface import AttentionTransform, passed_cache
from .keys import ForwardEntries, RotatedKeys
from .parts import hides_keys


@dataclass
class KeyMaps:
    """The position maps a transform keeps keys rotated to (RotatedKeys), named `names`: map m takes
    the keys' positions `k_pos` [B or 1, kv_len] (with `grouped`, [B or 1, kv_len, G], as
    `Rotator.factors` takes them) to maps[m](k_pos), rotated at `angles` (inv_freq, attention
    factor); `new`, where a transform's `shared` computed it (Rotator.key_maps): (held, the prepared
    (cos, sin) of the keys from `held` on, the forward's new keys). The maps and the frequencies
    must be the patch's for the cache's life, and each key's positions follow from its own position
    alone."""

    names: tuple
    k_pos: torch.Tensor
    maps: tuple
    angles: tuple
    grouped: bool = False
    new: tuple | None = None


class Rotator:
    """The rotation a patch's attention transforms are handed: the frame of the running forward
    (`frame`: positions, the scaling of each query, frequencies; rope_ext.rotation.RotationFrame),
    the model's rotary geometry (`geometry`, and its `pairing` and `layout`), the method as bound
    (`method`, `params`), and the keys kept rotated between forwards (`keys`, RotatedKeys, made by
    the first forward that tracks a cache: a patch makes none). Its hooks on the decoder track the
    KV cache each forward extends (`attach`); what every layer of a forward computes alike (cos/sin
    of the same positions, the checks of the positions, a transform's schedule) it computes once
    per forward (`per_forward`).

    It reads the rotary module that makes the frames (rope_ext.rotary) once, as values: a layer
    calls nothing there. A copy of the model (deepcopy, pickle) reads the copied module again,
    since the method holds functions that pickle does not take; the kept keys start empty."""

    def __init__(self, rotary):
        self._rotary = rotary
        self._read(rotary)
        self._forward = ForwardEntries()
        self._hooks: list = []

    def _read(self, rotary) -> None:
        self.rotation, self.geometry = rotary.rotation, rotary.geometry
        self.method, self.params = rotary.method, rotary.params
        self.pairing, self.layout = rotary.geometry.pairing, rotary.geometry.layout

    @cached_property
    def keys(self) -> RotatedKeys:
        return RotatedKeys()

    def __getstate__(self):
        return {"_rotary": self._rotary, "_hooks": self._hooks}  # the copy's kept keys start empty

    def __setstate__(self, state):
        self.__dict__.update(state, _forward=ForwardEntries())
        self._read(self._rotary)

    def attach(self, site) -> None:
        """Track the KV cache around each forward of the decoder. The hooks are bound methods, not
        closures: `copy.deepcopy` of the model then gives hooks that call the copy's rotator."""
        self._hooks = [
            site.decoder.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            site.decoder.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def detach(self, site) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _before_forward(self, module, args, kwargs) -> None:
        cache = passed_cache(kwargs)
        self.rotation.state.cache = cache
        self._forward.kept = None if cache is None else self.keys.check(cache)

    def _after_forward(self, module, args, kwargs, output) -> None:
        """Record where the returned cache's keys sit; let go of the cache and of the forward's
        cos/sin, which would otherwise stay held until the next forward."""
        state = self.rotation.state
        self.rotation.finish(getattr(output, "cache", None))
        state.cache = None
        state.memo = (None, {})
        self._forward.kept = None

    @property
    def frame(self):
        """The frame of the calling thread's forward (rope_ext.rotary.ForwardState); where this
        thread ran none (autograd's thread re-running attention for gradient checkpointing on a
        GPU), the latest forward's: DynamicRotation.current, read here as values."""
        rotation = self.rotation
        frame = rotation.state.frame
        return rotation.frame if frame is None else frame

    @property
    def pending_cache(self):
        """The KV cache the calling thread's forward extends (None: none, or a forward of
        remote-code ChatGLM, whose rotary module tracks none)."""
        return self.rotation.state.cache

    def per_forward(self, key, compute: Callable):
        """compute(), once per forward (per frame) and `key`: the layers of a forward share the
        positions, so what follows from them alone is the same in every layer."""
        frame, state = self.frame, self.rotation.state
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
        if not self.params.get("logn"):
            return query
        scale = self.per_forward(("logn", query.dtype), lambda: self._logn_scale(query.dtype))
        return query if scale is None else query * scale

    def _logn_scale(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[B, 1, Sq, 1]: the log-n scale of each query row; None when every row is inside the window."""
        q_pos, window = self.frame.q_pos, self.geometry.original_window
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
        if not self.params.get("attn_scale"):
            return rotated
        scales = self.per_forward(("attn scales",), self._attn_scales)[..., lo:hi, :]
        return (rotated * (scales.unsqueeze(2) if rotated.dim() == 5 else scales)).to(rotated.dtype)

    def _attn_scales(self) -> torch.Tensor:
        """[B, 1, Sq, 1] fp32: 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) for each query
        position p, in the operations of transformers' Llama4TextAttention (a step every floor_scale
        tokens; the first step at p + 1 = floor_scale)."""
        params = self.params
        floor = params["floor_scale"] or self.geometry.original_window
        positions = self.frame.q_pos
        return (torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * params["attn_scale"] + 1.0)[:, None, :, None]

    def factors(self, positions, inv_freq, scale, dtype, grouped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B or 1, 1, P, S, D] of each of the P position tensors `positions` ([B or 1, S]
        each; with `grouped`, [B or 1, S, G]: a position for each group of frequencies,
        rope_ext.rotation.cos_sin; grouped ones of one group and of G alike), prepared (rope_ext.rotation), in one
        computation of them all: each of its operations is elementwise, so that each position
        tensor's bits are those it has alone (tests/attention/test_decode_cache.py), in a few
        operations where one computation per tensor takes a dozen each."""
        at = positions[0].unsqueeze(1) if len(positions) == 1 else torch.stack(torch.broadcast_tensors(*positions), 1)
        return prepared(*cos_sin(inv_freq, scale, at, dtype, grouped), self.layout)

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

    def key_maps(
        self, names: tuple, k_pos: torch.Tensor, maps: tuple, angles: tuple, dtype, held: int, grouped: bool = False
    ) -> KeyMaps:
        """KeyMaps with the prepared (cos, sin) of the keys from `held` on (the forward's new keys)
        computed now: in a transform's `shared`, once for every layer of the forward."""
        new = self.factors([at(k_pos[:, held:]) for at in maps], *angles, dtype, grouped)
        return KeyMaps(names, k_pos, maps, angles, grouped, (held, new))

    def key_factors(self, maps: KeyMaps, start: int, stop: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The prepared (cos, sin) [B or 1, 1, M, stop - start, D] of keys start:stop under `maps`:
        the forward's new keys from `maps.new`, any other span (a cache the store does not serve)
        once per forward."""
        if maps.new is not None and start == maps.new[0] and stop == maps.k_pos.shape[-1]:
            return maps.new[1]
        return self.per_forward(
            (("keys", maps.names, start, stop), dtype),
            lambda: self.factors([at(maps.k_pos[:, start:stop]) for at in maps.maps], *maps.angles, dtype, maps.grouped),
        )

    def keys_at(self, module, key: torch.Tensor, maps: KeyMaps) -> torch.Tensor:
        """`key` (the keys attention received) rotated to each position map of `maps`: [B, H, M,
        kv_len, D], kept between forwards (kept_keys)."""
        # a partial, not a closure: kept_keys calls key_factors itself, one call fewer in every layer
        return self.kept_keys(module, key, maps.names, partial(self.key_factors, maps, dtype=key.dtype))

    def holds(self, names) -> bool:
        """Whether the kept keys of the forward's cache hold a map named `names` (in some layer): the
        layers then rotate only the forward's new keys under it."""
        kept = self._forward.kept
        return kept is not None and any(name == names for _, name in kept)

    def kept_keys(self, module, key: torch.Tensor, names, rotation: Callable, keep: bool = True) -> torch.Tensor:
        """`key` (the keys attention received, [B, H, kv_len, D]) rotated by `rotation(start, stop)`,
        the prepared (cos, sin) [B or 1, 1, M, stop - start, D] of keys start:stop under the position
        maps `names` (RotatedKeys): [B, H, M, kv_len, D]. Where `key` is a DynamicLayer's whole
        cache in a forward without autograd, the keys before this forward come from the store
        (self.keys) where it holds them under `names`, the new ones are rotated here, and the
        store then holds them all if `keep` (the next forward needs them); otherwise every key is
        rotated here."""
        pairing, kv_len, frame = self.pairing, key.shape[-2], self.frame
        index = self._stored_layer(module, key, frame)
        if index is None:
            return rotate_prepared(key.unsqueeze(2), *rotation(0, kv_len), *pairing)
        entries = self._forward.kept
        if entries is None:  # a transform whose hooks are not on the model (swapped in by hand) finds them here
            entries = self.keys.entries(self.rotation.state.cache)
        held = kv_len - frame.q_pos.shape[-1]
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

    def _stored_layer(self, module, key: torch.Tensor, frame) -> int | None:
        """The index of the DynamicLayer whose whole cache `key` is, in a forward (of `frame`)
        without autograd; None where the store does not apply."""
        # the remote-code ChatGLM rotary module tracks no pending cache: its keys are rotated in full
        cache, index = self.rotation.state.cache, getattr(module, "layer_idx", None)
        cache_layers = getattr(cache, "layers", None)
        if torch.is_grad_enabled() or index is None or cache_layers is None or index >= len(cache_layers):
            return None
        if type(cache_layers[index]) is not DynamicLayer or cache_layers[index].keys is not key:
            return None
        if frame.k_pos.shape[-1] != key.shape[-2]:  # the positions of all the layer's keys, first at 0
            return None
        return index

    def frame_factors(self, length: int, keys: bool, start: int, stop: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The frame's (cos, sin) for queries (or keys) start:stop under `length`'s scaling, prepared
        (rope_ext.rotation) with one map: [B, 1, 1, stop - start, D], once per forward."""
        return self.per_forward(
            ("frame", length, keys, start, stop, dtype),
            lambda: prepared(
                *(t.unsqueeze(1) for t in self.frame.rotation(length, keys, start, stop, dtype)),
                self.layout,
            ),
        )

    @staticmethod
    def _grown(buffer: torch.Tensor, kv_len: int, held: int) -> torch.Tensor:
        """Room for kv_len keys and a quarter more (the next steps then write their keys in place,
        not a copy of the whole cache), holding `buffer`'s first `held`."""
        grown = buffer.new_empty((*buffer.shape[:-2], kv_len + kv_len // 4 + 64, buffer.shape[-1]))
        grown[..., :held, :] = buffer[..., :held, :]
        return grown


class RotatingTransform(AttentionTransform):
    """An attention transform that rotates queries and keys itself, with the rotator it is handed,
    in place of the model's rotation (`rotates`): attach/detach put the rotator's hooks on the model
    and take them off. One rotator per transform: every layer of a forward shares its per-forward
    values."""

    rotates = True

    def __init__(self, rotator: Rotator):
        self.rotator = rotator

    def attach(self, site) -> None:
        self.rotator.attach(site)

    def detach(self, site) -> None:
        self.rotator.detach(site)

    def step(self, name: str, query: torch.Tensor, key: torch.Tensor, attention_mask):
        """What every layer of a forward shares (the transform's `shared`), computed by the first
        layer and read by the others."""
        kv_len, q_len = key.shape[-2], query.shape[-2]
        return self.rotator.per_forward(
            (name, q_len, kv_len, query.dtype, key.dtype, id(attention_mask)),  # the mask lives through the forward
            lambda: self.shared(q_len, kv_len, query.dtype, key.dtype, attention_mask),
        )
