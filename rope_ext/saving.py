"""Loading what rope-ext saved: a patched checkpoint, and a LoRA fine-tune of a patched model.

A patched checkpoint is a transformers checkpoint whose config.json carries the patch record
(rope_ext.record); `from_pretrained` loads it and re-applies the patch. A fine-tune folder
(written by recipes/finetune.py) holds the peft adapter (adapter_model.safetensors and its
config), the tokenizer, and `rope_ext_finetune.json`: which base checkpoint the adapter belongs
to and the patch it was trained under. One call rebuilds base -> patch -> adapter:

    model = rope_ext.from_pretrained("runs/yarn-x4")

The loads that know nothing of rope-ext read the adapter's config and build its base from
`base_model_name_or_path` (peft's AutoPeftModelForCausalLM, transformers'
AutoModelForCausalLM.from_pretrained of the folder). `save_record` makes them right where
transformers' rope_parameters express the patch, and makes them fail where not (see there).
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from pathlib import Path

import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from . import record
from .defaults import resolve_checkpoint
from .patching import installed_patch, patch, reapply
from .record import Patch

ADAPTER_CONFIG = "adapter_config.json"  # the name peft and transformers look for
SEALED_ADAPTER_CONFIG = "rope_ext_adapter_config.json"  # the same file, out of their sight
PLAIN_BASE = "base"  # the base as transformers alone loads it patched
# from_pretrained's keyword arguments that reading the config alone needs
CONFIG_KEYS = ("revision", "subfolder", "cache_dir", "token", "local_files_only", "trust_remote_code")


def from_pretrained(path, **kwargs) -> nn.Module:
    """Load a causal LM saved after `patch` and re-apply the recorded patch; a LoRA fine-tune
    folder written by recipes/finetune.py is rebuilt as base -> patch -> adapter. Keyword
    arguments go to `AutoModelForCausalLM.from_pretrained`; `trust_remote_code` is never turned on
    here."""
    if (Path(path) / record.FINETUNE_FILE).is_file():
        return load_finetuned(path, **kwargs)
    if (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"{path} is a peft adapter folder (PeftModel.save_pretrained, what transformers' Trainer writes): it holds "
            "the adapter but not the patch its base was trained under, and a plain PeftModel.from_pretrained of it "
            "attaches it to the unpatched base. Write the patch beside it with rope_ext.saving.save_record(folder, base, "
            "model) after training (docs/finetune.md), then rope_ext.from_pretrained(folder) rebuilds base -> patch -> adapter"
        )
    with record.unlisted_keys_quiet():
        model = causal_lm_class(path, kwargs).from_pretrained(path, **kwargs)
        reapply(model, path)
    return model


def causal_lm_class(path, kwargs: dict):
    """AutoModelForCausalLM, or the transformers class config.json names in `architectures` where
    the auto class maps the config to none (`causal_lm_class_of`)."""
    config = kwargs.get("config") or AutoConfig.from_pretrained(path, **{k: kwargs[k] for k in CONFIG_KEYS if k in kwargs})
    return causal_lm_class_of(config)


def causal_lm_class_of(config):
    """The class that builds a causal LM of `config`: AutoModelForCausalLM, or the transformers
    class its `architectures` names where the auto class maps the config to none: the causal LMs of
    emu3 and mllama run on a text config of their composite one, which no auto class maps, and
    save that config."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    named = [getattr(transformers, name, None) for name in getattr(config, "architectures", None) or ()]
    return next((cls for cls in named if getattr(cls, "config_class", None) is type(config)), AutoModelForCausalLM)


def save_record(out_dir, base_model: str, model: nn.Module, extra: dict | None = None) -> Path:
    """Write rope_ext_finetune.json for `model` (patched, possibly peft-wrapped) into `out_dir`,
    next to the adapter peft saved there, and make the plain loads of the folder right or refused:

    - where transformers' rope_parameters express the patch, `out_dir/base` becomes the base as
      transformers loads it patched (the base's config with the native rope_parameters, its
      other files linked, not copied) and the adapter's config names it as its base, so peft's
      AutoPeftModelForCausalLM and transformers' AutoModelForCausalLM.from_pretrained(out_dir)
      give the fine-tuned model;
    - otherwise the adapter's config is renamed rope_ext_adapter_config.json, so that those loads
      stop (peft: "Can't find 'adapter_config.json'") instead of attaching the adapter to the
      unpatched model; `load_finetuned` reads it under that name.

    `base_model` is what `resolve_checkpoint` turns back into a loadable checkpoint: "smollm2"
    (recorded by name, not by its cache path, so the folder stays valid on another machine), an
    absolute local path, or a hub id."""
    applied = installed_patch(model)
    if applied is None:
        raise ValueError("the model is not patched by rope_ext; nothing to record")
    path = record.write_finetune(out_dir, base_model, applied, extra)
    base = _local_folder(base_model)
    config = plain_config(model.config, applied, base)
    if config is None:
        _seal(Path(out_dir), applied.method)
    else:
        _write_plain_base(Path(out_dir), base, config)
    return path


def plain_config(patched, applied: Patch, base: Path):
    """The base's config with the values the patch `applied` wrote to `patched` (the patched
    model's config): what transformers alone loads as the patched model. None when the patch left
    them as they were, having no native form (rope_ext.patching.PatchInfo.native)."""
    owned = [key for key in applied.original if hasattr(patched, key)]
    if all(getattr(patched, key) == applied.original[key] for key in owned):
        return None
    config = AutoConfig.from_pretrained(base)
    for key in (*owned, record.CONFIG_KEY):
        setattr(config, key, copy.deepcopy(getattr(patched, key)))
    return config


def _local_folder(base_model: str) -> Path:
    """The folder the base model loads from: its own, or its snapshot in the hub cache."""
    path = Path(resolve_checkpoint(base_model))
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(base_model, local_files_only=True))


def _write_plain_base(out: Path, base: Path, config) -> None:
    from peft import PeftConfig

    view = out / PLAIN_BASE
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    for item in base.iterdir():
        if item.is_file() and item.name != "config.json":
            (view / item.name).symlink_to(item.resolve())
    config.save_pretrained(view)
    adapter = PeftConfig.from_pretrained(str(out))
    adapter.base_model_name_or_path = str(view.resolve())
    adapter.save_pretrained(str(out))


def _seal(out: Path, method: str) -> None:
    os.replace(out / ADAPTER_CONFIG, out / SEALED_ADAPTER_CONFIG)
    warnings.warn(
        f"rope_ext: no transformers rope_parameters express the {method!r} patch, so peft or transformers alone would "
        f"attach this adapter to the unpatched model; {out} keeps its adapter config as {SEALED_ADAPTER_CONFIG}, which "
        f"they do not read: load it with rope_ext.from_pretrained({str(out)!r})",
        UserWarning,
        stacklevel=3,
    )


def check_adapter_base(model) -> None:
    """ValueError when `model` is a peft model carrying an adapter that `save_record` wrote for a
    patched base (its config names the fine-tune's `base` folder, beside rope_ext_finetune.json)
    but whose base is not that one: `PeftModel.from_pretrained(<the base loaded by its original
    name>, out)`, peft's own pattern, attaches the adapter to the unpatched model, which peft
    does without a word. The base is checked by its rope_parameters, which carry the patch."""
    adapters = getattr(model, "peft_config", None)
    if not isinstance(adapters, dict):
        return
    config = model.get_base_model().config
    for name, adapter in adapters.items():
        folder = Path(getattr(adapter, "base_model_name_or_path", None) or "")
        if folder.name != PLAIN_BASE or not (folder.parent / record.FINETUNE_FILE).is_file():
            continue
        expected = AutoConfig.from_pretrained(folder)
        if config.rope_parameters != expected.rope_parameters:
            _, saved = record.read_finetune(folder.parent)
            raise ValueError(
                f"adapter {name!r} was trained on the patched base {folder} ({saved.method} x{saved.factor:g}, "
                f"rope_parameters {expected.rope_parameters}), but this model's base has {config.rope_parameters}: "
                "the base was loaded by its original name, so the adapter sits on another model. Load the fine-tune "
                f"with rope_ext.from_pretrained({str(folder.parent)!r}), or load the base from {str(folder)!r}"
            )


def _adapter_config(path: Path):
    """The adapter's peft config when `save_record` renamed it; None lets peft read its own."""
    from peft import PeftConfig

    sealed = path / SEALED_ADAPTER_CONFIG
    return PeftConfig.from_peft_type(**PeftConfig.from_json_file(str(sealed))) if sealed.is_file() else None


def load_finetuned(path, merge: bool = False, **hf_kwargs) -> nn.Module:
    """Load the base model a fine-tune was trained from, re-apply its rope-ext patch and attach
    the LoRA adapter (a peft `PeftModel`); with `merge=True`, fold the adapter into the weights
    and return a plain transformers model that still carries the patch.

    Keyword arguments go to `AutoModelForCausalLM.from_pretrained` for the base model."""
    from peft import PeftModel  # peft loads only for fine-tune folders

    base_model, saved = record.read_finetune(path)
    model = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(base_model), **hf_kwargs)
    patch(model, saved.method, saved.factor, original_window=saved.original_window, **saved.params)
    model = PeftModel.from_pretrained(model, str(path), config=_adapter_config(Path(path)))
    if merge:
        model = model.merge_and_unload()
    return model.eval()
