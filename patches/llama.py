"""The LLaMA family on transformers 5: one model-level `rotary_emb` computing (cos, sin) for all
layers, pairs split in halves (`rotate_half`), the whole head rotated.

This adapter is also the base for every transformers-native family (GLM differs only in layout
and model types): it reads and writes `config.rope_parameters` and routes dynamic methods and
methods' attention transforms through the rope-ext attention wrapper."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from rope_ext import record as patch_record
from rope_ext.attention import AttentionChain, AttentionTransform, RotateInAttention, base_name, registered_name
from rope_ext.geometry import RotaryGeometry
from rope_ext.method.base import Method, ModelFacts, default_inv_freq
from rope_ext.rotary import ExtendedRotaryEmbedding

from .base import FamilyAdapter, unwrap

# transformers scaling types that record the pretraining window in rope_parameters
WINDOW_KEYED_TYPES = ("yarn", "llama3", "longrope")


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


class LlamaFamily(FamilyAdapter):
    name = "llama"
    model_types = ("llama", "mistral", "mixtral", "qwen2", "qwen3")
    layout = "half"
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention projections
    attention_interface = True

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
        saved = patch_record.read(config)  # reloaded from a patched checkpoint
        record = saved.original_values("rope_parameters", "max_position_embeddings") if saved else {
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
        elif stated_window := (getattr(config, "dual_chunk_attention_config", None) or {}).get("original_max_position_embeddings"):
            # Qwen2.5-1M: config.json states the pretraining window beside a dual chunk attention setup
            record["original_window"] = stated_window
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

    def facts(self, site: RotarySite) -> ModelFacts:
        config = site.config
        return ModelFacts(
            family=self.name,
            backend=base_name(config._attn_implementation or "eager"),
            num_heads=config.num_attention_heads,
            causal=all(getattr(module, "is_causal", True) for module in site.attention),
            attention_interface=self.attention_interface,
            config=config.to_dict(),
        )

    def build(self, site: RotarySite, spec: Method, factor: float, params: dict, geometry: RotaryGeometry, record: dict):
        current = self.installed(site)
        original_cls = current.original_cls if current is not None else type(site.rotary)
        return ExtendedRotaryEmbedding(spec, factor, params, geometry, original_cls, record, site.rotary.inv_freq.device)

    def native(self, rotary: ExtendedRotaryEmbedding) -> dict | None:
        """transformers `rope_parameters` that reproduce the patch on a plain reload, or None."""
        return rotary.method.native(rotary.geometry, rotary.factor, rotary.params, rotary.original["rope_parameters"])

    def install(self, site: RotarySite, rotary: ExtendedRotaryEmbedding, transforms: list, max_length: int) -> dict | None:
        """Swap the module in, route attention through the rope-ext chain where the patch needs it
        (dynamic methods; the method's transforms, such as alibi_hybrid's bias), write the config
        so that a plain reload reproduces the patch where transformers can. Returns the native
        parameters."""
        if self.installed(site) is not None:
            self._detach(site)
        site.decoder.rotary_emb = rotary
        site.rotary = rotary
        rotates = any(transform.rotates for transform in transforms)  # e.g. self_extend's grouped attention
        chain = ([RotateInAttention(rotary)] if rotary.dynamic and not rotates else []) + list(transforms)
        if chain:
            self._attach_attention(site, chain, rotary.method.name)
        config = site.config
        native = self.native(rotary)
        config.rope_parameters = native if native is not None else copy.deepcopy(rotary.original["rope_parameters"])
        if not rotary.method.keeps_config_window:
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

    def _attach_attention(self, site: RotarySite, transforms: list[AttentionTransform], method: str) -> None:
        """Route attention through the rope-ext wrapper of the current backend, running `transforms`
        in order, and let each add what it keeps on the model (hooks, parameters)."""
        config = site.config
        name = registered_name(base_name(config._attn_implementation or "eager"))
        chain = AttentionChain(transforms)
        for module in site.attention:
            module.rope_ext_attention = chain
        chain.attach(site, method)
        config._attn_implementation = name

    def _detach(self, site: RotarySite) -> None:
        """Undo `_attach_attention` (nothing to undo for static methods without transforms)."""
        chain = getattr(site.attention[0], "rope_ext_attention", None)
        if chain is not None:
            chain.detach(site)
        for module in site.attention:
            if hasattr(module, "rope_ext_attention"):
                del module.rope_ext_attention
        site.config._attn_implementation = site.rotary.original["attn_implementation"]
