"""The rotary module rope-ext installs in place of a model's own (the rotation math: rotation.py),
and the one dynamic-rotation engine every family's module uses.

Static methods (linear, ntk, yarn, ...) are a new set of frequencies: the module returns (cos, sin)
exactly as transformers' rotary modules do and the model's attention applies them unchanged.

Methods that rotate inside attention (`Method.rotation == "attention"`: dynamic, dynamic_yarn and
the attention-side methods) need each key's position at every step. Dynamic methods pick their
frequencies from the current length; with a KV cache that breaks incremental decoding in
transformers (issue #25104): keys cached at step t were rotated with step t's base, the query at
step t+1 uses another. Here the module instead hands the attention layers an identity rotation, so
the cache holds keys *before* rotation, and the rope-ext attention (rope_ext.attention.Rotator)
rotates queries and all keys with the frequencies of the current length at every step. A full
forward and token-by-token decoding then see the same angles for every key, in any dtype.
`DynamicRotation` is that engine: which positions the keys of each KV cache have (through crops,
copies and assisted decoding) and the causal schedule, as one `RotationFrame` per forward.

A patched model pickles (torch.save): the module keeps its method by name and position ratio
(`method_reference`; a Method holds lambdas and closures) and drops what each forward leaves.
"""

from __future__ import annotations

import copy
import math
import threading
import weakref
from dataclasses import replace
from functools import lru_cache

import torch
from torch import nn

from . import method as methods
from .geometry import RotaryGeometry
from .method.base import SCHEDULE_PARAMS, Method
from .rotation import RotationFrame, cos_sin
from .shipped import ShippedScaling, shipped_of, with_shipped_base


def position_geometry(geometry: RotaryGeometry, ratio: float) -> RotaryGeometry:
    """The geometry in a checkpoint's position units, positions divided by `ratio`: a window of
    L / ratio positions."""
    if ratio == 1:
        return geometry
    window = geometry.original_window / ratio
    return replace(geometry, original_window=int(window) if window.is_integer() else window)


class PositionRatio:
    """The frequency function of a method in a checkpoint's position units (with_position_ratio)."""

    def __init__(self, frequencies, ratio: float):
        self.frequencies, self.ratio = frequencies, ratio

    def __call__(self, geom: RotaryGeometry, seq_len: int | None = None, *, factor, **params):
        length = None if seq_len is None else math.ceil(seq_len / self.ratio)
        inv_freq, scale = self.frequencies(position_geometry(geom, self.ratio), length, factor=factor, **params)
        return inv_freq / self.ratio, scale


def with_position_ratio(method: Method, ratio: float) -> Method:
    """`method` on a checkpoint trained with its positions divided by `ratio` (a linear scaling it
    keeps under the patch): the method's frequencies in the checkpoint's position units, divided
    by the ratio. Methods see the window in those units (`position_geometry`), and dynamic methods
    the length, rounded up, so that their schedule moves in steps of `ratio` tokens."""
    if ratio == 1:
        return method
    return replace(method, fn=PositionRatio(method.fn, ratio))


def method_reference(method: Method) -> tuple[str, float, ShippedScaling | None]:
    """(name, position ratio, shipped scaling): what `referenced_method` rebuilds `method` from. A
    Method holds functions that pickle does not take (lambdas, closures), so a patched model
    pickles this."""
    return method.name, method.fn.ratio if isinstance(method.fn, PositionRatio) else 1.0, shipped_of(method)


def referenced_method(reference: tuple, params: dict) -> Method:
    """The method `method_reference` named, bound to `params` as the patch bound it."""
    name, ratio, shipped = reference
    return with_shipped_base(with_position_ratio(methods.get(name, params), ratio), shipped)


# The transformers Cache operations that move a cache's rows (beam search, dropping finished rows,
# repeating prompts): each row's key positions [B, S] move with it. Positions of one row stand for
# every row and stay as they are.
ROW_OPERATIONS = {
    "reorder_cache": lambda positions, rows: positions[rows.to(positions.device)],
    "batch_select_indices": lambda positions, rows: positions[torch.as_tensor(rows, device=positions.device)],
    "batch_repeat_interleave": lambda positions, repeats: positions.repeat_interleave(repeats, dim=0),
}


class FollowedOperation:
    """A Cache method (ROW_OPERATIONS, or `reset`) that also moves, or forgets, the key positions
    KeyPositions keeps for that cache; set on the cache object when its positions are first kept.

    It holds the cache weakly: it sits in the cache's own attributes, and a strong reference back
    would make every cache a reference cycle, its keys freed only when the cyclic collector runs,
    which counts objects, not bytes (in a run of 64k-token prompts, a cache's worth of keys per
    prompt, until memory runs out). A deepcopy of the cache gets one bound to the copy; a pickled
    one (torch.save) one bound to the copy and to no store: the positions stay with the patch that
    wrote the original, which refuses the copy (DynamicRotation.start)."""

    def __init__(self, cache, name: str, store: KeyPositions | None):
        self.cache, self.name = weakref.ref(cache), name
        self.store = None if store is None else weakref.ref(store)

    def __reduce__(self):
        # pickle memoizes the cache before its attributes, so the copy is bound to the copied cache
        return (FollowedOperation, (self.cache(), self.name, None))

    def __call__(self, *args, **kwargs):
        cache = self.cache()
        result = getattr(type(cache), self.name)(cache, *args, **kwargs)
        store = None if self.store is None else self.store()
        if store is not None:
            store.follow(cache, self.name, *args, *kwargs.values())
        return result

    def __deepcopy__(self, memo):
        # copy.deepcopy of the cache registers the copy in memo before it copies its attributes
        cache = self.cache()
        twin = copy.copy(self)
        twin.cache = weakref.ref(memo.get(id(cache), cache))
        return twin


class KeyPositions:
    """The positions of the keys each KV cache holds, by the cache object's identity: a
    transformers Cache, or the tensor that stands for a tuple cache. Weak, so that a cache the
    caller drops is not kept alive; by identity, so that tensors are never compared by value. The
    positions follow the cache's own operations on its rows (FollowedOperation). Threads that run
    the model at once, each with its own cache, change the list under a lock."""

    def __init__(self):
        self._written: list[tuple[weakref.ref, torch.Tensor]] = []
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"_written": []}

    def __setstate__(self, state):
        self.__init__()

    def get(self, cache) -> torch.Tensor | None:
        return next((positions for ref, positions in self._written if ref() is cache), None)

    def set(self, cache, positions: torch.Tensor) -> None:
        with self._lock:
            self._dropped(cache)
            self._written.append((weakref.ref(cache), positions))
        for name in (*ROW_OPERATIONS, "reset"):
            if hasattr(type(cache), name) and not isinstance(vars(cache).get(name), FollowedOperation):
                setattr(cache, name, FollowedOperation(cache, name, self))

    def drop(self, cache) -> None:
        with self._lock:
            self._dropped(cache)

    def _dropped(self, cache) -> None:
        self._written = [(ref, p) for ref, p in self._written if ref() is not None and ref() is not cache]

    def follow(self, cache, operation: str, argument=None) -> None:
        """`cache` ran `operation` (with its one argument): its keys' positions move likewise."""
        positions = self.get(cache)
        if positions is None:
            return
        if operation == "reset":
            self.drop(cache)
        elif positions.shape[0] > 1:
            self.set(cache, ROW_OPERATIONS[operation](positions, argument))

    def caches(self) -> list:
        """The caches whose key positions are known, still alive."""
        return [cache for ref, _ in self._written if (cache := ref()) is not None]


class WrittenUnrotated:
    """What `update` of a KV cache becomes once the patch that wrote its keys before rotation is
    removed or replaced (ExtendedRotaryEmbedding.retire_caches): any other state would read those
    keys as rotated. An object, not a closure, so that a copy of the cache stays refused."""

    def __init__(self, method: str):
        self.method = method

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"rope_ext: this KV cache holds keys the {self.method} patch wrote before rotation, and that patch was "
            "removed or replaced since; its keys mean nothing to the model as it is now: start from a fresh cache"
        )


class ForwardState(threading.local):
    """What the running forward of a patched model leaves for its attention layers, per thread:
    its frame (DynamicRotation), the KV cache it extends (`cache`), what its layers compute once
    (`memo`, rope_ext.attention.Rotator.per_forward). Two threads that run one patched model at
    once, each with its own cache, each see their own forward's. Plain attributes: the attention
    layers read them without a call."""

    def __init__(self):
        self.frame: RotationFrame | None = None
        self.cache = None
        self.memo: tuple = (None, {})


class DynamicRotation:
    """One forward's positions and frequencies for a patch that rotates inside attention.

    `start(q_pos, cache, held)` at the start of a forward makes `frame`: the queries' positions,
    the keys' (those the cache holds, then the new ones) and the length whose scaling each query
    uses; `finish(cache)` after it records where the cache's keys sit. `frequencies(length)` are
    the method's (inv_freq, attention_factor) for that length, on `device` (the module that owns
    the engine keeps it where its buffers are).

    Each thread's forward has its own frame (`state.frame`, ForwardState); `frame` is the latest
    any thread made, for a thread that runs attention without having run the forward, as the
    autograd thread that re-runs it for gradient checkpointing on a GPU
    (rope_ext.attention.Rotator.frame reads the one or the other)."""

    def __init__(self, method: Method, factor: float, params: dict, geometry: RotaryGeometry, device: torch.device):
        self.method, self.factor, self.params, self.geometry = method, factor, params, geometry
        self.device = device
        self.positions = KeyPositions()
        self.state = ForwardState()
        self.frame: RotationFrame | None = None
        # (length, device) -> frequencies, for a method whose frequencies do not follow the length:
        # the same at every forward (a few lengths: the window, the window + 1), so computed once
        self._fixed: dict = {}

    def __getstate__(self):
        # a copy (deepcopy or pickle of the model) starts with no forward run and no cache written
        return {k: v for k, v in self.__dict__.items() if k not in ("state", "frame")}

    def __setstate__(self, state):
        self.__dict__.update(state, state=ForwardState(), frame=None)

    def current(self) -> RotationFrame | None:
        """The frame of the calling thread's forward, or where it ran none, the latest forward's."""
        return self.frame if self.state.frame is None else self.state.frame

    def frequencies(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if self.method.follows_length:
            inv_freq, scale = self.method(self.geometry, seq_len, self.factor, self.params)
            return inv_freq.to(self.device), scale
        key = (seq_len, self.device)
        if key not in self._fixed:
            inv_freq, scale = self.method(self.geometry, seq_len, self.factor, self.params)
            self._fixed[key] = (inv_freq.to(self.device), scale)
        return self._fixed[key]

    def scaled_lengths(self, q_pos: torch.Tensor) -> torch.Tensor:
        """The length whose scaling each query uses (SCHEDULE_PARAMS, rope_ext.method.base).
        Every length inside the window maps to the window itself: one group, original angles."""
        window = self.geometry.original_window
        schedule = {**SCHEDULE_PARAMS, **{k: self.params[k] for k in self.method.schedule}}
        if not schedule["causal"]:
            return torch.full_like(q_pos, max(window, int(q_pos.max()) + 1))
        seen = q_pos + 1
        if self.method.window_step:
            return torch.where(seen <= window, window, window + 1)
        g = schedule["granularity"] if "granularity" in self.method.schedule else 1  # switches follow each token
        past = torch.div(seen - window + g - 1, g, rounding_mode="floor") * g
        return torch.where(seen <= window, window, window + past)

    def start(self, q_pos: torch.Tensor, cache=None, held: int | None = None) -> RotationFrame:
        """The frame of a forward whose queries sit at `q_pos` [B, Sq], after the keys `cache` holds
        (the first `held` of those it was written with: a cache may get shorter, as assisted
        decoding crops rejected candidates; None: all of them)."""
        k_pos = q_pos
        if cache is not None:
            past = self.positions.get(cache)
            if past is None or (held is not None and past.shape[-1] < held):
                raise RuntimeError(
                    "rope_ext: this KV cache holds keys that the patched model did not write: the patch does not "
                    "know where they sit (a cache filled before this patch, or a copy made with copy.deepcopy or "
                    "pickled by torch.save, whose positions stay with the original; rope_ext.chunked.copy_prefix copies "
                    "a cache with them); start from a fresh cache"
                )
            past = past if held is None else past[..., :held]
            k_pos = torch.cat((past.expand(q_pos.shape[0], -1).to(q_pos.device), q_pos), dim=-1)
        frame = RotationFrame(q_pos, k_pos, self.scaled_lengths, lru_cache(maxsize=None)(self.frequencies))
        self.state.frame = self.frame = frame
        return frame

    def finish(self, cache) -> None:
        """Remember where the keys of `cache` (returned by the forward that made the frame) sit.
        The frame stays: gradient checkpointing re-runs attention during backward."""
        frame = self.state.frame
        if cache is not None and frame is not None:
            self.positions.set(cache, frame.k_pos)

    def copy_positions(self, source, target, length: int) -> None:
        """`target` holds the first `length` keys of `source`: it gets their positions."""
        positions = self.positions.get(source)
        if positions is not None:
            self.positions.set(target, positions[..., :length])


class PatchRotary(nn.Module):
    """What every rope-ext rotary module holds of its patch, whatever the model's rotary interface
    it stands in for (this module's, remote-code ChatGLM's table): the method, factor, parameters
    and geometry, the pre-patch values `original` that unpatch restores, and the method's
    frequencies (`scaled`) and temperature (`attention_scaling`)."""

    def __init__(self, method: Method, factor: float, params: dict, geometry: RotaryGeometry, original: dict):
        super().__init__()
        self.method, self.factor, self.params, self.geometry = method, factor, dict(params), geometry
        self.original = original

    def scaled(self, device) -> torch.Tensor:
        """The method's fp32 frequencies on `device` (of no length: a dynamic method's at its trained
        window), its temperature set as `attention_scaling`."""
        inv_freq, self.attention_scaling = self.method(self.geometry, None, self.factor, self.params)
        return inv_freq.to(device)

    @property
    def dynamic(self) -> bool:
        return self.method.dynamic

    @property
    def frame(self) -> RotationFrame | None:
        return self.rotation.current()


class ExtendedRotaryEmbedding(PatchRotary):
    """Drop-in for a transformers rotary module: `forward(x, position_ids) -> (cos, sin)`.

    Holds everything needed to undo the patch (`original_cls`, `original` config values) so that
    the model object alone is the record of what was done to it."""

    def __init__(self, method, factor, params, geometry, original_cls: type, original: dict, device: torch.device):
        super().__init__(method, factor, params, geometry, original)
        self.original_cls = original_cls
        self.rope_type = f"rope_ext_{method.name}"
        self.original_max_seq_len = geometry.original_window
        self.inv_freq = nn.Buffer(self.scaled(device), persistent=False)
        self.rotation = DynamicRotation(method, factor, self.params, geometry, self.inv_freq.device)

    def __getstate__(self):
        # pickled by torch.save(model): the method by its name; the rotation engine holds what
        # each forward leaves (the positions of each cache's keys, weakly; the frame), not state
        state = {k: v for k, v in self.__dict__.items() if k != "rotation"}
        return {**state, "method": method_reference(self.method)}

    def __setstate__(self, state):
        state = {k: v for k, v in state.items() if k != "pending_cache"}  # what models pickled before it moved held
        super().__setstate__({**state, "method": referenced_method(state["method"], state["params"])})
        self.rotation = DynamicRotation(self.method, self.factor, self.params, self.geometry, self.inv_freq.device)

    @property
    def pending_cache(self):
        """The cache the calling thread's running forward extends (set and dropped by the hooks of
        the rotator, rope_ext.attention.Rotator)."""
        return self.rotation.state.cache

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` casts buffers too; angles must stay fp32, so recompute the
        # frequencies exactly on whatever device the move chose.
        super()._apply(fn, recurse)
        self.inv_freq = self.scaled(self.inv_freq.device)
        self.rotation.device = self.inv_freq.device
        return self

    def frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        if not self.method.follows_length:
            return self.inv_freq, self.attention_scaling
        return self.rotation.frequencies(seq_len)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if not self.dynamic:
            return cos_sin(self.inv_freq, self.attention_scaling, position_ids, x.dtype)
        q_pos = position_ids.expand(x.shape[0], -1)
        cache = self.pending_cache
        held = 0 if cache is None else cache.get_seq_length()
        self.rotation.start(q_pos, cache if held > 0 else None, held)
        # The attention layers get an identity rotation, so the cache stores un-rotated keys;
        # the rope-ext attention function rotates queries and keys with `self.frame`.
        shape = (*q_pos.shape, self.geometry.rotary_dim)
        return x.new_ones(shape), x.new_zeros(shape)

    def retire_caches(self) -> None:
        """The patch is being removed or replaced: every KV cache it wrote keys into before rotation
        refuses any further update (WrittenUnrotated)."""
        if not self.dynamic:
            return
        for cache in self.rotation.positions.caches():
            if callable(getattr(cache, "update", None)):
                cache.update = WrittenUnrotated(self.method.name)

    def copy_positions(self, source, target, length: int) -> None:
        """`target` holds the first `length` keys of `source` (rope_ext.chunked.copy_prefix): it
        gets their positions, so later forwards can rotate them."""
        self.rotation.copy_positions(source, target, length)

    def extra_repr(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"method={self.method.name}, factor={self.factor}, {params}, geometry={self.geometry}"
