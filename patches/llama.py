"""Every transformers-5 decoder whose rotary embedding rope-ext can prove it owns, LLaMA's layout
and its relatives: one rotary module computing (cos, sin) for all layers, applied by the attention
modules to the queries and keys they hand to transformers' AttentionInterface. The model type
plays no part: patches.probe runs the model and finds the rotary module, the cos/sin format, the
layers that rotate (NoPE layers are left alone), the pairing and the rotated channels, or refuses
the model with what it found and what is missing.

This adapter is also the base for GLM (patches/glm.py), which adds what its checkpoints' linear
scaling needs: it reads and writes `config.rope_parameters` and routes dynamic methods and
methods' attention transforms through the rope-ext attention wrapper."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from rope_ext.attention import AttentionChain, AttentionTransform, base_name, registered_name
from rope_ext.geometry import RotaryGeometry
from rope_ext.method.base import Method, ModelFacts, default_inv_freq, refusal
from rope_ext.method.stated import CONFIG_KEY, stated_sizes
from rope_ext.record import Patch, config_keys, config_values, restore, rope_parameters, served_parameters, write_native
from rope_ext.rotary import ExtendedRotaryEmbedding
from rope_ext.rotation import polar
from rope_ext.shipped import (
    EXTENDABLE,
    TEMPERATURE_SPLIT,
    WINDOW_KEYED,
    Shipped,
    ShippedScaling,
    native_longrope,
    served_context,
    shipped_of,
    with_shipped_base,
)

from .base import FamilyAdapter, ModelReading
from .probe import (
    ATTENTION_REFUSAL,
    PROBE_LENGTH,
    REASONS,
    Refused,
    Structure,
    attention_scaling,
    formatted,
    keys_at,
    probe,
    rotary_call,
    sub_config,
    typed,
)

# positions spread over a window, at which a native form is checked against the patch
PROBE_POSITIONS = 257


@dataclass
class RotarySite:
    """Where a model's rotary embedding lives and who uses it."""

    model: nn.Module  # the transformers PreTrainedModel (unwrapped)
    decoder: nn.Module  # the base model, whose forward takes the KV cache
    rotary: nn.Module
    attention: list[nn.Module]  # the attention modules that apply the rotation
    structure: Structure
    nope: list[nn.Module]  # attention modules the patch leaves alone: without RoPE, or of a layer type it keeps
    # the live rotary module was built from the values unpatch restores (not a reload of a patched checkpoint)
    fresh: bool = True

    @property
    def installed(self) -> ExtendedRotaryEmbedding | None:
        """The rope-ext rotary module installed here, or None."""
        return self.rotary if isinstance(self.rotary, ExtendedRotaryEmbedding) else None

    def swap_rotary(self, rotary: nn.Module) -> None:
        owner, _, name = self.structure.rotary.rpartition(".")
        setattr(self.model.get_submodule(owner), name, rotary)
        self.rotary = rotary

    @property
    def config(self):
        """The config the rotary module was built from: the model's, or a composite model's text
        config, where the patch reads and writes rope_parameters and its record (a save writes it
        inside the composite config.json, where transformers reloads it)."""
        return sub_config(self.model.config, self.structure.config)

    @property
    def layer_type(self) -> str | None:
        """The layer type whose frequencies the patch replaces, of a rotary module kept per layer type."""
        return self.structure.layer_type

    @property
    def layer_types(self) -> dict | None:
        """The layer types whose frequencies the patch replaces and keeps, of a rotary module kept per
        layer type or of several rotary modules (with the modules: the one replaced, those kept,
        those no layer uses); None for one set of frequencies."""
        structure = self.structure
        if not structure.layer_types:
            return None
        found = {"patched": list(structure.patched_types), "kept": list(structure.kept_types)}
        if structure.kept_rotary or structure.unused_rotary:
            found["rotary"] = {
                "patched": [structure.rotary],
                "kept": list(structure.kept_rotary),
                "unused": list(structure.unused_rotary),
            }
        return found

    def rope_entry(self, rope: dict) -> dict:
        """The rope_parameters of the patched layers: `rope`, its entry for the patched type, or, of
        one rotary module among several, `rope` with the base that module was built with."""
        if self.layer_type is not None:
            return rope[self.layer_type]
        if self.structure.rope_theta is not None:
            return {**rope, "rope_theta": self.structure.rope_theta}
        return rope


class ProbedRotaryEmbedding(ExtendedRotaryEmbedding):
    """The rope-ext rotary module in the cos/sin format the model's attention expects, with the
    structure the probe proved (a patched model is not probed again: its rotary module is ours).
    In place of a module kept per layer type, it answers the patched type and lets the model's own
    module (`kept`) answer the others. `restores` is the module it replaced, which unpatch puts
    back as it is, hooks and dtype included (a child, so that a cast or a move of the model reaches
    it too); None where that module was built from a patched checkpoint's config, and unpatch
    builds the model's own from the config the replaced module was built from, which the module
    carries (a model may read it: Granite-SWA keys each module's output by its config's base)."""

    def __init__(self, *args, structure: Structure, config, kept: nn.Module | None = None, restores: nn.Module | None = None):
        super().__init__(*args)
        self.structure = structure
        self.config = config
        self.kept = kept
        self.restores = restores

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        positions = self.text_positions(position_ids) if self.structure.axes else position_ids
        if self.structure.layer_type is not None:
            layer_type = args[0] if args else kwargs["layer_type"]
            if layer_type != self.structure.layer_type:
                return self.kept(x, position_ids, layer_type)
        if self.structure.cos_format == "complex":  # only static methods: facts.static_only refuses the others
            return polar(self.inv_freq, self.attention_scaling, positions)
        return formatted(*super().forward(x, positions), self.structure.cos_format)

    def text_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Of M-RoPE's per-axis positions [axes, B, S], the one row of text, where every axis holds
        the token's position (the probe proved the model's module is then RoPE); checked once per
        forward, as the model calls its rotary module once. Positions that differ between the axes
        (image or video tokens) rotate each axis's share of the frequencies by its own positions,
        which the patch does not compute: refused before any layer runs."""
        if position_ids.dim() < 3:
            return position_ids
        if not torch.equal(position_ids, position_ids[:1].expand_as(position_ids)):
            raise ValueError(
                f"rope_ext {self.method.name}: the positions of this forward differ between M-RoPE's "
                f"{position_ids.shape[0]} axes (image or video tokens); the patch is exact for text only, where the "
                "axes are equal. Run multimodal input on the unpatched model (rope_ext.unpatch)"
            )
        return position_ids[0]


def reads_back(config, native: dict, rotary: ExtendedRotaryEmbedding, max_length: int) -> bool:
    """Whether the model's own rotary class, built from a config holding `native` as transformers
    reloads it, gives the patch's (cos, sin) bit for bit at positions spread over the trained window
    and over the extended one (a call's longest position may choose its scaling, as PhiMoE's does),
    with every key of `native` read back as written. Some models read transformers' rope_parameters
    their own way (Phi-3's config turns a yarn type into longrope and puts its top-level
    original_max_position_embeddings over the written one; PhiMoE's rotary reads mscale keys yarn
    does not have): for them the native form would reload another model, so the patch writes none.
    For a dynamic method, whose rotation happens inside attention, the class must build and run
    from it."""
    layer_type = rotary.structure.layer_type
    written = copy.deepcopy(config)
    write_native(written, native, rotary.original, max_length, layer_type)
    device = rotary.inv_freq.device
    x = torch.zeros(1, device=device)
    spans = [
        torch.linspace(0, end - 1, PROBE_POSITIONS, device=device).round().long()
        for end in (min(max_length, rotary.geometry.original_window), max_length)
    ]
    # M-RoPE: called as the model calls it, every axis at the token's position (text)
    axes = rotary.structure.axes
    calls = [p[None].expand(axes, 1, -1) if axes else p[None] for p in spans]
    try:
        reloaded = type(written).from_dict(written.to_dict())
        twin = rotary.original_cls(reloaded).to(device)
        outputs = [tuple(rotary_call(module, x, positions, layer_type) for module in (twin, rotary)) for positions in calls]
    except Exception:  # a config the model's own class cannot read has no native form for it
        return False
    # The config class may rewrite what it reads (Phi-3's puts its top-level original_max_position_embeddings
    # over the written window, which moves longrope's switch): the form must read back as written.
    entry = reloaded.rope_parameters if layer_type is None else reloaded.rope_parameters[layer_type]
    if any(entry.get(key) != value for key, value in served_parameters(native).items()):
        return False
    if rotary.dynamic:  # the rotation happens inside attention, per forward: the module's output is not it
        return True
    return all(torch.equal(a, b) for theirs, ours in outputs for a, b in zip(theirs, ours))


# Config fields that declare attention over fewer keys than the sequence: a sliding window, a
# chunk (Llama 4's attention_chunk_size), the top-k of an indexer (DeepSeek-V3.2's index_topk;
# Qwen4-Exp's indexer_budget blocks of indexer_compress_ratio tokens). The probe's forward of a few
# tokens sits inside any of them; a patch meant for more tokens than one of them is proven past it
# (KeysShown).
HIDING_SIZES = {"attention_chunk_size": None, "index_topk": None, "indexer_budget": "indexer_compress_ratio"}


def hiding_sizes(config) -> dict[str, int]:
    """field -> tokens, for each size `config` declares among the fields its class declares (a
    field set on a config whose architecture has none is not read), and its `sliding_window` where
    a layer uses it (every layer, without `layer_types`)."""
    declared = {name for cls in type(config).__mro__ for name in getattr(cls, "__annotations__", {})}
    found = {}
    for key, unit in HIDING_SIZES.items():
        size = getattr(config, key, None) if key in declared else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            per = getattr(config, unit, None) if unit else None
            found[key] = size * (per or 1)
    window, layer_types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if isinstance(window, int) and window > 0 and (layer_types is None or "sliding_attention" in layer_types):
        found["sliding_window"] = window
    return found


class KeysShown:
    """What the model's attention hides from a query within a patch's length, shown by a forward:
    for every size below that length its config declares (hiding_sizes), a forward of the largest
    plus PROBE_LENGTH tokens (at most the length) records each call's mask (patches.probe.keys_at),
    once per length for both facts that read it (`hidden`, `sliding_window`)."""

    def __init__(self, site: RotarySite):
        self.site, self._seen = site, {}

    def _shown(self, length: int) -> tuple[dict, int, list | Refused]:
        """(the declared sizes below `length`, the forward's length, each call's keys or why the forward cannot run)."""
        sizes = {key: size for key, size in hiding_sizes(self.site.config).items() if size < length}
        if not sizes:
            return sizes, 0, []
        run = min(length, max(sizes.values()) + PROBE_LENGTH)
        if run not in self._seen:
            try:
                self._seen[run] = keys_at(self.site.model, run)
            except Refused as err:
                self._seen[run] = err
        return sizes, run, self._seen[run]

    def hidden(self, length: int) -> str | None:
        """What attention hides within `length` tokens besides later keys and its sliding window's
        (a chunk, a key selection, a window other than the config's), or None."""
        sizes, run, seen = self._shown(length)
        if not sizes:
            return None
        declared = ", ".join(f"{key} {size}" for key, size in sizes.items())
        if isinstance(seen, Refused):
            return f"at {run} tokens, past its config's {declared}, the forward that shows it cannot run: {seen}"
        window = sizes.get("sliding_window")
        hidden = [(name, keys) for name, keys in seen if keys is False or (keys is not None and keys != window)]
        if not hidden:
            return None
        name, keys = hidden[0]
        what = f"all but the last {keys} keys" if keys else "keys other than later ones or a sliding window's"
        return f"at {run} tokens, past its config's {declared}, `{name}` (and {len(hidden) - 1} other calls) hides {what}"

    def sliding_window(self, length: int) -> int | None:
        """The config's sliding window where it is below `length` and some layer attends through it
        (a config may carry the key for an architecture that never reads it, as a LLaMA's), or where
        the forward that would show it cannot run; None otherwise."""
        sizes, _, seen = self._shown(length)
        window = sizes.get("sliding_window")
        if window is None or isinstance(seen, Refused) or any(keys == window for _, keys in seen):
            return window
        return None


def softmax_scales(site: RotarySite, rope: dict) -> list[float | None]:
    """Each attention module's softmax `scaling` as its class sets it at construction from the
    model's config holding `rope`, for the modules that keep one and whose class builds from the
    config (on the meta device: no weights); None for the others, which keep their own value.
    DeepSeek's MLA attention multiplies it by YaRN's mscale of the config's factor and
    `mscale_all_dim`, so it follows the rope parameters; for the others it is the head size's alone."""
    config = copy.deepcopy(site.config)
    config.rope_parameters = rope
    scales = []
    for module in site.attention + site.nope:
        built = None
        if isinstance(getattr(module, "scaling", None), float):
            try:
                with torch.device("meta"):
                    built = type(module)(config, getattr(module, "layer_idx", 0)).scaling
            except Exception:  # a class that does not build from (config, layer_idx) keeps its own value
                pass
        scales.append(built if isinstance(built, float) else None)
    return scales


def set_softmax_scales(site: RotarySite, rope: dict) -> None:
    """Set each attention module's softmax `scaling` to what its class sets from `rope` (softmax_scales)."""
    for module, scale in zip(site.attention + site.nope, softmax_scales(site, rope)):
        if scale is not None:
            module.scaling = scale


def fixed_split(site: RotarySite, record: dict, rope: dict) -> tuple[str, ...]:
    """The keys of DeepSeek's temperature split that the shipped scaling of the pre-patch values
    `record` (its patched layers' flat entry `rope`) states and fixes for an extension of it: where
    the split moves the softmax scale (ministral3 states one its attention does not read)."""
    stated = tuple(key for key in TEMPERATURE_SPLIT if rope.get(key) is not None)
    unscaled = rope_parameters(record["rope_parameters"], {"rope_type": "default"}, site.layer_type)
    if stated and softmax_scales(site, record["rope_parameters"]) != softmax_scales(site, unscaled):
        return stated
    return ()


def shipped_scaling(site: RotarySite, record: dict, original_cls: type) -> ShippedScaling | None:
    """The scaling the checkpoint ships, read from its own rotary class built from the pre-patch
    config values `record` (what the model computed before any patch, whatever dtype it was cast
    to since), for a record whose base is the shipped scaling; None for a base of trained frequencies."""
    base = record.get("starts_from") or {}
    if base.get("scaling") is None:
        return None
    config = copy.deepcopy(site.config)
    restore(config, record)
    rotary = original_cls(config)
    layer_type = site.layer_type
    return ShippedScaling(
        inv_freq=tuple(getattr(rotary, typed("inv_freq", layer_type)).float().tolist()),
        attention_factor=attention_scaling(rotary, layer_type),
    )


def window_of(config, record: dict, rope: dict, stated: int | None) -> dict:
    """The trained window of a checkpoint with the pre-patch values `record` (its flat
    rope_parameters `rope`, their `stated` pretraining window) and where it comes from, for a
    patch given no original_window=: {"original_window": ..., "starts_from": ...}."""
    rope_type = rope.get("rope_type", "default")
    if stated_window := stated_sizes(getattr(config, CONFIG_KEY, None)).get("original_max_position_embeddings"):
        # Qwen2.5-1M: config.json states the pretraining window beside a dual chunk attention setup
        source = {"scaling": None, "source": f"{CONFIG_KEY}.original_max_position_embeddings"}
        return {"original_window": stated_window, "starts_from": source}
    if rope_type == "default":
        source = {"scaling": None, "source": "max_position_embeddings"}
        return {"original_window": record["max_position_embeddings"], "starts_from": source}
    if rope_type in EXTENDABLE:
        source = {"scaling": rope_type, "source": "the shipped scaling"}
        return {"original_window": served_context(rope, record["max_position_embeddings"]), "starts_from": source}
    if stated is not None:
        raise ValueError(
            f"this checkpoint ships a {rope_type!r} RoPE scaling, which changes its frequencies at its pretraining "
            f"window ({stated} tokens), so no patch can extend it unchanged on both sides; pass original_window={stated} "
            f"to replace it by the method over that window (with a factor that reaches the "
            f"{record['max_position_embeddings']} tokens it serves)"
        )
    raise ValueError(
        f"this checkpoint already carries a {rope_type!r} RoPE scaling and does not record the window "
        "it was pretrained with; pass original_window=<tokens> so the new factor has a meaning"
    )


class PassThrough(AttentionTransform):
    """The attention of a layer without RoPE under a patch: the backend, unchanged."""

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        return attend(module, query, key, value, attention_mask, **kwargs)


class LlamaFamily(FamilyAdapter):
    name = "llama"
    model_types = ("any transformers decoder whose rotary embedding the probe proves (patches/probe.py)",)
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention projections
    attention_interface = True

    def site(self, hf_model: nn.Module) -> RotarySite:
        installed = next((m for m in hf_model.modules() if isinstance(m, ProbedRotaryEmbedding)), None)
        try:
            structure = installed.structure if installed is not None else probe(hf_model)
        except Refused as err:
            model_type = getattr(hf_model.config, "model_type", None)
            raise ValueError(f"rope_ext cannot patch {type(hf_model).__name__} (model_type={model_type!r}): {err}") from None
        return RotarySite(
            hf_model,
            hf_model.base_model,
            hf_model.get_submodule(structure.rotary),
            [hf_model.get_submodule(name) for name in structure.rope_attention],
            structure,
            [hf_model.get_submodule(name) for name in structure.nope_attention],
        )

    def read(self, model: nn.Module, original_window: int | None, saved: Patch | None) -> ModelReading:
        """The probe's structure (or the installed patch's), the pre-patch values and the window a
        patch starts from, the geometry (checked against the live module where it was built from
        those values), what the probe proved and the config states, and the shipped scaling."""
        site = self.site(model)
        original, built_from_original = self.original_record(site, original_window, saved)
        rope = site.rope_entry(original["rope_parameters"])
        return ModelReading(
            site=site,
            original=original,
            geometry=self.geometry(site, original, verify=built_from_original),
            facts=self.facts(site),
            layer_types=site.layer_types,
            shipped=Shipped(
                rope=rope,
                scaling=(scaling := (original.get("starts_from") or {}).get("scaling")),
                fixed=fixed_split(site, original, rope) if scaling is not None else (),
                served=served_context(rope, original["max_position_embeddings"]),
            ),
        )

    def original_record(self, site: RotarySite, original_window: int | None, saved: Patch | None) -> tuple[dict, bool]:
        """The pre-patch config values (what unpatch restores, what geometry is read from) and
        whether the live rotary module was built from them; for a model reloaded from a patched
        checkpoint, those of the patch `saved` its config records.

        The window the factor multiplies, and the base the method scales (`record["starts_from"]`):
        `original_window=` replaces the shipped scaling by the method over the trained frequencies
        at that (pretraining) window; without it, a checkpoint that ships a llama3, yarn or linear
        scaling is extended from that scaling at the context it serves (rope_ext.shipped), and one
        without a scaling from max_position_embeddings, unless a field states the window."""
        if (current := site.installed) is not None:
            record = copy.deepcopy(current.original)
            if original_window is not None:
                record["original_window"] = original_window
                record.pop("starts_from", None)
            return record, False
        config = site.config
        site.fresh = saved is None
        if saved:
            record = saved.original_values("rope_parameters", "max_position_embeddings", layer_type=site.layer_type)
        else:
            record = config_values(config)
        rope = site.rope_entry(record["rope_parameters"])
        rope_type = rope.get("rope_type", "default")
        stated = rope.get("original_max_position_embeddings") if rope_type in WINDOW_KEYED else None
        if original_window is not None:
            if stated is not None and stated != original_window:
                raise ValueError(
                    f"original_window={original_window} contradicts the checkpoint's {rope_type} scaling, whose "
                    f"original_max_position_embeddings is {stated}; leave original_window out to extend the shipped model"
                )
            record["original_window"] = original_window
        elif "original_window" not in record:
            record.update(window_of(config, record, rope, stated))
        elif "starts_from" in record and (derived := window_of(config, record, rope, stated)) != {
            key: record[key] for key in ("original_window", "starts_from")
        }:
            # a window the record derived (not one original_window= gave) is derived again from its values
            raise ValueError(
                f"{saved.source}: key rope_ext.original.original_window is {record['original_window']!r} from "
                f"{record['starts_from']}, but the record's own values give {derived['original_window']!r} from "
                f"{derived['starts_from']}: the record was edited after the save; put back the value it was saved with"
            )
        return record, not saved

    def geometry(self, site: RotarySite, record: dict, verify: bool) -> RotaryGeometry:
        """Geometry before any scaling, from `record`; with `verify`, checked against the live
        rotary module (which was then built from the same values)."""
        rope = site.rope_entry(record["rope_parameters"])
        geometry = RotaryGeometry(
            rotary_dim=site.structure.rotary_dim,
            base=float(rope["rope_theta"]),
            original_window=int(record["original_window"]),
            layout=site.structure.layout,
            head_dim=site.structure.head_dim,
            channels=site.structure.channels,
        )
        if verify and rope.get("rope_type", "default") == "default":
            # Compared in the dtype the buffer has: a cast of the model (`model.half()`) is no
            # modification, and the patch computes its own fp32 frequencies anyway.
            live = getattr(site.rotary, typed("original_inv_freq", site.layer_type)).cpu()
            if not torch.equal(live, default_inv_freq(geometry).to(live.dtype)):
                # a modified model, or a partial rotation transformers rounds to an odd number of
                # channels (its exponents then run over that odd size, which no geometry states)
                raise Refused(
                    "frequencies",
                    f"rope_theta={geometry.base}, rotary dim {geometry.rotary_dim}; refusing to patch a modified model",
                )
        return geometry

    def facts(self, site: RotarySite) -> ModelFacts:
        """What the probe proved of the model (`site.structure`) and what its config states, as
        the reasons a method may not run on it (rope_ext.method.base.refusal decides)."""
        config = site.config
        structure = site.structure
        elsewhere = ", ".join(f"`{name}`" for name in structure.rotation_elsewhere)
        shown = KeysShown(site)
        return ModelFacts(
            family=self.name,
            backend=base_name(config._attn_implementation or "eager"),
            num_heads=config.num_attention_heads,
            causal=all(getattr(module, "is_causal", True) for module in site.attention + site.nope),
            attention_interface=self.attention_interface,
            config=config.to_dict(),
            static_only=f"{REASONS['rotation']}: {structure.static_only}" if structure.static_only else None,
            not_plain_attention=None if structure.plain_attention else ATTENTION_REFUSAL,
            rotation_elsewhere=f"{REASONS['rotation-elsewhere']}: {elsewhere}" if elsewhere else None,
            keys_hidden=shown.hidden,
            sliding_window=shown.sliding_window,
        )

    def build(self, reading: ModelReading, spec: Method, factor: float, params: dict):
        site, geometry, record = reading.site, reading.geometry, reading.original
        current = site.installed
        original_cls = current.original_cls if current is not None else type(site.rotary)
        if current is not None:
            kept, restores, device = current.kept, current.restores, current.inv_freq.device
        else:
            kept = site.rotary if site.layer_type is not None else None
            restores = site.rotary if site.fresh else None
            device = getattr(site.rotary, typed("inv_freq", site.layer_type)).device
        config = getattr(site.rotary, "config", site.config)
        spec = with_shipped_base(spec, shipped_scaling(site, record, original_cls))
        return ProbedRotaryEmbedding(
            spec,
            factor,
            params,
            geometry,
            original_cls,
            record,
            device,
            structure=site.structure,
            config=config,
            kept=kept,
            restores=restores,
        )

    def native(self, rotary: ExtendedRotaryEmbedding) -> dict | None:
        """transformers `rope_parameters` that reproduce the patch on a plain reload (of the patched
        layer type's entry, where they are nested by layer type), or None. Of several rotary modules
        built from one `rope_parameters` (Granite-SWA), a scaling written there reaches the kept
        ones too: no native form while the patch keeps one."""
        if rotary.structure.kept_rotary:
            return None
        rope = rotary.original["rope_parameters"]
        layer_type = rotary.structure.layer_type
        rope = rope if layer_type is None else rope[layer_type]
        if shipped_of(rotary.method) is not None:
            # over a shipped scaling: the composed frequencies, where the method is a frequency
            # change alone (a static one without attention transforms)
            if rotary.dynamic or rotary.method.needs_attention_interface:
                return None
            max_length = math.ceil(rotary.geometry.original_window * rotary.factor)
            return native_longrope(rotary.geometry, rotary.inv_freq, rotary.attention_scaling, max_length, rope)
        return rotary.method.native(rotary.geometry, rotary.factor, rotary.params, rope)

    def install(self, site: RotarySite, rotary: ExtendedRotaryEmbedding, chain: list, max_length: int) -> dict | None:
        """Swap the module in, route attention through the rope-ext `chain` where the patch has one
        (the rotation inside attention of a dynamic method, a method's transforms such as
        alibi_hybrid's bias), write the config so that a plain reload reproduces the patch where
        transformers can. Returns the native parameters. Whether the method runs on this model was
        decided before (`facts`, rope_ext.method.base.refusal): this installs only."""
        if (current := site.installed) is not None:
            current.retire_caches()
            self._detach(site)
        native, softmax = self.written(site, rotary, max_length)
        site.swap_rotary(rotary)
        if chain:
            self._attach_attention(site, chain, rotary.method.name)
        # Written either way, so that a repatch writes what a first patch does.
        write_native(site.config, native, rotary.original, max_length, site.layer_type)
        set_softmax_scales(site, softmax)
        return native

    def written(self, site: RotarySite, rotary: ExtendedRotaryEmbedding, max_length: int) -> tuple[dict | None, dict]:
        """What installing `rotary` writes, decided before anything changes: the native form (None
        where no transformers rope_parameters reload the patch exactly) and the rope_parameters the
        attention modules' softmax scale is built from."""
        native = self.native(rotary)
        if native is not None and not reads_back(site.config, native, rotary, max_length):
            native = None
        original = rotary.original["rope_parameters"]
        if shipped_of(rotary.method) is not None:
            # The softmax scale is the shipped model's (DeepSeek's mscale_all_dim temperature reaches
            # every channel of q.k): a native form must rebuild it, or there is none.
            if native is not None:
                written = rope_parameters(original, served_parameters(native), site.layer_type)
                if softmax_scales(site, written) != softmax_scales(site, original):
                    native = None
            return native, original
        if native is not None:
            # The softmax scale follows the rope parameters the patch rotates by, as transformers
            # builds it from them: the native form, or without one the trained frequencies (the
            # checkpoint's scaling, its mscale included, is replaced, as its frequencies are).
            return native, rope_parameters(original, served_parameters(native), site.layer_type)
        return None, rope_parameters(original, {"rope_type": "default"}, site.layer_type)

    def config_written(self, site: RotarySite, rotary: ExtendedRotaryEmbedding, max_length: int) -> dict:
        native, _ = self.written(site, rotary, max_length)
        config = copy.deepcopy(site.config)
        write_native(config, native, rotary.original, max_length, site.layer_type)
        return {key: getattr(config, key) for key in config_keys(rotary.original)}

    def uninstall(self, site: RotarySite) -> None:
        rotary = site.installed
        rotary.retire_caches()
        self._detach(site)
        restore(site.config, rotary.original)
        set_softmax_scales(site, site.config.rope_parameters)
        restored = rotary.restores
        if restored is None:
            restored = rotary.original_cls(rotary.config).to(rotary.inv_freq.device)
        site.swap_rotary(restored)

    def _attach_attention(self, site: RotarySite, transforms: list[AttentionTransform], method: str) -> None:
        """Route attention through the rope-ext wrapper of the current backend, running `transforms`
        in order, and let each add what it keeps on the model (hooks, parameters)."""
        config = site.config
        name = registered_name(base_name(config._attn_implementation or "eager"))
        chain = AttentionChain(transforms)
        for module in site.attention:
            module.rope_ext_attention = chain
        for module in site.nope:
            module.rope_ext_attention = AttentionChain([PassThrough()])
        chain.attach(site, method)
        config._attn_implementation = name
        for owner in self._owners(site):
            owner.set_attn_implementation = BackendSwitch(self, site.model, owner)

    def _detach(self, site: RotarySite) -> None:
        """Undo `_attach_attention` (nothing to undo for static methods without transforms); the
        backend stays the one chosen last, at patch time or by `set_attn_implementation` since."""
        chain = getattr(site.attention[0], "rope_ext_attention", None)
        if chain is None:
            return
        chain.detach(site)
        for module in site.attention + site.nope:
            del module.rope_ext_attention
        for owner in self._owners(site):
            owner.__dict__.pop("set_attn_implementation", None)
        site.config._attn_implementation = base_name(site.config._attn_implementation)

    @staticmethod
    def _owners(site: RotarySite) -> list[nn.Module]:
        """The models that share the patched config and answer `set_attn_implementation`: the
        causal LM and its decoder."""
        return list(dict.fromkeys((site.model, site.decoder)))

    def switch_backend(self, site: RotarySite, routed: str) -> None:
        """After transformers set a new backend on a model whose attention ran through the wrapper
        `routed`: route it through the wrapper of the new one, or, when the method cannot run
        there, put `routed` back and raise ValueError."""
        config = site.config
        chosen = base_name(config._attn_implementation or "eager")
        rotary = site.installed
        try:
            # patch() proved at its length which keys the model's attention sees; every backend
            # computes that same attention, so the proof stands and its forward is not run again
            facts = replace(self.facts(site), keys_hidden=None, sliding_window=None)
            rotary.method.resolve(facts, rotary.geometry, rotary.factor, rotary.params)
            if (refused := refusal(rotary.method, facts, math.ceil(rotary.geometry.original_window * rotary.factor))) is not None:
                raise ValueError(refused)
            name = registered_name(chosen)
        except ValueError as err:
            config._attn_implementation = routed
            raise ValueError(f"attention stays {base_name(routed)!r} under the rope_ext patch: {err}") from None
        config._attn_implementation = name


class BackendSwitch:
    """Stands in for `set_attn_implementation` on a model whose attention runs through the rope-ext
    wrapper: transformers checks and sets the requested backend as usual, then the adapter routes
    the wrapper to it (a plain switch would leave the patch's attention behind). An object, not a
    closure, so that `copy.deepcopy` of the model gives one that switches the copy."""

    def __init__(self, adapter: LlamaFamily, model: nn.Module, owner: nn.Module):
        self.adapter, self.model, self.owner = adapter, model, owner

    def __call__(self, attn_implementation, *args, **kwargs) -> None:
        site = self.adapter.site(self.model)
        routed = site.config._attn_implementation
        type(self.owner).set_attn_implementation(self.owner, attn_implementation, *args, **kwargs)
        self.adapter.switch_backend(site, routed)
