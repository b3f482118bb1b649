"""The rotary module rope-ext installs in place of a model's own (the rotation math: rotation.py).

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
from functools import lru_cache

import torch
from torch import nn

from .geometry import RotaryGeometry
from .method.base import Method
from .rotation import RotationFrame, cos_sin


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
        """The length whose scaling each query uses (SCHEDULE_PARAMS, rope_ext.method.base).
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
        if cache is not None and (held := cache.get_seq_length()) > 0:
            past = self._key_positions.get(cache)
            # A cache may get shorter (assisted decoding crops rejected candidates): the keys that
            # remain are the oldest ones, at the positions they were written with.
            if past is None or past.shape[-1] < held:
                raise RuntimeError(
                    "rope_ext: this KV cache holds keys that the patched model did not write "
                    "(filled before patching, or reordered); start from a fresh cache"
                )
            k_pos = torch.cat((past[..., :held].expand(x.shape[0], -1).to(q_pos.device), q_pos), dim=-1)
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

    def copy_positions(self, source, target, length: int) -> None:
        """`target` holds the first `length` keys of `source` (rope_ext.chunked.copy_prefix): it
        gets their positions, so later forwards can rotate them."""
        if source in self._key_positions:
            self._key_positions[target] = self._key_positions[source][..., :length]

    def extra_repr(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"method={self.method.name}, factor={self.factor}, {params}, geometry={self.geometry}"
