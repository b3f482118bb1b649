"""patch / unpatch / describe / from_pretrained: validate, find the family adapter, read the
geometry, compute new frequencies, install them, and record the patch in the config so that a
reload reproduces it. Model-family knowledge lives in the adapters (rope_ext.patches).

Meaning of repeated patches: `factor` is always relative to the model's *original* window.
Patching a patched model replaces the patch (it never compounds). A checkpoint that already
carries a yarn/llama3/longrope scaling is patched relative to the pretraining window that scaling
records; one carrying linear/dynamic scaling records no window, so `original_window=` is required.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torch import nn

from . import scaling

CONFIG_KEY = "rope_ext"
FORMAT_VERSION = 1
# RoPE plus a linear distance bias in attention (rope_ext.patches.alibi): a method that also
# installs an attention transform, so it is not a pure frequency function in `scaling`.
ALIBI_HYBRID = "alibi_hybrid"
# SelfExtend's grouped attention (rope_ext.patches.self_extend): rotates in attention, and derives
# its factor from its group size and neighbour window when no factor is given.
SELF_EXTEND = "self_extend"


@dataclass(frozen=True)
class PatchInfo:
    """What `patch` did. `max_length` is the length the patched model is meant for
    (original_window * factor); `native` is the transformers `rope_parameters` written to the
    config (None when transformers has no equivalent and only rope_ext can reload it)."""

    method: str
    factor: float
    params: dict
    family: str
    model_type: str
    original_window: int
    max_length: int
    rotary_dim: int
    head_dim: int | None
    base: float
    layout: str
    attention_factor: float | None
    native: dict | None

    def to_dict(self) -> dict:
        return asdict(self)


def _site(model: nn.Module):
    from rope_ext.patches import find_adapter

    adapter = find_adapter(model)
    return adapter, adapter.site(model)


def method_specs() -> dict[str, scaling.Method]:
    """Every method `patch` accepts, by name (alibi_hybrid with its default rope)."""
    from rope_ext.patches import alibi, self_extend

    return {**scaling.REGISTRY, ALIBI_HYBRID: alibi.hybrid_method({}), SELF_EXTEND: self_extend.METHOD}


def _spec(method: str, params: dict) -> scaling.Method:
    if method == ALIBI_HYBRID:
        from rope_ext.patches import alibi

        return alibi.hybrid_method(params)
    if method == SELF_EXTEND:
        from rope_ext.patches import self_extend

        return self_extend.METHOD
    if method not in scaling.REGISTRY:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join([*scaling.REGISTRY, ALIBI_HYBRID, SELF_EXTEND])}")
    return scaling.REGISTRY[method]


def patch(model: nn.Module, method: str, factor: float | None = None, *, original_window: int | None = None, **params) -> PatchInfo:
    """Replace the model's rotary embedding with `method` at `factor` x its original window.

    Raises ValueError, leaving the model untouched, on an unknown method or parameter, a factor
    that is not a finite number > 1, or a model rope-ext does not support."""
    spec = _spec(method, params)
    if factor is None and method != SELF_EXTEND:
        raise ValueError(f"method {method!r} needs a factor (> 1), e.g. factor=4")
    params = spec.validate(factor, params)
    factor = None if factor is None else float(factor)
    if original_window is not None and (isinstance(original_window, bool) or not isinstance(original_window, int) or original_window < 1):
        raise ValueError(f"original_window must be a positive int, got {original_window!r}")
    adapter, site = _site(model)
    record, built_from_record = adapter.original_record(site, original_window)
    geometry = adapter.geometry(site, record, verify=built_from_record)
    if method == SELF_EXTEND:
        from rope_ext.patches import self_extend

        factor, params = self_extend.resolve(adapter, site, geometry, factor, params)
    max_length = math.ceil(geometry.original_window * factor)
    if method == ALIBI_HYBRID:
        from rope_ext.patches import alibi

        params, bias = alibi.bias_for(adapter, site, geometry, params)
    rotary = adapter.build(site, spec, factor, params, geometry, record)
    if method == ALIBI_HYBRID:
        rotary.attention_transforms = (bias,)
    if method == SELF_EXTEND:
        rotary.attention_transforms = (self_extend.GroupedAttention(rotary),)

    # Everything that can fail has run; from here on the model changes.
    native = adapter.install(site, rotary, max_length)
    config = site.config
    setattr(config, CONFIG_KEY, {
        "version": FORMAT_VERSION, "method": method, "factor": factor, "params": params,
        "original": {k: v for k, v in record.items() if k != "attn_implementation"},
    })
    return PatchInfo(
        method=method, factor=factor, params=params, family=adapter.name, model_type=config.model_type,
        original_window=geometry.original_window, max_length=max_length, rotary_dim=geometry.rotary_dim,
        head_dim=geometry.head_dim, base=geometry.base, layout=geometry.layout,
        attention_factor=None if spec.dynamic else rotary.attention_scaling, native=native,
    )


def unpatch(model: nn.Module) -> None:
    """Restore the rotary module, config and attention implementation the model had before
    `patch` (for a model reloaded by `from_pretrained`: the checkpoint's original ones)."""
    adapter, site = _site(model)
    if adapter.installed(site) is None:
        raise ValueError("this model is not patched by rope_ext")
    adapter.uninstall(site)
    delattr(site.config, CONFIG_KEY)


def describe(model: nn.Module) -> dict | None:
    """The patch on this model (method, factor, params, original geometry), or None."""
    adapter, site = _site(model)
    rotary = adapter.installed(site)
    if rotary is None:
        return None
    return {
        "method": rotary.method.name, "factor": rotary.factor, "params": dict(rotary.params),
        "geometry": rotary.geometry.to_dict(),
        "max_length": math.ceil(rotary.geometry.original_window * rotary.factor),
    }


def from_pretrained(path, **kwargs) -> nn.Module:
    """Load a causal LM saved after `patch` and re-apply the recorded patch; a LoRA fine-tune
    folder written by recipes/finetune.py is rebuilt as base -> patch -> adapter. Keyword
    arguments go to `AutoModelForCausalLM.from_pretrained`; `trust_remote_code` is never turned on
    here."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from .lora import RECORD_FILE, load_finetuned

    if (Path(path) / RECORD_FILE).is_file():
        return load_finetuned(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    saved = getattr(model.config, CONFIG_KEY, None)
    if saved:
        if saved.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: rope_ext config format {saved.get('version')!r} is not supported (expected {FORMAT_VERSION})")
        patch(model, saved["method"], saved["factor"], **saved["params"])
        if saved["method"] == ALIBI_HYBRID and saved["params"]["trainable"]:
            from rope_ext.patches import alibi

            alibi.load_trained_slopes(model, path)
    return model
