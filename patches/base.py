"""The contract every model-family adapter meets. `rope_ext.patching` asks an adapter these
questions and nothing else, so a new family is one module here, checked against `FamilyAdapter`,
plus one entry in rope_ext.patches.ADAPTERS."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn

from rope_ext.geometry import RotaryGeometry
from rope_ext.method.base import Method, ModelFacts
from rope_ext.record import Patch


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under torch.compile's wrapper and a peft wrapper (or the model itself):
    the patch goes to the model the wrappers call."""
    model = getattr(model, "_orig_mod", model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class FamilyAdapter(ABC):
    """Where a family keeps its rotary embedding and how to swap it.

    `site` objects are the adapter's own: what it needs to find again (the model, the rotary
    module, the modules that use it). Capabilities are class attributes: `lora_targets`, the
    module names a LoRA adapter targets by default; `attention_interface`, whether attention runs
    through transformers' AttentionInterface (what methods with attention transforms need)."""

    name: str
    model_types: tuple[str, ...]
    lora_targets: tuple[str, ...]
    attention_interface: bool

    def matches(self, model: nn.Module) -> bool:
        config = getattr(unwrap(model), "config", None)
        return getattr(config, "model_type", None) in self.model_types

    @abstractmethod
    def site(self, model: nn.Module):
        """Where this model's rotary embedding lives; ValueError when it is not where the family keeps it."""

    @abstractmethod
    def installed(self, site) -> nn.Module | None:
        """The rope-ext rotary module installed at `site`, or None."""

    @abstractmethod
    def original_record(self, site, original_window: int | None, saved: Patch | None) -> tuple[dict, bool]:
        """The pre-patch values (what unpatch restores, what the geometry is read from) and
        whether the live rotary module was built from them. `saved` is the patch the model's
        config records (rope_ext.record.read, by the orchestration), or None: a model reloaded
        from a patched checkpoint takes its values from there."""

    def shipped_params(self, site, record: dict, method: Method, given: dict) -> dict:
        """The parameters of `method` that the checkpoint's own scaling states, for a patch that
        replaces that scaling by a method of its type (`record` from `original_record`); the ones
        in `given` are the user's. {}: none. ValueError, before anything changes, for a parameter in
        `given` that a patch extending the shipped scaling cannot take, since that scaling fixes it."""
        return {}

    def served_context(self, site, record: dict) -> int | None:
        """How many tokens the checkpoint serves as loaded (a patch meant for fewer is refused
        unless asked for); None where the family does not say."""
        return None

    @abstractmethod
    def geometry(self, site, record: dict, verify: bool) -> RotaryGeometry:
        """The rotary geometry before any scaling; with `verify`, checked against the live module."""

    @abstractmethod
    def facts(self, site) -> ModelFacts:
        """What the adapter found about the model (rope_ext.method.base.ModelFacts): what a
        method's requirements are checked against (rope_ext.method.base.refusal, run by the
        orchestration before anything changes), and what its `resolve` may read."""

    @abstractmethod
    def build(self, site, method: Method, factor: float, params: dict, geometry: RotaryGeometry, record: dict) -> nn.Module:
        """The rotary module for this patch, not yet installed (may raise, changing nothing)."""

    def layer_types(self, site) -> dict | None:
        """Of a model whose rotary frequencies are kept per layer type, the types the patch
        replaces and keeps ({"patched": [...], "kept": [...]}); None for one set of frequencies."""
        return None

    @abstractmethod
    def install(self, site, rotary: nn.Module, transforms: list, max_length: int) -> dict | None:
        """Swap `rotary` in, run `transforms` inside attention, write the config; return the
        transformers `rope_parameters` that reproduce the patch on a plain reload, or None. The
        method was checked against `facts` before: install decides nothing about it."""

    def config_written(self, site, rotary: nn.Module, max_length: int) -> dict:
        """The config values installing `rotary` writes (key -> value), decided before anything
        changes: what the config.json of a checkpoint saved under that patch states. {}: the
        family writes none."""
        return {}

    @abstractmethod
    def uninstall(self, site) -> None:
        """Put back the rotary module, config values and attention the model had before the patch."""
