"""The rotary module rope-ext installs in place of a model's own, and the rotation it applies.

Static methods (linear, ntk, yarn, ...) are a new set of frequencies: the module returns (cos, sin)
exactly as transformers' rotary modules do and the model's attention applies them unchanged.

Dynamic methods (dynamic, dynamic_yarn) pick their frequencies from the current length. With a KV
cache that breaks incremental decoding in transformers (issue #25104): keys cached at step t were
rotated with step t's base, the query at step t+1 uses another. Here the module instead hands the
attention layers an identity rotation, so the cache holds keys *before* rotation, and the
rope-ext attention function (attention.py) rotates queries and all keys with the frequencies of
the current length at every step. A full forward and token-by-token decoding then see the same
angles for every key, in any dtype.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch
from torch import nn

from .geometry import RotaryGeometry
from .scaling import Method


def cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype):
    """(cos, sin) of shape [..., S, D] laid out cat(freqs, freqs), as transformers' rotary modules
    return them; angles and the attention factor in fp32, then cast to the activations' dtype."""
    with torch.autocast(device_type=positions.device.type, enabled=False):
        freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * scale
        sin = emb.sin() * scale
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x * cos + turn(x) * sin, where turn takes each rotated pair (a, b) to (-b, a).

    The turn is applied by slices instead of being built (transformers' rotate_half concatenates
    a negated copy): the same roundings, so the same bits, at a fraction of the memory traffic."""
    if layout == "half":
        half = x.shape[-1] // 2
        first, second = (slice(None, half), slice(half, None))
    else:
        first, second = (slice(0, None, 2), slice(1, None, 2))
    out = x * cos
    out[..., first] -= x[..., second] * sin[..., first]
    out[..., second] += x[..., first] * sin[..., second]
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate the first D channels of x [B, H, S, head_dim] by (cos, sin) [B, S, D] from `cos_sin`;
    channels past D pass through (partial rotary)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if layout == "interleaved":
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return _rotate(x, cos, sin, layout)
    return torch.cat((_rotate(x[..., :dim], cos, sin, layout), x[..., dim:]), dim=-1)


@dataclass
class RotationFrame:
    """Positions seen by one forward pass of a dynamic method, shared by all layers.

    lengths[b, i] is the length whose scaling query i of row b uses; `angles(length)` gives that
    scaling's (inv_freq, attention_factor), computed once per forward."""

    q_pos: torch.Tensor  # [B, Sq]
    k_pos: torch.Tensor  # [B, Sk], cached keys first
    lengths: torch.Tensor  # [B, Sq]
    angles: Callable[[int], tuple[torch.Tensor, float]]
    _rotations: dict = field(default_factory=dict, repr=False)

    def rotation(self, length: int, keys: bool, start: int, stop: int, dtype: torch.dtype):
        """(cos, sin) for queries (or keys) start:stop under `length`'s scaling. Every layer
        needs the same ones, so they are computed once per forward: in decoding, where the query
        is one token and the keys are the whole cache, that is most of the rotation's cost."""
        key = (length, keys, start, stop, dtype)
        if key not in self._rotations:
            inv_freq, scale = self.angles(length)
            positions = (self.k_pos if keys else self.q_pos)[:, start:stop]
            self._rotations[key] = cos_sin(inv_freq, scale, positions, dtype)
        return self._rotations[key]


class ExtendedRotaryEmbedding(nn.Module):
    """Drop-in for a transformers rotary module: `forward(x, position_ids) -> (cos, sin)`.

    Holds everything needed to undo the patch (`original_cls`, `original` config values) so that
    the model object alone is the record of what was done to it."""

    def __init__(
        self,
        method: Method,
        factor: float,
        params: dict,
        geometry: RotaryGeometry,
        original_cls: type,
        original: dict,
        device: torch.device,
    ):
        super().__init__()
        self.method, self.factor, self.params, self.geometry = method, factor, dict(params), geometry
        self.original_cls, self.original = original_cls, original
        self.rope_type = f"rope_ext_{method.name}"
        self.original_max_seq_len = geometry.original_window
        inv_freq, self.attention_scaling = method(geometry, None, factor, self.params)
        self.inv_freq = nn.Buffer(inv_freq.to(device), persistent=False)
        # Per KV cache: the positions of the keys it holds, so later steps can rotate them.
        self._key_positions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pending_cache = None
        self.frame: RotationFrame | None = None

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` casts buffers too; angles must stay fp32, so recompute the
        # frequencies exactly on whatever device the move chose.
        super()._apply(fn, recurse)
        inv_freq, _ = self.method(self.geometry, None, self.factor, self.params)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    @property
    def dynamic(self) -> bool:
        return self.method.dynamic

    def frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        if not self.dynamic:
            return self.inv_freq, self.attention_scaling
        inv_freq, scale = self.method(self.geometry, seq_len, self.factor, self.params)
        return inv_freq.to(self.inv_freq.device), scale

    def scaled_lengths(self, q_pos: torch.Tensor) -> torch.Tensor:
        """The length whose scaling each query uses (see SCHEDULE_PARAMS in methods.py).
        Every length inside the window maps to the window itself: one group, original angles."""
        window = self.geometry.original_window
        if not self.params["causal"]:
            return torch.full_like(q_pos, max(window, int(q_pos.max()) + 1))
        seen = q_pos + 1
        g = self.params["granularity"]
        past = torch.div(seen - window + g - 1, g, rounding_mode="floor") * g
        return torch.where(seen <= window, window, window + past)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if not self.dynamic:
            return cos_sin(self.inv_freq, self.attention_scaling, position_ids, x.dtype)
        q_pos = position_ids.expand(x.shape[0], -1)
        k_pos = q_pos
        cache = self._pending_cache
        if cache is not None and cache.get_seq_length() > 0:
            past = self._key_positions.get(cache)
            if past is None or past.shape[-1] != cache.get_seq_length():
                raise RuntimeError(
                    "rope_ext: this KV cache holds keys that the patched model did not write "
                    "(filled before patching, cropped or reordered); start from a fresh cache"
                )
            k_pos = torch.cat((past.expand(x.shape[0], -1).to(q_pos.device), q_pos), dim=-1)
        self.frame = RotationFrame(q_pos, k_pos, self.scaled_lengths(q_pos), lru_cache(maxsize=None)(self.frequencies))
        # The attention layers get an identity rotation, so the cache stores un-rotated keys;
        # the rope-ext attention function rotates queries and keys with `self.frame`.
        shape = (*q_pos.shape, self.geometry.rotary_dim)
        return x.new_ones(shape), x.new_zeros(shape)

    def before_forward(self, cache) -> None:
        """Called by a pre-forward hook on the decoder: the cache this forward will extend."""
        self._pending_cache = cache

    def after_forward(self, cache) -> None:
        """Called by a forward hook on the decoder: remember where the cached keys sit."""
        if cache is not None and self.frame is not None:
            self._key_positions[cache] = self.frame.k_pos
        # The frame stays: gradient checkpointing re-runs attention during backward.
        self._pending_cache = None

    def extra_repr(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"method={self.method.name}, factor={self.factor}, {params}, geometry={self.geometry}"
