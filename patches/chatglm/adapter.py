"""Remote-code ChatGLM2, ChatGLM3 and GLM-4 (model_type "chatglm", loaded by the user with
trust_remote_code=True).

What these checkpoints share (docs/references.md, "ChatGLM rotary conventions"): one `transformer.rotary_pos_emb` module whose
`forward(max_seq_len, offset=0)` returns a [max_seq_len, D/2, 2] table of (cos, sin) that the model
indexes with position_ids; only the first D = kv_channels/2 channels of each head rotate, as
interleaved pairs. What differs between generations lives in their code, so it is read from the live
module: the adapter calls it and compares the table with every known way of computing it. That gives
the meaning of rope_ratio (ChatGLM2-6B-32K divides positions by it, ChatGLM3-6B-32K and GLM-4
multiply the base by it) and the dtype positions are computed in (ChatGLM2 uses its buffer's dtype,
so in fp16 position 16385 becomes 16384). The patched table is always computed in fp32.

Patching composes with the checkpoint's own rope_ratio: the window is the checkpoint's seq_length and
the factor is relative to it. A base-multiplying ratio is simply the base; a position-dividing ratio
keeps dividing positions, and the methods see the window in those position units (glm.py).

Dynamic methods: the model applies the table itself and caches rotated keys, so the patched module
hands it an identity table (keys enter the cache un-rotated) and every layer's `core_attention`
forward is wrapped to rotate queries and keys with the frequencies of the current length, as
rope-ext does through transformers' attention interface for native models (rope_ext.attention). The
wrapper needs the layout of the tensors, read once from the embedding's output (sequence-first in
ChatGLM2/3, batch-first in GLM-4), and a core attention that takes a boolean mask (eager or sdpa):
flash-attention cores take a padding mask that cannot express a query group's causal slice.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from rope_ext.attention import AttentionTransform
from rope_ext.geometry import RotaryGeometry
from rope_ext.method.base import Method, ModelFacts
from rope_ext.record import Patch
from rope_ext.rotary import DynamicRotation, PatchRotary, with_position_ratio
from rope_ext.rotation import cos_sin
from rope_ext.shipped import Shipped

from ..base import FamilyAdapter, ModelReading

BASE = 10000  # every ChatGLM rotary module starts from this base
PROBE_LENGTH = 4100  # past 256 and 2048, where bf16 and fp16 positions stop being exact
EXPECTED = "`transformer.rotary_pos_emb` with an `inv_freq` buffer and forward(max_seq_len, offset=0) -> [max_seq_len, kv_channels/4, 2] (cos, sin)"

V1_ERROR = (
    "ChatGLM-6B (v1) is not supported: it rotates each head with 2-D positions (the token position on "
    "one half, a block position on the other) through a separate rotary module in every layer, so there "
    "is no single rotary table to rescale and the block-position half has no length to extend. "
    "ChatGLM2-6B, ChatGLM3-6B and GLM-4 are supported."
)


@dataclass
class ChatGLMSite:
    """Where a ChatGLM model's rotary table is made and used."""

    model: nn.Module  # the PreTrainedModel (unwrapped from peft)
    transformer: nn.Module  # ChatGLMModel: calls rotary_pos_emb(seq_length) on every forward
    rotary: nn.Module

    @property
    def config(self):
        return self.model.config

    layer_types = None  # one set of frequencies

    @property
    def installed(self) -> ChatGLMRotaryEmbedding | None:
        """The rope-ext rotary module installed here, or None."""
        return self.rotary if isinstance(self.rotary, ChatGLMRotaryEmbedding) else None

    @property
    def cores(self) -> list[nn.Module]:
        return [layer.self_attention.core_attention for layer in self.transformer.encoder.layers]


def reference_table(length: int, pairs: int, ratio: float, meaning: str, dtype: torch.dtype, device) -> torch.Tensor:
    """The (cos, sin) table a ChatGLM rotary module computes for one reading of rope_ratio
    ("base": base * ratio; "positions": positions / ratio), with frequencies and positions in
    `dtype` (ChatGLM2 uses its buffer's dtype, ChatGLM3 and GLM-4 fp32)."""
    base = BASE * ratio if meaning == "base" else BASE
    theta = 1.0 / (base ** (torch.arange(0, 2 * pairs, 2, dtype=dtype, device=device) / (2 * pairs)))
    positions = torch.arange(length, dtype=dtype, device=device)
    if meaning == "positions":
        positions = positions / ratio
    angles = torch.outer(positions, theta).float()
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _tolerance(dtype: torch.dtype) -> float:
    # Room for another cos/sin kernel; the readings differ by O(1) somewhere in the probe.
    return 1e-4 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


def read_convention(rotary: nn.Module, config, head_dim: int) -> dict:
    """Call the live rotary module and return which known computation it performs, as the JSON
    record rope-ext keeps: rope_ratio, its meaning, effective base, position ratio, position dtype.
    Raises ValueError naming what was found when nothing known matches."""
    found = f"{type(rotary).__module__}.{type(rotary).__name__}"
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise ValueError(
            f"rope_ext cannot patch this ChatGLM model: found {found} without an `inv_freq` buffer; expected {EXPECTED}"
        )
    try:
        with torch.no_grad():
            table = rotary(PROBE_LENGTH)
    except Exception as err:  # report any failure of foreign code as an interface mismatch
        raise ValueError(
            f"rope_ext cannot patch this ChatGLM model: calling {found}({PROBE_LENGTH}) raised {type(err).__name__}: {err}; "
            f"expected {EXPECTED}"
        ) from err
    pairs = head_dim // 4
    if not isinstance(table, torch.Tensor) or tuple(table.shape) != (PROBE_LENGTH, pairs, 2):
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(
            f"rope_ext cannot patch this ChatGLM model: {found}({PROBE_LENGTH}) returned {shape}; "
            f"expected {EXPECTED}, here ({PROBE_LENGTH}, {pairs}, 2) for kv_channels={head_dim}"
        )
    ratio = getattr(rotary, "rope_ratio", None)
    ratio = float(getattr(config, "rope_ratio", 1) if ratio is None else ratio)
    live = table.float()
    deviations = {}
    # Order matters where readings coincide: with ratio 1 the meaning is moot, with an fp32 buffer
    # the position dtype is; the first match is reported.
    for meaning in ("base", "positions"):
        for dtype in dict.fromkeys((torch.float32, inv_freq.dtype)):
            reference = reference_table(PROBE_LENGTH, pairs, ratio, meaning, dtype, table.device).to(table.dtype).float()
            deviation = (live - reference).abs().max().item()
            reading = "multiplies the base" if meaning == "base" else "divides positions"
            deviations[f"rope_ratio={ratio:g} {reading}, positions in {str(dtype).removeprefix('torch.')}"] = deviation
            if deviation <= _tolerance(table.dtype):
                return {
                    "rope_ratio": ratio,
                    "rope_ratio_meaning": None if ratio == 1 else meaning,
                    "base": BASE * ratio if meaning == "base" else float(BASE),
                    "position_ratio": ratio if meaning == "positions" else 1.0,
                    "position_dtype": str(dtype).removeprefix("torch."),
                }
    tried = "; ".join(f"{k}: max deviation {v:.3g}" for k, v in deviations.items())
    raise ValueError(
        f"rope_ext cannot patch this ChatGLM model: the table {found} returns matches no known ChatGLM rotary "
        f"computation (base {BASE}, rotary dim {2 * pairs}) within {_tolerance(table.dtype):.0e} — {tried}"
    )


def _cache_object(past):
    """What identifies a KV cache from one call to the next: a transformers Cache itself, or the
    first layer's key tensor (stacked key/value tensor) of the tuple caches the hub code returns."""
    if isinstance(past, (tuple, list)):
        first = past[0]
        return first[0] if isinstance(first, (tuple, list)) else first
    return past


def _has_entries(past) -> bool:
    if past is None:
        return False
    if isinstance(past, (tuple, list)):
        return len(past) > 0
    return past.get_seq_length() > 0


def _returned_cache(output):
    if isinstance(output, tuple):
        return output[1] if len(output) > 1 else None
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


class ChatGLMRotaryEmbedding(PatchRotary):
    """Drop-in for ChatGLM's `rotary_pos_emb`: `forward(max_seq_len, offset=0)` returns the
    [L, D/2, 2] (cos, sin) table, from fp32 positions and angles, cast to the dtype the original's
    table had. The table covers every position the current forward uses (a pre-forward hook on the
    transformer tells it), not only the checkpoint's seq_length.

    Keeps the replaced module to put back and the checkpoint's `inv_freq` buffer under the same
    name, so the state dict keeps its keys."""

    def __init__(
        self, method: Method, factor: float, params: dict, geometry: RotaryGeometry, original: dict, original_module: nn.Module
    ):
        ratio = float(original["position_ratio"])
        super().__init__(with_position_ratio(method, ratio), factor, params, geometry, original)
        self.position_ratio = ratio
        self._replaced = (original_module,)  # a tuple, so it is not registered as a submodule
        self.scaled_inv_freq = nn.Buffer(self.scaled(original_module.inv_freq.device), persistent=False)
        self.inv_freq = nn.Buffer(original_module.inv_freq.detach().clone())
        self.rotation = DynamicRotation(self.method, factor, self.params, geometry, self.scaled_inv_freq.device)
        self.needed_length = 0
        self._table: torch.Tensor | None = None

    @property
    def original_module(self) -> nn.Module:
        return self._replaced[0]

    def _apply(self, fn, recurse=True):
        # A cast of the model casts `inv_freq` (it sets the table's dtype, as in the original);
        # the frequencies stay fp32.
        super()._apply(fn, recurse)
        self.scaled_inv_freq = self.scaled(self.inv_freq.device)
        self.rotation.device = self.inv_freq.device
        self._table = None
        return self

    def frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        if not self.method.follows_length:
            return self.scaled_inv_freq, self.attention_scaling
        return self.rotation.frequencies(seq_len)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        # `offset` is part of the interface and unused, as in the ChatGLM code.
        length = max(int(max_seq_len), self.needed_length)
        dtype = self.inv_freq.dtype if self.inv_freq.dtype in (torch.float16, torch.bfloat16) else torch.float32
        table = self._table
        if table is None or table.dtype != dtype or table.device != self.inv_freq.device:
            table = self._table = self._build_table(length, dtype)
        elif table.shape[0] < length:  # decoding past the table: grow geometrically, not per token
            table = self._table = self._build_table(max(length, 2 * table.shape[0]), dtype)
        return table

    def _build_table(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        pairs = self.geometry.rotary_dim // 2
        device = self.inv_freq.device
        if self.dynamic:
            # Identity rotation: keys enter the cache un-rotated; the wrapped core attention rotates.
            table = torch.zeros(length, pairs, 2, dtype=dtype, device=device)
            table[..., 0] = 1
            return table
        positions = torch.arange(length, device=device)
        cos, sin = cos_sin(self.scaled_inv_freq, self.attention_scaling, positions, dtype)
        return torch.stack((cos[:, :pairs], sin[:, :pairs]), dim=-1)

    # The transformer's hooks are bound methods, not closures: `copy.deepcopy` of the model then
    # gives hooks that call the copy's module.
    def pre_hook(self, transformer: nn.Module, args, kwargs) -> None:
        self.before_forward(inspect.signature(transformer.forward).bind_partial(*args, **kwargs).arguments)

    def hook(self, transformer: nn.Module, args, output) -> None:
        self.after_forward(output)

    def before_forward(self, inputs: dict) -> None:
        """Called by a pre-forward hook on the transformer with its bound arguments."""
        position_ids, input_ids = inputs.get("position_ids"), inputs.get("input_ids")
        if position_ids is not None:
            q_pos = position_ids if input_ids is None else position_ids.expand(input_ids.shape[0], -1)
        elif input_ids is not None:
            # The ChatGLM code takes the first seq_length rows when position_ids is None, cache or not.
            q_pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        else:
            if self.dynamic:
                raise ValueError("rope_ext: dynamic methods on ChatGLM need input_ids or position_ids")
            self.needed_length = 0
            return
        self.needed_length = int(q_pos.max()) + 1
        if not self.dynamic:
            return
        past = inputs.get("past_key_values")
        self.rotation.start(q_pos, _cache_object(past) if _has_entries(past) else None)

    def after_forward(self, output) -> None:
        """Called by a forward hook on the transformer: remember where the returned cache's keys sit."""
        cache = _returned_cache(output)
        if self.dynamic and cache is not None:
            self.rotation.finish(_cache_object(cache))

    def extra_repr(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"method={self.method.name}, factor={self.factor}, {params}, geometry={self.geometry}, position_ratio={self.position_ratio}"


class RotatingCoreAttention:
    """Stands in for one layer's `core_attention.forward` under a patch that rotates inside attention:
    `rotate` (the patch's RotateInAttention) rotates queries and (un-rotated, cached) keys with the
    frame's frequencies, per query group, then calls the original. Tensors come in the model's
    layout: [s, b, heads, hd] (sequence-first) or [b, heads, s, hd]."""

    def __init__(self, core: nn.Module, rotate: AttentionTransform, seq_first: bool):
        self.previous = core.__dict__.get("forward")  # an instance-level forward someone else set, if any
        self.inner = core.forward
        self.rotate = rotate
        self.seq_first = seq_first

    def __call__(self, query, key, value, attention_mask, *args, **kwargs):
        frame = self.rotate.rotator.frame
        if self.seq_first:  # -> [b, heads, s, hd], the layout RotateInAttention works in
            query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        batch, heads = query.shape[:2]
        if (batch, query.shape[2]) != tuple(frame.q_pos.shape):
            raise RuntimeError(
                f"rope_ext: core attention received a query of shape {tuple(query.shape)} for positions "
                f"{tuple(frame.q_pos.shape)}; this ChatGLM code does not use the layout read from its embedding"
            )
        if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4):
            raise RuntimeError(
                f"rope_ext: dynamic methods need a boolean [b, 1, q, k] attention mask, got {attention_mask.dtype} "
                f"of shape {tuple(attention_mask.shape)}"
            )

        def attend(module, q, k, v, mask):
            q_len = q.shape[2]
            if mask is not None and mask.dtype != torch.bool:
                mask = mask != 0  # RotateInAttention's additive causal mask -> ChatGLM's True = masked
            if self.seq_first:
                q, k, v = (t.permute(2, 0, 1, 3) for t in (q, k, v))
            context = self.inner(q, k, v, mask, *args, **kwargs)
            if self.seq_first:
                return context.reshape(q_len, batch, heads, -1).transpose(0, 1), None
            return context.reshape(batch, q_len, heads, -1), None

        out, _ = self.rotate(None, query, key, value, attention_mask, attend)  # [b, s, heads, hd]
        if self.seq_first:
            return out.transpose(0, 1).reshape(out.shape[1], batch, -1)
        return out.reshape(batch, out.shape[1], -1)


class ChatGLMFamily(FamilyAdapter):
    name = "chatglm"
    model_types = ("chatglm",)
    lora_targets = ("query_key_value", "dense")  # fused q/k/v and the output projection
    attention_interface = False  # the hub code calls its own core attention

    def site(self, hf_model: nn.Module) -> ChatGLMSite:
        config = hf_model.config
        transformer = getattr(hf_model, "transformer", None)
        if transformer is None and hasattr(hf_model, "encoder"):
            transformer = hf_model  # a bare ChatGLMModel
        if getattr(config, "position_encoding_2d", False) or (
            transformer is not None and hasattr(transformer, "layers") and not hasattr(transformer, "rotary_pos_emb")
        ):
            raise ValueError(V1_ERROR)
        rotary = getattr(transformer, "rotary_pos_emb", None)
        if not isinstance(rotary, nn.Module):
            found = (
                "no `transformer`"
                if transformer is None
                else f"{type(transformer).__name__} with children {[n for n, _ in transformer.named_children()]}"
            )
            raise ValueError(f"rope_ext cannot patch {type(hf_model).__name__}: found {found}; expected {EXPECTED}")
        return ChatGLMSite(hf_model, transformer, rotary)

    def read(self, model: nn.Module, original_window: int | None, saved: Patch | None) -> ModelReading:
        """The rotary convention read from the live module, its window and geometry, and the facts
        of the hub code's attention; the family ships no scaling a patch extends and states no
        served context."""
        site = self.site(model)
        original = self.original_record(site, original_window, saved)
        return ModelReading(
            site=site,
            original=original,
            geometry=self.geometry(site, original),
            facts=self.facts(site),
            layer_types=site.layer_types,
            shipped=Shipped(),
        )

    def original_record(self, site: ChatGLMSite, original_window: int | None, saved: Patch | None) -> dict:
        """The checkpoint's rotary convention, read from the live module (or kept by the current
        patch), and its window: seq_length unless `original_window` says otherwise, or for a model
        reloaded from a patched checkpoint the window of the patch `saved` its config records."""
        if (current := site.installed) is not None:
            record = copy.deepcopy(current.original)
        else:
            config = site.config
            record = read_convention(site.rotary, config, config.kv_channels)
            record["seq_length"] = config.seq_length
            record["original_window"] = saved.original_window if saved else config.seq_length
        if original_window is not None:
            record["original_window"] = original_window
        return record

    def geometry(self, site: ChatGLMSite, record: dict) -> RotaryGeometry:
        # `read_convention` already checked the live module against the record when it was made.
        head_dim = site.config.kv_channels
        return RotaryGeometry(
            rotary_dim=head_dim // 2,
            base=float(record["base"]),
            original_window=int(record["original_window"]),
            layout="interleaved",
            head_dim=head_dim,
        )

    def facts(self, site: ChatGLMSite) -> ModelFacts:
        config = site.config
        return ModelFacts(
            family=self.name,
            backend=getattr(config, "_attn_implementation", None) or "eager",
            num_heads=config.num_attention_heads,
            causal=True,
            attention_interface=self.attention_interface,
            static_only=self._static_only(site),
        )

    def build(self, reading: ModelReading, spec: Method, factor: float, params: dict):
        current = reading.site.installed
        original_module = current.original_module if current is not None else reading.site.rotary
        return ChatGLMRotaryEmbedding(spec, factor, params, reading.geometry, reading.original, original_module)

    def install(self, site: ChatGLMSite, rotary: ChatGLMRotaryEmbedding, chain: list, max_length: int) -> None:
        """Swap the module in and hook the transformer; no transformers-native equivalent exists.
        A `chain` is the rotation inside attention alone (methods that add transforms of their own
        need the AttentionInterface, which refusal checks): each layer's core attention runs it, in
        the tensor layout read from the embedding."""
        seq_first = self._sequence_first(site) if chain else None
        if site.installed is not None:
            self._detach(site)
        site.transformer.rotary_pos_emb = rotary
        site.rotary = rotary
        rotary._hooks = [
            site.transformer.register_forward_pre_hook(rotary.pre_hook, with_kwargs=True),
            site.transformer.register_forward_hook(rotary.hook),
        ]
        rotary._cores = []
        if chain:
            (rotate,) = chain
            rotary._cores = site.cores
            for core in rotary._cores:
                core.forward = RotatingCoreAttention(core, rotate, seq_first)
        return None

    def uninstall(self, site: ChatGLMSite) -> None:
        rotary = site.installed
        self._detach(site)
        original = rotary.original_module
        original.inv_freq = rotary.inv_freq  # carries any cast, move or load done while patched
        site.transformer.rotary_pos_emb = original
        site.rotary = original

    def _detach(self, site: ChatGLMSite) -> None:
        rotary = site.rotary
        for handle in getattr(rotary, "_hooks", []):
            handle.remove()
        rotary._hooks = []
        for core in getattr(rotary, "_cores", []):  # the cores install wrapped (a checkpoint may have none)
            wrapper = core.__dict__.get("forward")
            if isinstance(wrapper, RotatingCoreAttention):
                if wrapper.previous is None:
                    del core.forward
                else:
                    core.forward = wrapper.previous
        rotary._cores = []

    def _static_only(self, site: ChatGLMSite) -> str | None:
        """Why rope-ext cannot rotate queries and keys inside this model's core attention (what
        dynamic methods do), so that only static methods apply; None when it can."""
        config = site.config
        implementation = getattr(config, "_attn_implementation", None) or ""
        if implementation.startswith("flash"):
            return (
                f"remote-code ChatGLM's core attention is {implementation!r}, where that needs an eager or sdpa one "
                "(boolean masks): load it with attn_implementation='sdpa', or convert it to native GLM"
            )
        if getattr(config, "pre_seq_len", None):
            return "this ChatGLM model has P-tuning prefix keys (pre_seq_len), which rope-ext cannot track"
        try:
            site.cores
        except AttributeError as err:
            return (
                "this ChatGLM model has no core attention to wrap where rope-ext would expect "
                f"`transformer.encoder.layers[i].self_attention.core_attention`: {err}"
            )
        return None

    def _sequence_first(self, site: ChatGLMSite) -> bool:
        """Whether hidden states are [s, b, h] (ChatGLM2/3) or [b, s, h] (GLM-4), from the embedding."""
        embedding = site.transformer.embedding
        weight = next(embedding.parameters())
        with torch.no_grad():
            out = embedding(torch.zeros((1, 2), dtype=torch.long, device=weight.device))
        return tuple(out.shape[:2]) == (2, 1)
