"""The rotation itself: (cos, sin) from frequencies and positions, applied to queries and keys.

Angles and the attention factor are computed in fp32 at any model dtype, then cast to the
activations' dtype, as transformers' rotary modules do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch


def cos_sin(
    inv_freq: torch.Tensor, scale, positions: torch.Tensor, dtype: torch.dtype, grouped: bool = False, per_position: bool = False
):
    """(cos, sin) of shape [..., S, D] laid out cat(freqs, freqs), as transformers' rotary modules
    return them; angles and the attention factor in fp32, then cast to the activations' dtype.

    `positions` [..., S]; with `grouped`, [..., S, G]: the D/2 frequencies in G equal groups of
    consecutive ones (the first the fastest), each group at its own position (dpe's dimension
    groups). A group of one [..., S, 1] gives the bits of [..., S] ungrouped. `inv_freq` [M, D/2]
    with `scale` [M] (fp32) gives M scalings at once, [..., M, S, D], one computation for all; with
    `per_position`, `inv_freq` [S, D/2] and `scale` [S, 1] give each position its own, [..., S, D]."""
    if torch.is_autocast_enabled(positions.device.type):
        with torch.autocast(device_type=positions.device.type, enabled=False):
            return cos_sin(inv_freq, scale, positions, dtype, grouped, per_position)
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float)
    at = positions.float() if grouped else positions[..., None].float()
    if at.shape[-1] > 1:
        at = at.repeat_interleave(inv_freq.shape[-1] // at.shape[-1], dim=-1)
    if inv_freq.dim() == 2 and not per_position:
        at, inv_freq, scale = at.unsqueeze(-3), inv_freq[:, None], scale.to(positions.device)[:, None, None]
    freqs = at * inv_freq
    # each operation is elementwise, so that cos and sin of the D/2 angles, laid out twice after,
    # have the bits of cos and sin of the D laid out first (transformers' order), at half the work
    cos, sin = freqs.cos(), freqs.sin()
    if not (isinstance(scale, (int, float)) and scale == 1):  # x * 1 is x: a decode step's few angles skip two operations
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.to(dtype=dtype), sin.to(dtype=dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def polar(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor) -> torch.Tensor:
    """The rotation as complex numbers e^(i * angle) * scale, of shape [..., S, D / 2], for a model
    that multiplies its queries and keys viewed as complex pairs (Llama 4's `freqs_cis`): built
    with `torch.polar` from the fp32 angles, as such a model's rotary module builds it, since cos and
    sin computed apart are not bit-equal to it."""
    with torch.autocast(device_type=positions.device.type, enabled=False):
        freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
        return torch.polar(torch.ones_like(freqs), freqs) * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str, channels: str = "leading") -> torch.Tensor:
    """Rotate D channels of x [B, H, S, head_dim] by (cos, sin) [B, S, D] from `cos_sin`: the first
    D ("leading"), or the last D ("trailing": multi-head latent attention appends its rotated
    channels to unrotated ones); the others pass through (partial rotary). x * cos + turn(x) * sin,
    turn taking each rotated pair (a, b) to (-b, a): transformers' bits (its rotate_half builds a
    negated copy; `rotate_prepared`, the one rotation, swaps and signs sin instead, the same roundings)."""
    return rotate_prepared(x, *prepared(cos, sin, layout), layout, channels)


@dataclass
class RotationFrame:
    """Positions seen by one forward pass of a dynamic method, shared by all layers.

    lengths[b, i] is the length whose scaling query i of row b uses, `schedule(q_pos)`, computed at
    its first read (sink_window and dca never read it); `angles(length)` gives that scaling's
    (inv_freq, attention_factor), computed once per forward."""

    q_pos: torch.Tensor  # [B, Sq]
    k_pos: torch.Tensor  # [B, Sk], cached keys first
    schedule: Callable[[torch.Tensor], torch.Tensor]
    angles: Callable[[int], tuple[torch.Tensor, float]]

    @cached_property
    def lengths(self) -> torch.Tensor:
        """[B, Sq]"""
        return self.schedule(self.q_pos)

    def rotation(self, length: int, keys: bool, start: int, stop: int, dtype: torch.dtype):
        """(cos, sin) for queries (or keys) start:stop under `length`'s scaling. Every layer needs
        the same ones: the attention transform keeps them for the forward (rope_ext.attention.Rotator.per_forward,
        the one per-forward store); in decoding, where the query is one token and the keys are the
        whole cache, that is most of the rotation's cost."""
        inv_freq, scale = self.angles(length)
        positions = (self.k_pos if keys else self.q_pos)[:, start:stop]
        return cos_sin(inv_freq, scale, positions, dtype)


def prepared(cos: torch.Tensor, sin: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, ..., S, D] from `cos_sin` as `rotate_prepared` takes them: a heads axis after
    the first, the interleaved layout's channels expanded, and sin signed, so that turn(x) * sin
    is swap(x) * signed sin, swap exchanging the two channels of each rotated pair."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = cos.shape[-1] // 2
    if layout == "interleaved":
        cos = cos[..., :half].repeat_interleave(2, dim=-1)
        sign = torch.tensor([-1.0, 1.0], dtype=sin.dtype, device=sin.device).repeat(half)
        return cos, sin[..., :half].repeat_interleave(2, dim=-1) * sign
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def swap(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x [..., D] with the two channels of each rotated pair exchanged: what `prepared`'s signed sin
    multiplies in `rotate_prepared`."""
    if layout == "half":
        return torch.roll(x, x.shape[-1] // 2, dims=-1)
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def channel_split(width: int, dim: int, channels: str) -> tuple[slice, slice]:
    """(rotated, passed through): the slices of a head's `width` channels that a rotation of `dim`
    channels turns and keeps, the first `dim` ("leading") or the last ("trailing")."""
    if channels == "trailing":
        return slice(width - dim, width), slice(0, width - dim)
    return slice(0, dim), slice(dim, width)


def rotate_prepared(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str, channels: str = "leading", out=None, swapped=None
) -> torch.Tensor:
    """The rotation, with (cos, sin) from `prepared`: x * cos + swap(x) * sin, bit for bit x * cos +
    turn(x) * sin (a - b * s and a + b * (-s) round alike), in four operations where building the
    turned copy takes fifteen: the rotation of a decode step's one query and one key is mostly the
    cost of its operations. x [B, H, S, head_dim] with (cos, sin) [B, 1, S, D], or [B, H, P, S,
    head_dim] with [B, 1, P, S, D]: P position maps at once.
    `out`, where every channel is rotated: the tensor to write the result into (a view of a
    buffer), which saves the copy; the same roundings, so the same bits. `swapped`: swap(x) of the
    rotated channels where the caller has it (rotating the same keys again, at other positions)."""
    dim, width = cos.shape[-1], x.shape[-1]
    if dim != width:
        # partial rotary: the turned channels rotated, the others passed through as many times as
        # (cos, sin) hold position maps
        turned, passed = channel_split(width, dim, channels)
        rotated = rotate_prepared(x[..., turned], cos, sin, layout, swapped=swapped)
        kept = x[..., passed].expand(*rotated.shape[:-1], width - dim)
        whole = torch.cat((kept, rotated) if channels == "trailing" else (rotated, kept), dim=-1)
        return whole if out is None else out.copy_(whole)
    if swapped is None:
        swapped = swap(x, layout)
    if out is not None:
        return torch.mul(x, cos, out=out).add_(swapped * sin)
    return x * cos + swapped * sin
