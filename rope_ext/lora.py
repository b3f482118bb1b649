"""Save and reload a LoRA fine-tune of a patched model (recipes/finetune.py writes it).

A fine-tune folder holds the peft adapter (adapter_config.json, adapter_model.safetensors), the
tokenizer, and `rope_ext_finetune.json`: which base checkpoint the adapter belongs to and the
rope-ext patch it was trained under. One call rebuilds base -> patch -> adapter:

    model = rope_ext.lora.load_finetuned("runs/yarn-x4")
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from .patching import describe, patch

RECORD_FILE = "rope_ext_finetune.json"
RECORD_VERSION = 1
# The embedded default is recorded by name, not by its cache path, so a fine-tune folder stays
# valid on another machine.
EMBEDDED_DEFAULT = "smollm2"


def resolve_base(name: str) -> str:
    """The path or hub id `from_pretrained` should load for a recorded base model."""
    if name == EMBEDDED_DEFAULT:
        from .defaults import smollm2_path

        return str(smollm2_path())
    return name


def save_record(out_dir, base_model: str, model: nn.Module, extra: dict | None = None) -> Path:
    """Write rope_ext_finetune.json for `model` (patched, possibly peft-wrapped) into `out_dir`.

    `base_model` is what `resolve_base` turns back into a loadable checkpoint: "smollm2", an
    absolute local path, or a hub id."""
    patch_state = describe(model)
    if patch_state is None:
        raise ValueError("the model is not patched by rope_ext; nothing to record")
    record = {
        "version": RECORD_VERSION,
        "base_model": base_model,
        "patch": {
            "method": patch_state["method"],
            "factor": patch_state["factor"],
            "params": patch_state["params"],
            "original_window": patch_state["geometry"]["original_window"],
        },
        "max_length": patch_state["max_length"],
        **(extra or {}),
    }
    path = Path(out_dir) / RECORD_FILE
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_record(path) -> dict:
    path = Path(path)
    record_path = path / RECORD_FILE
    if not record_path.is_file():
        hint = " (a merged model: use rope_ext.from_pretrained)" if (path / "config.json").is_file() else ""
        raise FileNotFoundError(f"{path} holds no {RECORD_FILE}: not a rope-ext LoRA fine-tune folder{hint}")
    record = json.loads(record_path.read_text())
    if record.get("version") != RECORD_VERSION:
        raise ValueError(f"{record_path}: format version {record.get('version')!r} is not supported (expected {RECORD_VERSION})")
    return record


def load_finetuned(path, merge: bool = False, **hf_kwargs) -> nn.Module:
    """Load the base model a fine-tune was trained from, re-apply its rope-ext patch and attach
    the LoRA adapter (a peft `PeftModel`); with `merge=True`, fold the adapter into the weights
    and return a plain transformers model that still carries the patch.

    Keyword arguments go to `AutoModelForCausalLM.from_pretrained` for the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    record = read_record(path)
    model = AutoModelForCausalLM.from_pretrained(resolve_base(record["base_model"]), **hf_kwargs)
    spec = record["patch"]
    patch(model, spec["method"], spec["factor"], original_window=spec["original_window"], **spec["params"])
    model = PeftModel.from_pretrained(model, str(path))
    if merge:
        model = model.merge_and_unload()
    return model.eval()
