"""The model a fine-tune trains: which checkpoint, patched how, and wrapped in which LoRA."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import rope_ext
from rope_ext.defaults import SMOLLM2, resolve_checkpoint

from .config import ConfigError
from .tiny import ensure_tiny


def resolve_model(name: str) -> tuple[str, str]:
    """(path or hub id to load, name to record for reloading)."""
    if name == SMOLLM2:
        return resolve_checkpoint(name), name
    if name == "tiny":
        path = str(ensure_tiny())
        return path, path
    if Path(name).exists():
        path = str(Path(name).resolve())
        return path, path
    return name, name  # a hub id


def load_patched(path: str, cfg: dict):
    """(tokenizer, fp32 model patched as cfg["patch"] says, the PatchInfo)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=cfg["model"]["attn_implementation"])
    try:
        info = rope_ext.patch(model, cfg["patch"]["method"], cfg["patch"]["factor"], **cfg["patch"]["params"])
    except ValueError as err:
        raise ConfigError(f"rope_ext.patch: {err}") from None
    return tokenizer, model, info


def lora_targets(model, setting) -> list[str]:
    """The module names LoRA wraps: the family's attention projections for "auto", else `setting`,
    each checked to name a module of the model."""
    targets = rope_ext.lora_targets(model) if setting == "auto" else setting
    missing = [t for t in targets if not any(n.split(".")[-1] == t for n, _ in model.named_modules())]
    if missing:
        raise ConfigError(f"lora.target_modules {missing} name no module of {type(model).__name__}")
    return targets


def trainable_extras(model, cfg: dict) -> list[str]:
    """Module names peft should train in full (LongLoRA's embeddings and norms)."""
    names = []
    if cfg["lora"]["train_embeddings"]:
        embed = model.get_input_embeddings()
        names += [n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is embed]
    if cfg["lora"]["train_norms"]:
        names += sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if "norm" in type(m).__name__.lower() and n})
    return names


def lora_model(model, cfg: dict, targets: list[str]):
    """The peft model to train: the LoRA of cfg["lora"] on `targets` (plus LongLoRA's extras),
    with activation checkpointing as cfg["training"] says and no KV cache."""
    if cfg["training"]["gradient_checkpointing"]:
        model.activation_checkpointing_enable({"use_reentrant": False})
    model.config.use_cache = False
    extras = trainable_extras(model, cfg)
    lora = LoraConfig(
        r=cfg["lora"]["r"], lora_alpha=cfg["lora"]["alpha"], lora_dropout=cfg["lora"]["dropout"],
        target_modules=targets, modules_to_save=extras or None, task_type="CAUSAL_LM",
        # a trained copy of tied input embeddings must stay tied to the LM head
        ensure_weight_tying=cfg["lora"]["train_embeddings"] and bool(getattr(model.config, "tie_word_embeddings", False)),
    )
    return get_peft_model(model, lora)
