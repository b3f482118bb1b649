"""The model a fine-tune trains: which checkpoint, patched how, and wrapped in which LoRA."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, cast_mixed_precision_params, get_peft_model, prepare_model_for_kbit_training
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


def load_kwargs(cfg: dict, device) -> dict:
    """What `from_pretrained` needs for cfg["model"]: the base's dtype and, for QLoRA, the 4-bit
    quantization (bitsandbytes places the packed weights on `device` as it loads them)."""
    dtype = getattr(torch, cfg["model"]["dtype"])
    kwargs = {"dtype": dtype, "attn_implementation": cfg["model"]["attn_implementation"]}
    if cfg["model"]["load_in_4bit"]:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
        kwargs["device_map"] = {"": device}
    return kwargs


def load_patched(path: str, cfg: dict, device):
    """(tokenizer, model patched as cfg["patch"] says, the PatchInfo), the base loaded as
    cfg["model"] says."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, **load_kwargs(cfg, device))
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
    with activation checkpointing as cfg["training"] says and no KV cache. The trainable weights
    are float32 whatever the base's dtype: AdamW's small updates vanish in half-precision weights."""
    if cfg["model"]["load_in_4bit"]:
        # peft's QLoRA preparation: frozen base, the layers bitsandbytes left unquantized in float32
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if cfg["training"]["gradient_checkpointing"]:
        model.activation_checkpointing_enable({"use_reentrant": False})
    model.config.use_cache = False
    extras = trainable_extras(model, cfg)
    lora = LoraConfig(
        r=cfg["lora"]["r"],
        lora_alpha=cfg["lora"]["alpha"],
        lora_dropout=cfg["lora"]["dropout"],
        target_modules=targets,
        modules_to_save=extras or None,
        task_type="CAUSAL_LM",
        # a trained copy of tied input embeddings must stay tied to the LM head
        ensure_weight_tying=cfg["lora"]["train_embeddings"] and bool(getattr(model.config, "tie_word_embeddings", False)),
    )
    model = get_peft_model(model, lora)
    if cfg["model"]["dtype"] != "float32" and not cfg["model"]["load_in_4bit"]:
        cast_mixed_precision_params(model, getattr(torch, cfg["model"]["dtype"]))
    return model
