"""alibi_hybrid: the (optionally scaled) rotary embedding plus ALiBi's linear distance bias (Press et
al. 2022, "Train Short, Test Long: Attention with Linear Biases Enables Input Length Extrapolation"),

    logits[h, i, j] += -m_h * max(0, (i - j) - w)    for j <= i,

with ALiBi's geometric slopes m_h (times `slope_scale`, on a chosen subset of heads). Keys within
`w` tokens of a query get no bias; by default w is the model's original window, so inside the
trained window the bias is zero and farther keys fade out linearly.

The rotary part is any registered method (`rope="ntk"`, `"yarn"`, ...) at the patch's factor, or
`rope=None` for the model's own RoPE: then `factor` only sets the length the patched model is
meant for (PatchInfo.max_length; the config keeps the trained window, as a plain reload is the
unpatched model). Slopes live per attention layer in an `AlibiSlopes` module at
`<attention>.rope_ext_alibi`: fixed buffers, or with `trainable=True` an nn.Parameter that is saved
with the model and that peft trains with `modules_to_save=["rope_ext_alibi"]`. Parameters and
measurements: docs/alibi.md; how the bias runs: `AlibiBias`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rope_ext.attention import AttentionTransform, base_name, causal_mask
from rope_ext.geometry import RotaryGeometry

from .base import Method, ModelFacts, Param, Requires, default_inv_freq
from .rope import METHODS

ROPE_METHODS = {m.name: m for m in METHODS}

NAME = "alibi_hybrid"
ATTRIBUTE = "rope_ext_alibi"  # the per-layer slopes module; also peft's modules_to_save name
# the bias, slope_scale x m_h x distance, stays finite in fp32 for any distance below 2^31
MAX_SLOPE_SCALE = 1e6
PARAMS = (
    Param("rope", "ntk", "choice", choices=tuple(ROPE_METHODS), nullable=True, doc="the rotary method; None: plain RoPE"),
    Param("w", None, "size", lo=0, doc="the bias-free distance, in tokens"),
    Param(
        "heads",
        None,
        "list",
        item=Param("head", kind="size", lo=0),
        distinct=True,
        sort=True,
        doc="head indices",
    ),
    Param("slope_scale", 1.0, "float", lo=0, lo_open=True, hi=MAX_SLOPE_SCALE, doc="multiplies every slope"),
    Param("trainable", False, "bool", doc="the slopes as an nn.Parameter, saved with the model"),
)
DEFAULT_ROPE = PARAMS[0].default
SUMMARY = "RoPE (scaled by `rope` at the factor, or plain) plus ALiBi's linear bias past distance w"
FORMULA = "logits[h,i,j] += -slope_scale * m_h * max(0, i - j - w) for j <= i; m_h = 2^(-8h/H)"

# Chunking of query rows (eager, sdpa): a chunk that must add the model's own mask to the bias
# holds at most MASK_BYTES of it; without one, chunks of at least QUERY_ROWS rows, at most
# MAX_CHUNKS of them.
MASK_BYTES = 32 << 20
QUERY_ROWS = 256
MAX_CHUNKS = 16

MASK_BACKENDS = ("eager", "sdpa")  # take an additive [B, H, Sq, Sk] mask
BACKENDS = (*MASK_BACKENDS, "flex_attention", "flash_attention_2")


@dataclass(frozen=True)
class HybridMethod(Method):
    """alibi_hybrid as a Method: the frequencies of its `rope` method (or the original ones),
    parameters of both, and the bias as an attention transform (`AlibiBias`)."""

    rope: Method | None = None

    def bind(self, params: dict) -> HybridMethod:
        return hybrid_method(params)

    @property
    def requires(self) -> Requires:
        """The rope's (Method.requires: the bias inside attention, and with a dynamic rope its
        rotation and schedule there), the backends that take a bias, causal attention."""
        return replace(super().requires, backends=BACKENDS, causal=True)

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float, params: dict) -> tuple[float, dict]:
        """`params` with w resolved (None -> the original window); ValueError, changing nothing,
        when the heads, or the attention backend for w and trainable, do not fit. The rope's
        schedule resolves as the rope alone would (Method.resolve: its default granularity)."""
        factor, params = super().resolve(facts, geometry, factor, params)
        w = geometry.original_window if params["w"] is None else params["w"]
        heads = params["heads"]
        if heads is not None and heads[-1] >= facts.num_heads:
            raise ValueError(f"{NAME}: head index {heads[-1]} out of range; the model has {facts.num_heads} heads")
        check_backend(facts.backend, w, params["trainable"])
        return factor, {**params, "w": w}

    def attention(self, rotary, facts: ModelFacts, params: dict) -> list:
        heads = list(range(facts.num_heads)) if params["heads"] is None else params["heads"]
        return [AlibiBias(facts.num_heads, heads, params["w"], params["slope_scale"], params["trainable"])]

    def load_state(self, model: nn.Module, path, params: dict) -> None:
        if params["trainable"]:
            load_trained_slopes(model, path)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes m_h = 2^(-8h/H), h = 1..H, in fp32.

    For H not a power of two: the slopes of the power of two just below, then every other slope
    of the next power of two, as in the ALiBi paper."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")

    def geometric(n: int) -> list[float]:
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]

    below = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(below)
    if below < num_heads:
        slopes += geometric(2 * below)[0::2][: num_heads - below]
    return torch.tensor(slopes, dtype=torch.float32)


def hybrid_method(params: dict) -> HybridMethod:
    """The alibi_hybrid Method for `params["rope"]` (default "ntk"); ValueError on an unknown rope."""
    rope = params.get("rope", DEFAULT_ROPE)
    if rope is not None and (not isinstance(rope, str) or rope not in ROPE_METHODS):
        raise ValueError(f"{NAME}: unknown rope method {rope!r}; use None (plain RoPE) or one of: {', '.join(ROPE_METHODS)}")
    inner = ROPE_METHODS[rope] if rope is not None else None

    def frequencies(geom, seq_len=None, *, factor, rope, w, heads, slope_scale, trainable, **rope_params):
        if inner is None:
            return default_inv_freq(geom), 1.0
        return inner.fn(geom, seq_len, factor=factor, **rope_params)

    return HybridMethod(
        NAME,
        frequencies,
        SUMMARY,
        FORMULA,
        params=(replace(PARAMS[0], default=rope), *PARAMS[1:], *(inner.params.values() if inner else ())),
        constraints=inner.constraints if inner else (),
        rotation=inner.rotation if inner else "static",
        follows_length=bool(inner and inner.follows_length),
        rope=inner,
    )


METHOD = hybrid_method({})  # registered with its default rope; `bind` picks the user's


def check_backend(backend: str, w: int, trainable: bool) -> None:
    """ValueError when attention backend `backend`, one of BACKENDS (HybridMethod.requires), cannot
    apply this bias with `w` and `trainable`."""
    if backend == "flash_attention_2" and w != 0:
        raise ValueError(
            f"{NAME}: flash_attention_2 applies ALiBi only from distance 0 (its alibi_slopes); "
            f"w={w} needs sdpa, eager or flex_attention"
        )
    if trainable and backend not in MASK_BACKENDS:
        raise ValueError(f"{NAME}: trainable slopes need the eager or sdpa backend (gradients through the bias), not {backend}")


class AlibiSlopes(nn.Module):
    """One attention layer's slopes: forward() -> [num_heads] fp32, slope_scale * m_h on the chosen
    heads and 0 on the others. Trainable slopes are an nn.Parameter over the chosen heads."""

    def __init__(self, num_heads: int, heads: list[int], slope_scale: float, trainable: bool, device):
        super().__init__()
        self.num_heads = num_heads
        index = torch.tensor(heads, dtype=torch.long, device=device)
        initial = (alibi_slopes(num_heads) * slope_scale).to(device)[index]
        self.index = nn.Buffer(index, persistent=False)
        if trainable:
            self.slopes = nn.Parameter(initial)
        else:
            self.slopes = nn.Buffer(initial, persistent=False)

    def forward(self) -> torch.Tensor:
        slopes = self.slopes.float()
        if slopes.numel() == self.num_heads:
            return slopes
        return slopes.new_zeros(self.num_heads).index_put((self.index,), slopes)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, heads={self.index.tolist()}, trainable={isinstance(self.slopes, nn.Parameter)}"


class AlibiBias(AttentionTransform):
    """Adds the ALiBi-hybrid bias inside attention; the last transform of a chain. For eager (and
    any backend that adds a float mask) it hands chunked, biased masks to `attend`; for sdpa,
    flex_attention and flash_attention_2 it calls the kernel itself, since their transformers
    wrappers take no memory-safe bias.

    It never builds a [B, H, L, L] tensor for the whole sequence:
    - eager and sdpa: the bias depends on i - j only, so with the keys taken in reverse order it
      depends on (query row + key index) and a chunk's [H, rows, keys] bias is a strided view of one
      [H, rows + keys] table, which sdpa reads without copying. Query rows go in chunks so that each
      sees only the keys it can attend to (the causal half is skipped as in plain sdpa). Only a mask
      of the model's own (padding; eager always has one) is added to the view, at most MASK_BYTES a
      chunk. Rows with no key farther than w are attended exactly as without the patch. sdpa is
      called directly with grouped key heads (transformers' wrapper would copy keys per head).
    - flex_attention: the bias is a score_mod, computed inside the kernel.
    - flash_attention_2: the kernel's own `alibi_slopes`, which only exists for w = 0.
    Distances are key indices, aligned bottom-right (the last query is the last key), which is what
    the model's causal mask and flash-attention use; with left padding the real tokens are contiguous
    so their distances are the same. A KV cache that grows (DynamicCache) keeps that alignment, so
    decoding gives the logits of a full forward; pre-allocated (static) caches are refused."""

    def __init__(self, num_heads: int, heads: list[int], w: int, slope_scale: float, trainable: bool):
        self.num_heads, self.heads, self.w = num_heads, heads, w
        self.slope_scale, self.trainable = slope_scale, trainable

    def attach(self, site) -> None:
        for module in site.attention:
            device = next(module.parameters()).device
            setattr(module, ATTRIBUTE, AlibiSlopes(self.num_heads, self.heads, self.slope_scale, self.trainable, device))

    def detach(self, site) -> None:
        for module in site.attention:
            if hasattr(module, ATTRIBUTE):
                delattr(module, ATTRIBUTE)

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        slopes = getattr(module, ATTRIBUTE)()  # through peft's modules_to_save wrapper when there is one
        if slopes.numel() != query.shape[1]:
            raise RuntimeError(f"{NAME}: {slopes.numel()} slopes for {query.shape[1]} query heads")
        backend = base_name(module.config._attn_implementation)
        if backend == "flex_attention":
            return self._flex(module, query, key, value, attention_mask, slopes, **kwargs)
        if backend == "flash_attention_2":
            return self._flash(module, query, key, value, attention_mask, slopes, **kwargs)
        return self._chunked(
            module, query, key, value, attention_mask, attend, slopes, kwargs, grouped_sdpa if backend == "sdpa" else attend
        )

    # eager / sdpa ---------------------------------------------------------------------------

    def _chunked(self, module, query, key, value, mask, attend, slopes, kwargs, kernel):
        """Row chunks through `kernel` (the backend, or grouped_sdpa for sdpa); without any key
        farther than w, the whole call goes to `attend` unchanged."""
        q_len, kv_len = query.shape[-2], key.shape[-2]
        offset = kv_len - q_len  # query row r is key index offset + r
        first = max(0, self.w + 1 - offset)  # rows before it have no key farther than w
        if first >= q_len:
            return attend(module, query, key, value, mask, **kwargs)
        outputs, weights = [], []
        if first:
            end = offset + first  # keys past a chunk's last query are masked for all its rows
            out, weight = kernel(
                module,
                query[:, :, :first],
                key[:, :, :end],
                value[:, :, :end],
                self._causal(mask, offset, first, query),
                **kwargs,
            )
            outputs.append(out)
            weights.append(None if weight is None else F.pad(weight, (0, kv_len - end)))
        # The bias depends on i - j only. With the keys in reverse order it depends on
        # (row + reversed key index), so a chunk's [H, rows, keys] bias is a strided view of one
        # [H, rows + keys] table: no [H, L, L] tensor, and nothing to build per chunk.
        key, value = key.flip(-2), value.flip(-2)
        rows = self._rows(query, mask, kv_len, q_len - first)
        table = self._table(slopes, rows, kv_len, query)
        for lo in range(first, q_len, rows):
            hi = min(lo + rows, q_len)
            end = offset + hi
            bias = table.as_strided((1, table.shape[0], hi - lo, end), (0, table.stride(0), 1, 1), rows - (hi - lo))
            if mask is not None:
                model_mask = mask[:, :, lo:hi, :end].flip(-1)
                if model_mask.dtype == torch.bool:
                    bias = torch.where(model_mask, bias, torch.finfo(query.dtype).min)
                else:
                    bias = (model_mask + bias).clamp_(min=torch.finfo(query.dtype).min)
            out, weight = kernel(
                module, query[:, :, lo:hi], key[:, :, kv_len - end :], value[:, :, kv_len - end :], bias, **kwargs
            )
            outputs.append(out)
            weights.append(None if weight is None else F.pad(weight.flip(-1), (0, kv_len - end)))
        weight = None if weights[0] is None else torch.cat(weights, dim=2)
        return torch.cat(outputs, dim=1), weight

    @staticmethod
    def _rows(query, mask, kv_len: int, n_rows: int) -> int:
        """Query rows per chunk. A mask of the model's (padding) has to be added to the bias, so
        the chunk's [B, H, rows, keys] sum is bounded by MASK_BYTES; the bias view alone costs
        nothing, and chunks are only there to skip the keys each chunk cannot see."""
        if mask is not None:
            return max(1, MASK_BYTES // (mask.shape[0] * query.shape[1] * kv_len * query.element_size()))
        return max(QUERY_ROWS, math.ceil(n_rows / MAX_CHUNKS))

    def _table(self, slopes, rows: int, kv_len: int, query) -> torch.Tensor:
        """[H, rows + kv_len - 1]: entry t is the bias at distance i - j = t - (rows - 1), the
        dtype's minimum where that is negative (a future key)."""
        distance = torch.arange(rows + kv_len - 1, device=query.device, dtype=torch.float32) - (rows - 1)
        table = -slopes.to(query.device)[:, None] * (distance - self.w).clamp(min=0)[None]
        return table.masked_fill_(distance[None] < 0, torch.finfo(query.dtype).min).to(query.dtype).contiguous()

    @staticmethod
    def _causal(mask, offset: int, rows: int, query):
        """The model's mask for the first `rows` query rows, or a causal one; None (the backend's
        own causal path, as without the patch) for a square block."""
        if mask is not None:
            return mask[:, :, :rows, : offset + rows]
        if offset == 0:
            return None
        return causal_mask(offset, rows, offset + rows, query.dtype, query.device)

    # flex_attention -------------------------------------------------------------------------

    def _flex(self, module, query, key, value, mask, slopes, scaling=None, dropout=0.0, **kwargs):
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask
        from transformers.integrations.flex_attention import compile_friendly_flex_attention, repeat_kv

        if dropout > 0:
            raise ValueError("flex_attention does not support dropout; use the model in eval mode or another backend")
        q_len, kv_len = query.shape[-2], key.shape[-2]
        # Tensors, not Python numbers, so that decoding steps reuse one compiled kernel.
        offset = torch.tensor(kv_len - q_len, device=query.device)
        slopes = slopes.to(query.device)
        w = self.w
        block_mask = mask if isinstance(mask, BlockMask) else None
        score_mask = mask[:, :, :, :kv_len] if isinstance(mask, torch.Tensor) else None
        if mask is None:
            block_mask = create_block_mask(
                lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx, None, None, q_len, kv_len, device=query.device
            )

        def score_mod(score, batch, head, q_idx, kv_idx):
            score = score - slopes[head] * torch.clamp(q_idx + offset - kv_idx - w, min=0)
            if score_mask is not None:
                score = score + score_mask[batch, 0, q_idx, kv_idx]
            return score

        heads = query.shape[1]
        gqa = heads & (heads - 1) == 0  # as transformers: grouped kernels want a power-of-two head count
        if not gqa:
            key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // value.shape[1])
        out = compile_friendly_flex_attention(
            query,
            key,
            value,
            score_mod=score_mod,
            block_mask=block_mask,
            enable_gqa=gqa,
            scale=scaling,
            kernel_options=kwargs.get("kernel_options"),
            training=module.training,
        )
        return out.transpose(1, 2).contiguous(), None

    # flash_attention_2 ----------------------------------------------------------------------

    def _flash(self, module, query, key, value, mask, slopes, scaling=None, dropout=0.0, **kwargs):
        """flash-attn's alibi_slopes add -m_h * |i + Sk - Sq - j|: with causal masking and w = 0
        that is this bias (bias_for refuses other w)."""
        from flash_attn import flash_attn_func, flash_attn_varlen_func
        from flash_attn.bert_padding import pad_input, unpad_input
        from transformers.integrations.flash_attention import get_target_dtype

        batch, _, q_len, _ = query.shape
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D]
        target = get_target_dtype(query, module)
        if target is not None:
            q, k, v = q.to(target), k.to(target), v.to(target)
        common = dict(dropout_p=dropout, softmax_scale=scaling, causal=True, alibi_slopes=slopes.float().contiguous())
        if mask is None:
            return flash_attn_func(q, k, v, **common), None
        k_flat, _, cu_k, max_k = unpad_input(k, mask)[:4]
        v_flat = unpad_input(v, mask)[0]
        q_flat, q_index, cu_q, max_q = unpad_input(q, mask[:, -q_len:])[:4]
        out = flash_attn_varlen_func(q_flat, k_flat, v_flat, cu_q, cu_k, max_q, max_k, **common)
        return pad_input(out, q_index, batch, q_len), None


def grouped_sdpa(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
    """torch's sdpa on grouped key heads under a mask too (transformers' sdpa wrapper copies the
    keys out per query head whenever there is a mask, for every chunk). Without a mask the block
    is square and causal."""
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=mask is None and query.shape[-2] > 1,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def load_trained_slopes(model: nn.Module, path) -> None:
    """Copy the trained slopes saved in checkpoint directory `path` into the patched `model`
    (transformers' loader drops them: the plain model it builds has no such parameters)."""
    from safetensors import safe_open

    wanted = {name: p for name, p in model.named_parameters() if name.endswith(f"{ATTRIBUTE}.slopes")}
    found = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            found.update({key: handle.get_tensor(key) for key in handle.keys() if key in wanted})
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(
            f"{path}: the checkpoint was saved with trainable {NAME} slopes but holds none for "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
        )
    with torch.no_grad():
        for name, value in found.items():
            wanted[name].copy_(value)
