"""The LLaMA family on transformers 5: one model-level `rotary_emb` computing (cos, sin) for all
layers, pairs split in halves (`rotate_half`), the whole head rotated.

This adapter is also the base for every transformers-native family (GLM differs only in layout
and model types): it reads and writes `config.rope_parameters` and routes dynamic methods through
the rope-ext attention wrapper."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from rope_ext.attention import AttentionChain, AttentionTransform, RotateInAttention, base_name, registered_name
from rope_ext.geometry import RotaryGeometry
from rope_ext.scaling import Method, default_inv_freq, ntk_base
from rope_ext.rotary import ExtendedRotaryEmbedding

# transformers scaling types that record the pretraining window in rope_parameters
WINDOW_KEYED_TYPES = ("yarn", "llama3", "longrope")


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@dataclass
class RotarySite:
    """Where a model's rotary embedding lives and who uses it."""

    model: nn.Module  # the transformers PreTrainedModel (unwrapped)
    decoder: nn.Module  # the module whose forward calls the rotary module
    rotary: nn.Module
    attention: list[nn.Module]

    @property
    def config(self):
        return self.model.config


def native_rope_parameters(method: str, geometry: RotaryGeometry, factor: float, params: dict, rope: dict) -> dict | None:
    """transformers `rope_parameters` that reproduce the method on a plain reload, or None."""
    base = {"rope_theta": geometry.base, **{k: v for k, v in rope.items() if k == "partial_rotary_factor"}}
    window = {"original_max_position_embeddings": geometry.original_window}
    yarn = {k: params.get(k) for k in ("beta_fast", "beta_slow", "truncate")}
    if method == "linear":
        return {"rope_type": "linear", "factor": factor, **base}
    if method == "ntk":
        return {"rope_type": "default", **base, "rope_theta": ntk_base(geometry, factor)}
    if method == "dynamic":
        # exact for causal=False; transformers has no per-token schedule (rope_ext.from_pretrained restores it)
        return {"rope_type": "dynamic", "factor": factor, **base}
    if method == "yarn":
        temperature = {} if params["attention_factor"] is None else {"attention_factor": params["attention_factor"]}
        return {"rope_type": "yarn", "factor": factor, **base, **window, **yarn, **temperature}
    if method == "ntk_by_parts":
        return {"rope_type": "yarn", "factor": factor, **base, **window, **yarn, "attention_factor": 1.0}
    if method == "llama3":
        return {"rope_type": "llama3", "factor": factor, **base, **window, **params}
    return None


class LlamaFamily:
    name = "llama"
    model_types = ("llama", "mistral", "mixtral", "qwen2", "qwen3")
    layout = "half"

    def matches(self, model: nn.Module) -> bool:
        config = getattr(unwrap(model), "config", None)
        return getattr(config, "model_type", None) in self.model_types

    def site(self, model: nn.Module) -> RotarySite:
        hf_model = unwrap(model)
        decoder = hf_model.base_model
        rotary = getattr(decoder, "rotary_emb", None)
        if rotary is None or not hasattr(rotary, "inv_freq"):
            raise ValueError(
                f"{type(hf_model).__name__} has no model-level rotary embedding (`{type(decoder).__name__}.rotary_emb`)"
            )
        return RotarySite(hf_model, decoder, rotary, [layer.self_attn for layer in decoder.layers])

    def installed(self, site: RotarySite) -> ExtendedRotaryEmbedding | None:
        return site.rotary if isinstance(site.rotary, ExtendedRotaryEmbedding) else None

    def original_record(self, site: RotarySite, original_window: int | None) -> tuple[dict, bool]:
        """The pre-patch config values (what unpatch restores, what geometry is read from) and
        whether the live rotary module was built from them."""
        if (current := self.installed(site)) is not None:
            record = copy.deepcopy(current.original)
            if original_window is not None:
                record["original_window"] = original_window
            return record, False
        config = site.config
        saved = getattr(config, "rope_ext", None)  # reloaded from a patched checkpoint
        record = copy.deepcopy(saved["original"]) if saved else {
            "rope_parameters": copy.deepcopy(config.rope_parameters),
            "max_position_embeddings": config.max_position_embeddings,
        }
        record["attn_implementation"] = config._attn_implementation
        rope = record["rope_parameters"]
        rope_type = rope.get("rope_type", "default")
        if original_window is not None:
            record["original_window"] = original_window
        elif "original_window" in record:
            pass
        elif rope_type == "default":
            record["original_window"] = record["max_position_embeddings"]
        elif rope_type in WINDOW_KEYED_TYPES and "original_max_position_embeddings" in rope:
            record["original_window"] = rope["original_max_position_embeddings"]
        else:
            raise ValueError(
                f"this checkpoint already carries a {rope_type!r} RoPE scaling and does not record the window "
                "it was pretrained with; pass original_window=<tokens> so the new factor has a meaning"
            )
        return record, not saved

    def geometry(self, site: RotarySite, record: dict, verify: bool) -> RotaryGeometry:
        """Geometry before any scaling, from `record`; with `verify`, checked against the live
        rotary module (which was then built from the same values)."""
        rope = record["rope_parameters"]
        config = site.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        geometry = RotaryGeometry(
            rotary_dim=2 * site.rotary.inv_freq.numel(),
            base=float(rope["rope_theta"]),
            original_window=int(record["original_window"]),
            layout=self.layout,
            head_dim=head_dim,
        )
        if verify and rope.get("rope_type", "default") == "default":
            live = site.rotary.original_inv_freq.float().cpu()
            if not torch.equal(live, default_inv_freq(geometry)):
                raise ValueError(
                    "the model's rotary module does not hold the frequencies its config describes "
                    f"(rope_theta={geometry.base}, rotary dim {geometry.rotary_dim}); refusing to patch a modified model"
                )
        return geometry

    def build(self, site: RotarySite, spec: Method, factor: float, params: dict, geometry: RotaryGeometry, record: dict):
        current = self.installed(site)
        original_cls = current.original_cls if current is not None else type(site.rotary)
        return ExtendedRotaryEmbedding(spec, factor, params, geometry, original_cls, record, site.rotary.inv_freq.device)

    def install(self, site: RotarySite, rotary: ExtendedRotaryEmbedding, max_length: int) -> dict | None:
        """Swap the module in, route attention through the rope-ext chain where the patch needs it
        (dynamic methods; transforms the method adds, such as alibi_hybrid's bias), write the config
        so that a plain reload reproduces the patch where transformers can. Returns the native
        parameters."""
        if self.installed(site) is not None:
            self._detach(site)
        site.decoder.rotary_emb = rotary
        site.rotary = rotary
        # `attention_transforms` is set by patch() for methods that change attention beyond the rotation.
        added = getattr(rotary, "attention_transforms", ())
        rotates = any(transform.rotates for transform in added)  # e.g. self_extend's grouped attention
        chain = ([RotateInAttention(rotary)] if rotary.dynamic and not rotates else []) + list(added)
        if chain:
            self._attach_attention(site, chain)
        record, config = rotary.original, site.config
        native = native_rope_parameters(rotary.method.name, rotary.geometry, rotary.factor, rotary.params, record["rope_parameters"])
        config.rope_parameters = native if native is not None else copy.deepcopy(record["rope_parameters"])
        # transformers' `dynamic` reads max_position_embeddings as the original window, and
        # `dynamic_yarn` and `self_extend` have no native form (a plain reload is the unscaled
        # model): all keep it.
        if rotary.method.name not in ("dynamic", "dynamic_yarn", "self_extend"):
            config.max_position_embeddings = max_length
        return native

    def uninstall(self, site: RotarySite) -> None:
        rotary = self.installed(site)
        self._detach(site)
        config = site.config
        config.rope_parameters = copy.deepcopy(rotary.original["rope_parameters"])
        config.max_position_embeddings = rotary.original["max_position_embeddings"]
        restored = rotary.original_cls(config).to(rotary.inv_freq.device)
        site.decoder.rotary_emb = restored
        site.rotary = restored

    def _attach_attention(self, site: RotarySite, transforms: list[AttentionTransform]) -> None:
        """Route attention through the rope-ext wrapper of the current backend, running `transforms`
        in order, and let each add what it keeps on the model (hooks, parameters)."""
        config = site.config
        name = registered_name(base_name(config._attn_implementation or "eager"))
        chain = AttentionChain(transforms)
        for module in site.attention:
            module.rope_ext_attention = chain
        for transform in chain.transforms:
            transform.attach(site)
        config._attn_implementation = name

    def _detach(self, site: RotarySite) -> None:
        """Undo `_attach_attention` (nothing to undo for static methods without transforms)."""
        chain = getattr(site.attention[0], "rope_ext_attention", None)
        for transform in chain.transforms if chain is not None else ():
            transform.detach(site)
        for module in site.attention:
            if hasattr(module, "rope_ext_attention"):
                del module.rope_ext_attention
        site.config._attn_implementation = site.rotary.original["attn_implementation"]
