"""The contract every model-family adapter meets. `rope_ext.patching` asks an adapter to read the
model (one call, one `ModelReading`), to build the rotary module of a patch and to install it,
and `unpatch` to take it out: a new family is one module here, checked against `FamilyAdapter`,
plus one entry in rope_ext.patches.NAMED."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import nn

from rope_ext.geometry import RotaryGeometry
from rope_ext.method.base import Method, ModelFacts
from rope_ext.record import Patch
from rope_ext.shipped import Shipped


@dataclass(frozen=True)
class ModelReading:
    """What a model is, as its family's adapter reads it before a patch: everything the patch
    decides from, read once, nothing changed."""

    site: object  # the adapter's own: where the rotary lives (`config`, `installed` and what it needs to find again)
    original: dict  # the pre-patch values: what unpatch restores, what the geometry is read from
    geometry: RotaryGeometry  # of the rotary before any scaling
    facts: ModelFacts  # what rope_ext.method.base.refusal checks a method against, and what its resolve reads
    layer_types: dict | None  # the layer types the patch replaces and keeps; None: one set of frequencies
    shipped: Shipped  # the checkpoint's own scaling: the parameters it fixes or gives, the context it serves


class FamilyAdapter(ABC):
    """Where a family keeps its rotary embedding and how to swap it.

    `site` objects are the adapter's own: what it needs to find again (the model, the rotary
    module, the modules that use it), with the `config` the patch reads and writes, the
    `installed` rope-ext rotary module (None when unpatched) and the `layer_types` a patch there
    replaces and keeps (None: one set of frequencies). Capabilities are class attributes:
    `lora_targets`, the module names a LoRA adapter targets by default; `attention_interface`,
    whether attention runs through transformers' AttentionInterface (what methods with attention
    transforms need)."""

    name: str
    model_types: tuple[str, ...]
    lora_targets: tuple[str, ...]
    attention_interface: bool

    @abstractmethod
    def site(self, model: nn.Module):
        """Where the rotary embedding of `model` (a transformers model, unwrapped) lives; ValueError
        when it is not where the family keeps it."""

    @abstractmethod
    def read(self, model: nn.Module, original_window: int | None, saved: Patch | None) -> ModelReading:
        """What `model` (unwrapped) is, for a patch over `original_window` (None: the window the
        checkpoint states or serves): ValueError, changing nothing, where rope-ext cannot patch it.
        `saved` is the patch the model's config records (rope_ext.record.read, by the
        orchestration), or None: a model reloaded from a patched checkpoint takes its pre-patch
        values from there."""

    @abstractmethod
    def build(self, reading: ModelReading, method: Method, factor: float, params: dict) -> nn.Module:
        """The rotary module for this patch, not yet installed (may raise, changing nothing)."""

    @abstractmethod
    def install(self, site, rotary: nn.Module, chain: list, max_length: int) -> dict | None:
        """Swap `rotary` in, run the attention `chain` (rope_ext.attention transforms; empty: none)
        inside attention, write the config; return the transformers `rope_parameters` that
        reproduce the patch on a plain reload, or None. What the chain is was decided with what was
        built: install decides nothing about the method."""

    def config_written(self, site, rotary: nn.Module, max_length: int) -> dict:
        """The config values installing `rotary` writes (key -> value), decided before anything
        changes: what the config.json of a checkpoint saved under that patch states. {}: the
        family writes none."""
        return {}

    @abstractmethod
    def uninstall(self, site) -> None:
        """Put back the rotary module, config values and attention the model had before the patch."""
