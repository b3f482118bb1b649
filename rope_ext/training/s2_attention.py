"""LongLoRA's shifted sparse attention, which a fine-tune trains with, and the switch back to the
model's full attention, which it is evaluated and saved with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface


def s2_attention(groups: int):
    """An AttentionInterface function: causal attention inside `groups` equal blocks of the
    sequence; the second half of the heads uses blocks shifted by half a block, so information
    crosses block borders. The shifted heads' two half-size edge blocks attend on their own
    (no wrap-around, so no token sees the future)."""

    def blocks(q, k, v, size, dropout, scaling):
        b, h, s, d = q.shape
        n = s // size

        def split(x):
            return x.reshape(b, h, n, size, d).transpose(1, 2).reshape(b * n, h, size, d)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), dropout_p=dropout, is_causal=True, scale=scaling)
        return out.reshape(b, n, h, size, d).transpose(1, 2).reshape(b, h, s, d)

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        _, heads, seq, _ = query.shape
        size = seq // groups
        if seq % groups or size % 2:
            raise ValueError(f"shifted sparse attention needs a length divisible by {2 * groups}, got {seq}")
        repeat = heads // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        half, edge = heads // 2, size // 2
        plain = blocks(query[:, :half], key[:, :half], value[:, :half], size, dropout, scaling)
        qs, ks, vs = query[:, half:], key[:, half:], value[:, half:]
        middle = blocks(qs[:, :, edge:-edge], ks[:, :, edge:-edge], vs[:, :, edge:-edge], size, dropout, scaling)

        def ends(x):
            return torch.cat((x[:, :, :edge], x[:, :, -edge:]), dim=2)

        outer = blocks(ends(qs), ends(ks), ends(vs), edge, dropout, scaling)
        shifted = torch.cat((outer[:, :, :edge], middle, outer[:, :, edge:]), dim=2)
        return torch.cat((plain, shifted), dim=1).transpose(1, 2).contiguous(), None

    return attention


def register_s2(groups: int) -> str:
    name = f"rope_ext_s2_{groups}"
    AttentionInterface.register(name, s2_attention(groups))
    return name


class AttentionSwitch:
    """Moves a model between shifted sparse attention with `groups` groups and the attention it
    was loaded with; with 0 groups the model keeps its own attention throughout."""

    def __init__(self, model, groups: int):
        self.model, self.groups = model, groups
        self.full_attention = model.config._attn_implementation
        self.sparse_attention = register_s2(groups) if groups else None

    def sparse(self) -> None:
        if self.groups:
            self.model.set_attn_implementation(self.sparse_attention)

    def full(self) -> None:
        if self.groups:
            self.model.set_attn_implementation(self.full_attention)
