"""Loading what rope-ext saved: a patched checkpoint, and a LoRA fine-tune of a patched model.

A patched checkpoint is a transformers checkpoint whose config.json carries the patch record
(rope_ext.record); `from_pretrained` loads it and re-applies the patch. A fine-tune folder
(written by recipes/finetune.py) holds the peft adapter (adapter_config.json,
adapter_model.safetensors), the tokenizer, and `rope_ext_finetune.json`: which base checkpoint
the adapter belongs to and the patch it was trained under. One call rebuilds base -> patch ->
adapter:

    model = rope_ext.from_pretrained("runs/yarn-x4")
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers import AutoModelForCausalLM

from . import record
from .defaults import resolve_checkpoint
from .patching import describe, patch, reapply


def from_pretrained(path, **kwargs) -> nn.Module:
    """Load a causal LM saved after `patch` and re-apply the recorded patch; a LoRA fine-tune
    folder written by recipes/finetune.py is rebuilt as base -> patch -> adapter. Keyword
    arguments go to `AutoModelForCausalLM.from_pretrained`; `trust_remote_code` is never turned on
    here."""
    if (Path(path) / record.FINETUNE_FILE).is_file():
        return load_finetuned(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    reapply(model, path)
    return model


def save_record(out_dir, base_model: str, model: nn.Module, extra: dict | None = None) -> Path:
    """Write rope_ext_finetune.json for `model` (patched, possibly peft-wrapped) into `out_dir`.

    `base_model` is what `resolve_checkpoint` turns back into a loadable checkpoint: "smollm2"
    (recorded by name, not by its cache path, so the folder stays valid on another machine), an
    absolute local path, or a hub id."""
    described = describe(model)
    if described is None:
        raise ValueError("the model is not patched by rope_ext; nothing to record")
    return record.write_finetune(out_dir, base_model, described, extra)


def load_finetuned(path, merge: bool = False, **hf_kwargs) -> nn.Module:
    """Load the base model a fine-tune was trained from, re-apply its rope-ext patch and attach
    the LoRA adapter (a peft `PeftModel`); with `merge=True`, fold the adapter into the weights
    and return a plain transformers model that still carries the patch.

    Keyword arguments go to `AutoModelForCausalLM.from_pretrained` for the base model."""
    from peft import PeftModel  # peft loads only for fine-tune folders

    saved = record.read_finetune(path)
    model = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(saved["base_model"]), **hf_kwargs)
    spec = saved["patch"]
    patch(model, spec["method"], spec["factor"], original_window=spec["original_window"], **spec["params"])
    model = PeftModel.from_pretrained(model, str(path))
    if merge:
        model = model.merge_and_unload()
    return model.eval()
