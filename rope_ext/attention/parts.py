"""Attention in parts: the kernels attention-side methods build on. Each part is a backend call
that also returns its log-sum-exp, so parts over disjoint keys merge into one softmax
(`merge_by_lse`); `window_parts` attends a band of keys without a mask; `exact_rows` runs the rows
a method leaves as they are through the model's own backend."""

from __future__ import annotations

from collections.abc import Callable

import torch


def causal_mask(first: int, rows: int, keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [1, 1, rows, keys] mask for query rows that are key indices first .. first+rows-1:
    0 where the key index is at most the query's, the dtype's minimum after it."""
    query_index = torch.arange(first, first + rows, device=device)
    allowed = torch.arange(keys, device=device)[None, :] <= query_index[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


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
    elif offset and rows > 1:  # sdpa's causal shortcut covers only a square block; one row sees every key
        mask = causal_mask(offset, rows, end, query.dtype, query.device)
    out, _ = attend(module, query[:, :, :rows], key[:, :, :end], value[:, :, :end], mask, **kwargs)
    return out


# The largest fp32 attention-score block ([B, heads, rows, keys]) one call here may build: the masks
# of masked calls (rope_ext.method.self_extend) and the scores of attend_with_lse on a device with
# no fused kernel here.
SCORE_BYTES = 128 << 20


def attend_with_lse(query, key, value, *, causal: bool = False, mask: torch.Tensor | None = None, scale: float | None = None):
    """(output [B, H, Sq, D], logsumexp [B, H, Sq] in fp32) of softmax attention; `causal` aligns
    the first query with the first key, `mask` is additive in the query's dtype. Key heads may be
    grouped, and values may have another head size than queries and keys (multi-head latent
    attention). A row that sees no key has lse 0 and output 0 (the CPU kernel's convention).

    The CPU and CUDA run torch's fused kernels (`FUSED`), which never hold a [rows, keys] score
    tensor; other devices compute the scores in blocks (`attend_with_lse_by_scores`), and so does
    a call autograd records: the fused kernels' logsumexp carries no gradient (their backward
    takes the output's alone), and merge_by_lse differentiates through it, so two parts merged
    from fused calls would train on wrong gradients. Explicit scores cost memory: autograd keeps
    each block for the backward unless gradient checkpointing recomputes the layer."""
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    kernel = attend_with_lse_by_scores if recorded else FUSED.get(query.device.type, attend_with_lse_by_scores)
    return kernel(query, key, value, causal=causal, mask=mask, scale=scale)


def one_head_size(query, key, value, scale: float | None):
    """(query, key, value, width, scale) with one head size for all three, as torch's flash kernels
    take them: the smaller side gets zero channels, which add nothing to scores or outputs; the
    output's first `width` channels are the attention's."""
    size, width = query.shape[-1], value.shape[-1]
    if width < size:
        value = torch.nn.functional.pad(value, (0, size - width))
    elif width > size:
        scale = size**-0.5 if scale is None else scale
        query, key = (torch.nn.functional.pad(x, (0, width - size)) for x in (query, key))
    return query, key, value, width, scale


def attend_on_cpu(query, key, value, *, causal: bool = False, mask: torch.Tensor | None = None, scale: float | None = None):
    """attend_with_lse through torch's CPU flash kernel, which sdpa runs on the CPU and which also
    returns the logsumexp."""
    query, key, value, width, scale = one_head_size(query, key, value, scale)
    batch, heads, rows, dim = query.shape
    groups = heads // key.shape[1]
    if rows == 1 and groups > 1 and not causal and (mask is None or mask.shape[1] == 1):
        # one row of grouped heads (a decode step): the heads of each key head as rows of one
        # call, so that its keys are read once, not once per head (transformers' pack_gqa)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query.reshape(batch, heads // groups, groups, dim), key, value, 0.0, False, attn_mask=mask, scale=scale
        )
        out = out.reshape(batch, heads, 1, out.shape[-1])
        return (out if width == dim else out[..., :width]), lse.reshape(batch, heads, 1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, attn_mask=mask, scale=scale
    )
    return (out if width == dim else out[..., :width]), lse


# the memory-efficient CUDA kernel reads its additive mask in rows whose stride is a multiple of
# this many elements (torch pads a mask for it the same way inside sdpa)
MASK_ALIGNMENT = 16


def attend_on_cuda(query, key, value, *, causal: bool = False, mask: torch.Tensor | None = None, scale: float | None = None):
    """attend_with_lse through torch's fused CUDA kernels. FlashAttention-2 takes the calls in
    half precision without a mask, grouped key heads as they are; its causal mask aligns the
    last query with the last key, which is the first-with-first of this function only on a square
    block. The memory-efficient kernel takes the others (fp32, an additive mask, a causal
    non-square block: its causal mask is top-left), with key heads repeated to the query's, which
    it does not group. Both keep scores on chip and return the logsumexp in fp32."""
    batch, heads, rows, _ = query.shape
    keys = key.shape[-2]
    flash = (
        mask is None
        and query.dtype in (torch.float16, torch.bfloat16)
        and (rows == keys or not causal)
        and max(query.shape[-1], value.shape[-1]) <= 256
    )
    if flash:
        query, key, value, width, scale = one_head_size(query, key, value, scale)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False, scale=scale)[:2]
        return out[..., :width], lse
    groups = heads // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if mask is not None:
        pad = -keys % MASK_ALIGNMENT
        mask = torch.nn.functional.pad(mask, (0, pad))[..., :keys].expand(batch, heads, rows, keys)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, mask, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., :rows]  # the kernel pads the logsumexp's rows to a multiple of 32


def attend_with_lse_by_scores(
    query, key, value, *, causal: bool = False, mask: torch.Tensor | None = None, scale: float | None = None
):
    """attend_with_lse from explicit fp32 scores, for devices without a fused kernel here. Query rows
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


# device type -> the fused kernel attend_with_lse runs there
FUSED = {"cpu": attend_on_cpu, "cuda": attend_on_cuda}


def merge_by_lse(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """One softmax over the keys of several attention calls: parts are (output [B, H, Sq, D],
    lse [B, H, Sq], seen [B, 1 or H, Sq] bool or None = every row saw a key). A part a row did not
    see, or whose lse is -inf, gets weight 0. Returns [B, H, Sq, D] in the first output's dtype."""
    lses = torch.stack([lse if seen is None else lse.masked_fill(~seen, float("-inf")) for _, lse, seen in parts])
    # all parts unseen: a row with no key at all; not in place, autograd keeps the softmax
    first, *weights = torch.softmax(lses, dim=0).nan_to_num(0.0).unsqueeze(-1).unbind(0)
    merged = first * parts[0][0]
    for weight, (out, _, _) in zip(weights, parts[1:]):
        merged.addcmul_(weight, out)  # in place: a product and a sum per part would each be a new tensor
    return merged if merged.dtype == parts[0][0].dtype else merged.to(parts[0][0].dtype)


def attend_one_row(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scale: float | None = None) -> torch.Tensor:
    """A single query row (a decode step) attending each part's keys, every one of them, in one
    softmax: parts are (query [B, H, 1, D], key [B, Hkv, n, D], value [B, Hkv, n, Dv]) over disjoint
    keys. Returns [B, 1, H, Dv], the backends' layout.

    Each part is one attend_with_lse call with the query heads of each key head as the rows of
    that head (torch's pack_gqa: the keys are read once, not once per query head, and without a
    mask each row sees every key), and the parts are merged in that layout: no copy of a part's
    output or log-sum-exp to the [B, H, 1] layout, whose bits the merge's are (the heads of a key
    head are consecutive in both). A step's few rows make its cost the count of its operations."""
    batch, heads, _, dim = parts[0][0].shape
    attended = []
    for query, key, value in parts:
        attended.append((*attend_with_lse(query.view(batch, key.shape[1], -1, dim), key, value, scale=scale), None))
    merged = merge_by_lse(attended)
    return merged.reshape(batch, heads, 1, merged.shape[-1]).transpose(1, 2)


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
            out, lse = attend_with_lse(
                query[:, :, lo : lo + n - 1].flip(2),
                key[:, :, earlier].flip(2),
                value[:, :, earlier].flip(2),
                causal=True,
                scale=scale,
            )
            # the block's last row sees none of these keys
            out = torch.cat((out.flip(2), out.new_zeros((*out.shape[:2], 1, out.shape[-1]))), dim=2)
            lse = torch.cat((lse.flip(-1), lse.new_full((*lse.shape[:2], 1), float("-inf"))), dim=-1)
            parts.append((out, lse, None))
        yield lo, lo + n, parts
