"""Attention functions that rope-ext registers with transformers' AttentionInterface.

A registered name `rope_ext_<base>` (e.g. `rope_ext_sdpa`) wraps the model's chosen backend: each
attention module carries a `rope_ext_attention` callable, an `AttentionChain` of transforms that
each change (query, key, value, mask) and hand them on; the last one hands them to the backend.
The same mask function as the backend's is registered under the new name, so causal and padding
masks are built exactly as before.

A patch's chain, in order: the rotation of dynamic methods (`RotateInAttention`), then what a
method adds (`Method.attention`: alibi_hybrid's bias, rope_ext.method.alibi_hybrid). The bias
comes last because it is defined on the queries and keys the backend finally sees.
"""

from __future__ import annotations

import copy
import math
import sys
from typing import Callable

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

from .rotation import apply_rotary, cos_sin

PREFIX = "rope_ext_"


class StaticCacheError(ValueError, RuntimeError):
    """A pre-allocated (static) KV cache reached a patch that needs each key's position: the
    cache hands attention its whole allocation, not the keys that were written."""


def refuse_static_cache(method: str) -> Callable:
    """A forward pre-hook for the decoder that raises StaticCacheError on a static cache."""

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if getattr(cache, "is_compileable", False):
            raise StaticCacheError(
                f"{method}: pre-allocated (static) KV caches are not supported, because the patch needs each "
                "key's position; use the default DynamicCache"
            )

    return hook


def causal_mask(first: int, rows: int, keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [1, 1, rows, keys] mask for query rows that are key indices first .. first+rows-1:
    0 where the key index is at most the query's, the dtype's minimum after it."""
    query_index = torch.arange(first, first + rows, device=device)
    allowed = torch.arange(keys, device=device)[None, :] <= query_index[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def backend(module: torch.nn.Module, name: str) -> Callable:
    """The attention function transformers would call for `name` on this module."""
    if name == "eager":
        # Each model file defines its own eager function; use the one of this module's model.
        return sys.modules[type(module).__module__].eager_attention_forward
    function = ALL_ATTENTION_FUNCTIONS[name]
    if is_flash_attention_requested(requested_attention_implementation=name):
        return lambda module, *args, **kwargs: function(FlashView(module, name), *args, **kwargs)
    return function


class FlashView:
    """An attention module as transformers' flash backends must see it. They pick the kernel to
    load from `module.config._attn_implementation`, which names the rope-ext wrapper while a patch
    is on (`rope_ext_flash_attention_2` is no kernel); the view shows a config naming the backend
    and passes every other attribute through."""

    def __init__(self, module: torch.nn.Module, name: str):
        self._module = module
        self.config = copy.copy(module.config)
        self.config._attn_implementation_internal = name

    def __getattr__(self, attribute: str):
        return getattr(self._module, attribute)


def registered_name(base: str) -> str:
    """Register (once) and return the rope-ext wrapper name for backend `base`."""
    if base.startswith(PREFIX):
        raise ValueError(f"attention backend {base!r} is already a rope-ext wrapper")
    if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"unknown attention implementation {base!r}")
    if base not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {base!r} has no mask function rope-ext can reuse")
    name = PREFIX + base

    def attention(module, query, key, value, attention_mask, **kwargs):
        return module.rope_ext_attention(module, query, key, value, attention_mask, backend(module, base), **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def base_name(name: str) -> str:
    return name.removeprefix(PREFIX)


class AttentionTransform:
    """One step of an AttentionChain: `__call__(module, query, key, value, attention_mask, attend,
    **kwargs)` returns what `attend` (the rest of the chain, then the backend) returns for the
    tensors it passes on. `attach`/`detach` add and remove what the step keeps on the model
    (hooks, parameters) when the patch is installed and removed. A transform with `rotates` set
    applies the rotary embedding itself and takes the place of RotateInAttention."""

    rotates = False

    def attach(self, site) -> None:
        pass

    def detach(self, site) -> None:
        pass


class AttentionChain:
    """What `module.rope_ext_attention` holds: transforms applied in order, each receiving the rest
    of the chain as its `attend`."""

    def __init__(self, transforms: list[AttentionTransform]):
        if not transforms:
            raise ValueError("an attention chain needs at least one transform")
        self.transforms = tuple(transforms)
        self._hooks: list = []

    def attach(self, site, method: str) -> None:
        """Let each transform add what it keeps on the model. Every chain needs the positions of
        the cached keys, which a static cache does not give: such a cache is refused."""
        for transform in self.transforms:
            transform.attach(site)
        self._hooks = [site.decoder.register_forward_pre_hook(refuse_static_cache(method), with_kwargs=True)]

    def detach(self, site) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for transform in self.transforms:
            transform.detach(site)

    def __call__(self, module, query, key, value, attention_mask, attend: Callable, **kwargs):
        for transform in reversed(self.transforms):
            attend = _bind(transform, attend)
        return attend(module, query, key, value, attention_mask, **kwargs)


def _bind(transform: AttentionTransform, attend: Callable) -> Callable:
    def step(module, query, key, value, attention_mask, **kwargs):
        return transform(module, query, key, value, attention_mask, attend, **kwargs)

    return step


class RotateInAttention(AttentionTransform):
    """Rotates queries and keys inside attention for a dynamic rotary module (see rotary.py), the
    queries scaled first where the patch has `logn` on (`scale_queries`).

    Queries that use different scalings (causal schedule past the window) are attended in groups,
    each against keys rotated with that group's scaling; causality is by index, as in the model."""

    def __init__(self, rotary):
        self.rotary = rotary
        self._hooks: list = []

    def attach(self, site) -> None:
        """Track the KV cache around each forward of the decoder (see ExtendedRotaryEmbedding).
        The hooks are bound methods, not closures: `copy.deepcopy` of the model then gives hooks
        that call the copy's rotary module."""
        self._hooks = [
            site.decoder.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            site.decoder.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def _before_forward(self, module, args, kwargs) -> None:
        self.rotary.before_forward(kwargs.get("cache"))

    def _after_forward(self, module, args, kwargs, output) -> None:
        self.rotary.after_forward(getattr(output, "cache", None))

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
        lengths = frame.lengths
        groups = torch.unique(lengths).tolist()
        if len(groups) == 1:
            return self._attend(module, query, key, value, attention_mask, attend, frame, groups[0], (0, q_len),
                                (first_key, written), kwargs)
        offset = kv_len - q_len
        out = None
        for length in groups:
            rows = (lengths == length).any(0).nonzero()
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            end = offset + hi  # keys past the group's last query are masked anyway
            if attention_mask is not None:
                mask = attention_mask[:, :, lo:hi, :end]
            else:
                mask = causal_mask(offset + lo, hi - lo, end, query.dtype, query.device)
            part, _ = self._attend(module, query[:, :, lo:hi], key[:, :, :end], value[:, :, :end], mask, attend, frame,
                                   length, (lo, hi), (first_key, first_key + end), kwargs)
            if out is None:
                out = part.new_empty((part.shape[0], q_len, *part.shape[2:]))
            chosen = (lengths[:, lo:hi] == length)[..., None, None]
            out[:, lo:hi] = torch.where(chosen, part, out[:, lo:hi])
        return out, None

    def scale_queries(self, query: torch.Tensor) -> torch.Tensor:
        """query [B, H, Sq, D] with the `logn` parameter on (docs/logn.md): each row at a position p
        past the trained window L times log(p + 1) / log(L), Qwen's log-n scale, so that attention
        over more keys than L stays about as sharp as over L; the rest times exactly 1, so the rows
        inside the window keep their bits. The scale commutes with the rotation: applied first, it
        reaches every way the query is attended afterwards (in parts, at distances)."""
        if not self.rotary.params.get("logn"):
            return query
        q_pos, window = self.rotary.frame.q_pos, self.rotary.geometry.original_window
        past = q_pos + 1 > window
        if not bool(past.any()):
            return query
        scale = torch.where(past, (q_pos + 1).float().log() / math.log(window), 1.0)  # fp32, as the angles
        return query * scale[:, None, :, None].to(query.dtype)

    def rotate_to(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
        """x [B, H, S, D] rotated to `positions` [B or 1, S] with the given frequencies."""
        cos, sin = cos_sin(inv_freq, scale, positions, x.dtype)
        return apply_rotary(x, cos, sin, self.rotary.geometry.layout)

    def attend_at_distances(self, module, query, key, value, attention_mask, attend, distances, inv_freq, scale, kwargs):
        """One query row in one backend call, each key at `distances` [B or 1, kv_len] from it (its
        position minus the query's, in the position maps of the method). RoPE scores depend on
        the distance only, <R(a)q, R(b)k> = <q, R(b - a)k>: the query is rotated at 0 and each key
        at its distance, so keys that the method places at different query positions still go
        through one call."""
        # rotated at 0, not left as is: the rotation carries the attention factor
        q_zero = self.rotate_to(query, torch.zeros_like(distances[:, :1]), inv_freq, scale)
        return attend(module, q_zero, self.rotate_to(key, distances, inv_freq, scale), value, attention_mask, **kwargs)

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
        window) cannot be honoured either."""
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

    def _attend(self, module, query, key, value, mask, attend, frame, length, q_span, k_span, kwargs):
        layout = self.rotary.geometry.layout
        q_cos, q_sin = frame.rotation(length, False, *q_span, query.dtype)
        k_cos, k_sin = frame.rotation(length, True, *k_span, key.dtype)
        return attend(module, apply_rotary(query, q_cos, q_sin, layout), apply_rotary(key, k_cos, k_sin, layout), value, mask, **kwargs)


def hides_keys(attention_mask: torch.Tensor | None, kv_len: int) -> bool:
    """Whether the model's mask (boolean, True = attend, or additive) hides any of the kv_len keys
    from the newest query. transformers' masks are causal, padding and sliding windows, so a mask
    that hides nothing from the newest query is the causal mask."""
    if attention_mask is None:
        return False
    newest = attention_mask[:, :, -1, :kv_len]
    return not bool((newest if newest.dtype == torch.bool else newest == 0).all())


def exact_rows(module, query, key, value, mask, attend: Callable, offset: int, rows: int, kwargs: dict):
    """Attention of query rows [0, rows) through the backend, with the positions the tensors were
    rotated at: what the unpatched model computes for them. Query row r is key index offset + r."""
    end = offset + rows
    if mask is not None:
        mask = mask[:, :, :rows, :end]
    elif offset:  # sdpa's causal shortcut covers only a square block
        mask = causal_mask(offset, rows, end, query.dtype, query.device)
    out, _ = attend(module, query[:, :, :rows], key[:, :, :end], value[:, :, :end], mask, **kwargs)
    return out


# The largest fp32 attention-score block ([B, heads, rows, keys]) one call here may build: the masks
# of masked calls (rope_ext.method.self_extend) and the scores of attend_with_lse off the CPU.
SCORE_BYTES = 128 << 20


def attend_with_lse(query, key, value, *, causal: bool = False, mask: torch.Tensor | None = None, scale: float | None = None):
    """(output [B, H, Sq, D], logsumexp [B, H, Sq] in fp32) of softmax attention; `causal` aligns
    the first query with the first key, `mask` is additive in the query's dtype. Key heads may be
    grouped. A row that sees no key has lse 0 and output 0 (the CPU kernel's convention)."""
    if query.device.type == "cpu":
        # torch's CPU flash kernel, which sdpa runs on the CPU, also returns the logsumexp
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, attn_mask=mask, scale=scale)
    return attend_with_lse_by_scores(query, key, value, causal=causal, mask=mask, scale=scale)


def attend_with_lse_by_scores(query, key, value, *, causal: bool = False, mask: torch.Tensor | None = None, scale: float | None = None):
    """attend_with_lse from explicit fp32 scores, for devices without torch's CPU kernel. Query rows
    go in blocks whose scores stay under SCORE_BYTES: the calls without a mask span all the rows
    and keys of a part, which as one block would be a [rows, keys] tensor."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).float(), value.repeat_interleave(groups, 1).float()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q_len, kv_len = query.shape[-2], key.shape[-2]
    rows = max(1, SCORE_BYTES // (query.shape[0] * query.shape[1] * kv_len * 4))
    outputs, lses = [], []
    for lo in range(0, q_len, rows):
        hi = min(lo + rows, q_len)
        scores = (query[:, :, lo:hi].float() @ key.transpose(-1, -2)) * scale
        if causal:
            scores = scores + causal_mask(lo, hi - lo, kv_len, torch.float32, query.device)
        if mask is not None:
            scores = scores + (mask if mask.shape[-2] == 1 else mask[..., lo:hi, :]).float()
        lse = torch.logsumexp(scores, dim=-1)
        seen = torch.isfinite(lse) & (lse > torch.finfo(torch.float32).min / 2)
        weights = torch.exp(scores - torch.where(seen, lse, 0)[..., None]) * seen[..., None]
        outputs.append((weights @ value).to(query.dtype))
        lses.append(torch.where(seen, lse, 0))
    return torch.cat(outputs, dim=2), torch.cat(lses, dim=-1)


def merge_by_lse(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """One softmax over the keys of several attention calls: parts are (output [B, H, Sq, D],
    lse [B, H, Sq], seen [B, 1 or H, Sq] bool or None = every row saw a key). A part a row did not
    see, or whose lse is -inf, gets weight 0. Returns [B, H, Sq, D] in the first output's dtype."""
    lses = torch.stack([lse if seen is None else lse.masked_fill(~seen, float("-inf")) for _, lse, seen in parts])
    weights = torch.softmax(lses, dim=0).nan_to_num_(0.0)[..., None]  # all parts unseen: a row with no key at all
    merged = weights[0] * parts[0][0]
    for weight, (out, _, _) in zip(weights[1:], parts[1:]):
        merged.addcmul_(weight, out)  # in place: a product and a sum per part would each be a new tensor
    return merged.to(parts[0][0].dtype)


def window_parts(query, key, value, first: int, window: int, scale: float | None = None):
    """Attention of query rows that are key indices first .. first + rows - 1, each to the `window`
    keys j with q - window < j <= q, as calls without a mask: yields (lo, hi, parts) for blocks of
    rows [lo, hi), parts as merge_by_lse takes them, so that a caller merges them with its own parts
    of the same rows. Needs first >= window - 1, so that every row has all its keys.

    No mask is built: masked calls of the CPU kernel are slower than causal or unmasked ones, and a
    mask is a [rows, keys] tensor. Rows go in blocks of `window`; a block attends its own keys
    causally, the keys all its rows see (only a block shorter than the window has them) without a
    mask, and the triangle of earlier keys, which row r of the block sees from its r-th key on, as a
    causal call on rows and keys in reverse order. A small window therefore means many small calls."""
    rows = query.shape[-2]
    for lo in range(0, rows, window):
        n = min(window, rows - lo)
        start = first + lo  # key index of the block's first row
        own = slice(lo, lo + n)
        mine = slice(start, start + n)
        parts = [(*attend_with_lse(query[:, :, own], key[:, :, mine], value[:, :, mine], causal=True, scale=scale), None)]
        if n < window:
            seen = slice(start - window + n, start)
            parts.append((*attend_with_lse(query[:, :, own], key[:, :, seen], value[:, :, seen], scale=scale), None))
        if n > 1:
            # row r < n - 1 sees key start - window + 1 + k for k >= r: reversed in both, key k' for k' <= row r'
            earlier = slice(start - window + 1, start - window + n)
            out, lse = attend_with_lse(query[:, :, lo : lo + n - 1].flip(2), key[:, :, earlier].flip(2), value[:, :, earlier].flip(2),
                                       causal=True, scale=scale)
            # the block's last row sees none of these keys
            out = torch.cat((out.flip(2), out.new_zeros((*out.shape[:2], 1, out.shape[-1]))), dim=2)
            lse = torch.cat((lse.flip(-1), lse.new_full((*lse.shape[:2], 1), float("-inf"))), dim=-1)
            parts.append((out, lse, None))
        yield lo, lo + n, parts
