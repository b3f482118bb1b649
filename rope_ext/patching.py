"""patch / unpatch / describe / reapply: the orchestration. It knows no method and no family.
`patch` runs in six steps, and the model changes in the last alone:

    check     method = rope_ext.method.check(name, ...)       the spec checked (ValueError, nothing changed)
    read      saved = record.read(config)                     the patch a reloaded checkpoint records, and
              reading = adapter.read(model, ..., saved)       one value with what the model is: where its
                                                              rotary lives, the pre-patch values, geometry,
                                                              facts, layer types, shipped scaling and the
                                                              context it serves
    resolve   factor, params = method.resolve(...)            what the method derives from the model
    refusal   refusal(method, facts, length)                  the one check of what the method requires of the
                                                              model (and of the length asked for)
    build     rotary = adapter.build(reading, ...)            the new rotary module and what runs inside
              chain = attention_chain(...)                    attention under it, not yet installed
    install   adapter.install(site, rotary, chain, length)    from here on the model changes; then
              record.write(config, ...)                       so that a reload or an unpatch reproduces exactly

Meaning of repeated patches: `factor` is always relative to the model's *original* window.
Patching a patched model replaces the patch (it never compounds).

The base a patch starts from is the model as loaded (docs/shipped.md): a checkpoint that ships a
llama3, yarn or linear scaling is extended from that scaling, its factor relative to the context
the checkpoint serves; `original_window=` replaces the shipped scaling instead, the factor then
relative to that pretraining window. A patch meant for fewer tokens than the checkpoint serves is
refused unless `allow_shrink=True`.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

from torch import nn
from transformers.generation.stopping_criteria import MaxLengthCriteria

from . import method as methods
from . import record, serving
from .attention import RotateInAttention, Rotator
from .geometry import RotaryGeometry
from .method.base import MAX_POSITIONS, ModelFacts, as_size, refusal
from .patches import find_adapter
from .record import Patch
from .shipped import shipped_of


@dataclass(frozen=True)
class PatchInfo:
    """What `patch` did: the `Patch` (rope_ext.record, held as `patch`) with its fields and its
    geometry's read through, and what the patch found on the model and wrote to it. `max_length` is the length the patched model is meant
    for (original_window * factor); `native` is the transformers `rope_parameters` written to the
    config (None when transformers has no equivalent and only rope_ext can reload it); `notes` is
    what the method states about the parameters it resolved, as data (e.g. whether they follow a
    rule its authors give, at max_length); {} when it states nothing. `layer_types`, of a model
    whose rotary frequencies are kept per layer type (Gemma 3, OLMo 3, ...): the types whose
    frequencies the patch replaces ("patched": the full-attention layers) and keeps ("kept"),
    and of a model with several rotary modules (Granite-SWA) the modules too ("rotary": patched,
    kept, unused); None for a model with one set, which `to_dict` leaves out. `starts_from` is what
    the patch extends: "scaling", the shipped rope type it extends (None: the trained frequencies),
    "window", the window `factor` multiplies, "source", where that window comes from
    ("original_window=", "the shipped scaling", "max_position_embeddings", ...), and of a shipped
    scaling its "attention_factor"."""

    patch: Patch  # with its geometry
    family: str
    model_type: str
    attention_factor: float | None
    native: dict | None
    notes: dict
    starts_from: dict

    # the Patch's, read through
    method = property(lambda self: self.patch.method)
    factor = property(lambda self: self.patch.factor)
    params = property(lambda self: self.patch.params)
    original_window = property(lambda self: self.patch.original_window)
    max_length = property(lambda self: self.patch.max_length)
    layer_types = property(lambda self: self.patch.layer_types)
    # its geometry's
    rotary_dim = property(lambda self: self.patch.geometry.rotary_dim)
    head_dim = property(lambda self: self.patch.geometry.head_dim)
    base = property(lambda self: self.patch.geometry.base)
    layout = property(lambda self: self.patch.geometry.layout)

    FIELDS = (
        "method",
        "factor",
        "params",
        "family",
        "model_type",
        "original_window",
        "max_length",
        "rotary_dim",
        "head_dim",
        "base",
        "layout",
        "attention_factor",
        "native",
        "notes",
        "layer_types",
        "starts_from",
    )

    def to_dict(self) -> dict:
        """Every field above as plain data (copies), `layer_types` left out where it is None."""
        info = {name: copy.deepcopy(getattr(self, name)) for name in self.FIELDS}
        if info["layer_types"] is None:
            del info["layer_types"]
        return info


def _site(model: nn.Module):
    adapter, hf_model = find_adapter(model)
    return adapter, adapter.site(hf_model)


def patch(
    model: nn.Module,
    method: str,
    factor: float | None = None,
    *,
    original_window: int | None = None,
    allow_shrink: bool = False,
    _saved: Patch | None = None,
    **params,
) -> PatchInfo:
    """Replace the model's rotary embedding with `method` at `factor` x its original window: the
    context the checkpoint serves, extended from its shipped scaling, or with `original_window=`,
    that pretraining window, the shipped scaling replaced (its own parameters, such as gpt-oss's
    truncate or DeepSeek's mscale, are the defaults of a method of the same type).

    Raises ValueError, leaving the model untouched, on an unknown method or parameter, a factor
    that is not a finite number > 1, a model rope-ext does not support, a patch meant for fewer
    tokens than the checkpoint serves without `allow_shrink=True`, or a parameter the shipped
    scaling fixes given to a patch that extends it (DeepSeek's mscale and mscale_all_dim).

    `_saved` is reapply's: the patch the model's config records, which it has read already. (A
    parameter rather than an inner function, so that a method's warning from `resolve` points at
    the caller of `patch`.)"""
    # check
    given = dict(params)
    spec, factor, params = methods.check(method, factor, params)
    if original_window is not None:
        original_window = as_size(original_window, "original_window")
    if not isinstance(allow_shrink, bool):
        raise ValueError(f"allow_shrink must be True or False, got {allow_shrink!r}")
    # read
    adapter, hf_model = find_adapter(model)
    saved = record.read(record.holder(hf_model.config)) if _saved is None else _saved
    reading = adapter.read(hf_model, original_window, saved)
    site, original, geometry, facts = reading.site, reading.original, reading.geometry, reading.facts
    own_config(hf_model)
    if _saved is None and (inherited := reading.shipped.params(spec, given)):
        # the shipped scaling's own parameters re-applied (gpt-oss's truncate, DeepSeek's mscale)
        spec, factor, params = methods.check(method, factor, {**inherited, **given})
    # resolve
    try:
        factor, params = spec.resolve(facts, geometry, factor, params)
    except ValueError as err:
        if _saved is None:
            raise
        raise ValueError(f"{_saved.source}: key {record.CONFIG_KEY}.params: {err}") from None
    applied = Patch(method, factor, params, original, geometry, reading.layer_types)
    length, window = applied.max_length, applied.original_window
    # refusal
    if length > MAX_POSITIONS:
        raise ValueError(
            f"{method} x{factor:.15g} over a {window}-token window is meant for {length} "
            f"tokens, past {MAX_POSITIONS}, the bound of every size rope-ext takes (max_position_embeddings is written "
            f"from it); use a factor of at most {MAX_POSITIONS // window}"
        )
    if (refused := refusal(spec, facts, length)) is not None:
        raise ValueError(refused)  # what the method requires against what the model is, in one place
    served = reading.shipped.served
    if _saved is None and served is not None and length < served and not allow_shrink:
        raise ValueError(
            f"{method} x{factor:g} over a {window}-token window is meant for {length} tokens, "
            f"fewer than the {served} this checkpoint serves as loaded; leave original_window out to extend the shipped "
            "model, raise the factor, or pass allow_shrink=True (--allow-shrink) to read less"
        )
    # build
    rotary = adapter.build(reading, spec, factor, params)
    if saved is not None and site.installed is None:
        # what the record says the checkpoint was, against what its config states
        recorded = (rotary, length) if _saved is not None else _recorded_rotary(adapter, hf_model, saved, facts)
        record.check_stated(site.config, adapter.config_written(site, *recorded), saved)
    chain = attention_chain(spec, rotary, facts, params)
    notes = spec.notes(geometry, factor, params)

    # install: everything that can fail has run; from here on the model changes.
    starts_from = {
        "scaling": None,
        "window": window,
        "source": "original_window=",
        **original.get("starts_from", {}),
    }
    if shipped := shipped_of(rotary.method):
        starts_from["attention_factor"] = shipped.attention_factor
    with record.unlisted_keys_quiet():  # install builds the written config back to check it
        native = adapter.install(site, rotary, chain, length)
    if _saved is None and starts_from["source"] == "max_position_embeddings":
        warnings.warn(
            f"rope_ext: the trained window is taken as {window} tokens from max_position_embeddings alone "
            "(no scaling or other config field states it); if the model was trained on fewer, pass "
            "original_window=<tokens>",
            UserWarning,
            stacklevel=2,
        )
    record.write(site.config, applied)
    PatchedModel(site.model, method, length, native is not None).install()
    return PatchInfo(
        patch=applied,
        family=adapter.name,
        model_type=site.model.config.model_type,
        attention_factor=None if spec.dynamic else rotary.attention_scaling,
        native=native,
        notes=notes,
        starts_from=starts_from,
    )


def attention_chain(spec, rotary: nn.Module, facts: ModelFacts, params: dict) -> list:
    """What runs inside attention under the patch built: the method's transforms (alibi_hybrid's
    bias, self_extend's grouped attention), led by the rotation inside attention where the rotary
    module built rotates at every forward and no transform rotates queries and keys itself. Empty:
    the model's attention runs as it is."""
    transforms = list(spec.attention(rotary, facts, params))
    rotates = any(transform.rotates for transform in transforms)
    return ([RotateInAttention(Rotator(rotary))] if rotary.dynamic and not rotates else []) + transforms


def _recorded_rotary(adapter, model: nn.Module, saved: Patch, facts: ModelFacts) -> tuple[nn.Module, int]:
    """The rotary module of the patch `saved` that a model's config records, built as a reload of
    it builds it (not installed), and the length that patch is meant for."""
    spec, factor, params = methods.check(saved.method, saved.factor, saved.params)
    reading = adapter.read(model, None, saved)
    factor, params = spec.resolve(facts, reading.geometry, factor, params)
    recorded = Patch(saved.method, factor, params, reading.original, reading.geometry)
    return adapter.build(reading, spec, factor, params), recorded.max_length


def own_config(model: nn.Module) -> None:
    """Give `model` a config object of its own, the same values, before a patch writes into it:
    transformers lets models share one (two `from_config(cfg)` calls), and a patch must not reach
    the other. Every module of the model that holds the config, or one of its sub-configs (a
    composite's text config), gets the copy's."""
    config = model.config
    copied = copy.deepcopy(config)
    pairs = {id(config): copied}
    for name in getattr(config, "sub_configs", None) or {}:
        if getattr(config, name, None) is not None:
            pairs[id(getattr(config, name))] = getattr(copied, name)
    for module in model.modules():
        held = [(name, value) for name, value in vars(module).items() if id(value) in pairs]
        for name, value in held:
            setattr(module, name, pairs[id(value)])


def reapply(model: nn.Module, path=None) -> PatchInfo | None:
    """Re-apply the patch recorded in the config of a model loaded by transformers alone (None
    when it records none), with the state the checkpoint folder `path` holds beyond the config
    (alibi_hybrid's trained slopes)."""
    source = None if path is None else f"{path}/config.json"
    saved = record.read(record.holder(model.config), source)
    if saved is None:
        return None
    info = patch(model, saved.method, saved.factor, _saved=saved, **saved.params)
    methods.get(saved.method, saved.params).load_state(model, path, info.params)
    return info


def unpatch(model: nn.Module) -> None:
    """Restore the rotary module, config and attention implementation the model had before
    `patch` (for a model reloaded by `from_pretrained`: the checkpoint's original ones)."""
    adapter, site = _site(model)
    if site.installed is None:
        raise ValueError("this model is not patched by rope_ext")
    adapter.uninstall(site)
    PatchedModel.uninstall(site.model)
    record.erase(site.config)


class PatchedModel:
    """What a patched transformers model answers in place of two of its methods, set on the
    instance by `patch` and removed by `unpatch` (an object, so that `copy.deepcopy` of the model
    gives methods of the copy):

    - `save_pretrained` warns when a reader of the written config (transformers, vLLM, SGLang)
      does not serve it as patched, worded from `served_verdicts` (`save_warning`), the table
      `rope-ext patch` prints: without a native `rope_parameters` the checkpoint loads as another
      model except through `rope_ext.from_pretrained`;
    - `_get_stopping_criteria` (generate) moves transformers' "exceeded the model's predefined
      maximum length" reminder from the config's window to the length the patch is meant for."""

    METHODS = ("save_pretrained", "_get_stopping_criteria")

    def __init__(self, model: nn.Module, method: str, max_length: int, reloads_natively: bool):
        self.model, self.method, self.max_length, self.reloads_natively = model, method, max_length, reloads_natively

    def install(self) -> None:
        for name in self.METHODS:
            setattr(self.model, name, getattr(self, name))

    @classmethod
    def uninstall(cls, model: nn.Module) -> None:
        for name in cls.METHODS:
            model.__dict__.pop(name, None)

    def save_pretrained(self, *args, **kwargs):
        if (warning := save_warning(self.model, self.method, self.reloads_natively)) is not None:
            warnings.warn(warning, UserWarning, stacklevel=2)
        return type(self.model).save_pretrained(self.model, *args, **kwargs)

    def _get_stopping_criteria(self, *args, **kwargs):
        criteria = type(self.model)._get_stopping_criteria(self.model, *args, **kwargs)
        for criterion in criteria:
            if isinstance(criterion, MaxLengthCriteria) and criterion.max_position_embeddings is not None:
                criterion.max_position_embeddings = max(criterion.max_position_embeddings, self.max_length)
        return criteria


def lora_targets(model: nn.Module) -> list[str]:
    """The module names a LoRA adapter targets by default in this model's family: its attention
    projections."""
    adapter, _ = _site(model)
    return list(adapter.lora_targets)


def installed_rotary(model: nn.Module):
    """The rope-ext rotary module of the patch on this model, or None."""
    _, site = _site(model)
    return site.installed


def installed_patch(model: nn.Module) -> Patch | None:
    """The patch on this model, or None."""
    _, site = _site(model)
    rotary = site.installed
    if rotary is None:
        return None
    return Patch(rotary.method.name, rotary.factor, rotary.params, rotary.original, rotary.geometry, site.layer_types)


def engine_verdicts(model: nn.Module, native: bool) -> dict[str, str]:
    """engine -> what it serves from the config.json a save of this patched model writes, `native`
    where that config holds the patch's native form (rope_ext.serving.verdicts)."""
    return serving.verdicts(serving.written(model), installed_patch(model), installed_rotary(model), native)


def served_verdicts(model: nn.Module, native: bool) -> dict[str, str]:
    """transformers' verdict (rope_ext.serving.transformers_verdict), then each engine's: the one
    table every message about a written checkpoint is worded from."""
    return {serving.TRANSFORMERS: serving.transformers_verdict(installed_rotary(model), native), **engine_verdicts(model, native)}


def verdict_message(method: str, found: dict[str, str]) -> str | None:
    """The one sentence about a written checkpoint's readers, from `found` (served_verdicts): None
    where every reader serves it as patched."""
    if all(verdict == "unpatched" for verdict in found.values()):
        return (
            f"no transformers rope_parameters express the {method!r} patch of this model, so a plain from_pretrained of "
            "the checkpoint (or an engine) loads the unpatched model; load it with rope_ext.from_pretrained(path), which "
            "re-applies the patch"
        )
    differ = {reader: verdict for reader, verdict in found.items() if verdict != "as patched"}
    if not differ:
        return None
    right = [reader for reader, verdict in found.items() if verdict == "as patched"]
    served = f"{', '.join(right)} serve{'s' if len(right) == 1 else ''} this checkpoint as patched; " if right else ""
    listed = "; ".join(f"{reader} {verdict}" for reader, verdict in differ.items())
    return f"{served}{listed} (docs/serving.md); rope_ext.from_pretrained(path) re-applies the patch"


def save_warning(model: nn.Module, method: str, native: bool) -> str | None:
    """What `save_pretrained` of a patched model warns: `verdict_message`, prefixed."""
    message = verdict_message(method, served_verdicts(model, native))
    return None if message is None else f"rope_ext: {message}"


def describe(model: nn.Module) -> dict | None:
    """The patch on this model (method, factor, params, original geometry), or None."""
    applied = installed_patch(model)
    return None if applied is None else applied.described()


def native_type(spec) -> str | None:
    """The transformers rope_type `spec` writes at its default parameters over a model with no
    shipped scaling, or None where it writes none (only rope_ext.from_pretrained reloads it). A
    parameter the method requires, or a list of factors it otherwise derives from the model, is given
    a value (the type does not depend on it): 1 per pair for a list, 2 for a number."""
    geometry = RotaryGeometry(rotary_dim=64, base=10000.0, original_window=8192)
    given = {
        name: [1.0] * (geometry.rotary_dim // 2) if param.kind == "list" else 2.0
        for name, param in spec.params.items()
        if param.required or (param.kind == "list" and param.default is None and param.item.kind in ("float", "number"))
    }
    bound = spec.bind(given)
    native = bound.native(geometry, 4.0, bound.validate(4.0, given), {})
    return None if native is None else native["rope_type"]


def listing() -> dict[str, dict]:
    """Every method with its summary, formula, parameters (with defaults), whether it is dynamic
    and the rope_type it writes to config.json (`native_type`)."""
    return {
        name: {
            "summary": m.summary,
            "formula": m.formula,
            "params": {"factor": None, **m.all_params},
            "dynamic": m.dynamic,
            "native_type": native_type(m),
        }
        for name, m in methods.REGISTRY.items()
    }
