"""The study's YAML config, checked, the rows it can ask for, and the model shape it sets."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from .model import ENCODINGS, ModelShape

# The rows of the study: one per encoding, one per training-free extension of the RoPE model.
LABELS = {
    "learned": "Learned absolute (BERT)",
    "sinusoidal": "Sinusoidal (Transformer)",
    "t5": "T5 relative bias",
    "deberta": "DeBERTa disentangled",
    "alibi": "ALiBi",
    "rope": "RoPE (LLaMA)",
}
EXTENSION_LABELS = {"ntk": "RoPE + NTK", "dynamic": "RoPE + dynamic NTK", "yarn": "RoPE + YaRN"}


def load_config(path: str | os.PathLike) -> dict:
    """The YAML config, checked; raises ValueError naming the first problem."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config {path} does not exist")
    cfg = yaml.safe_load(path.read_text()) or {}
    missing = {"seed", "threads", "model", "data", "train", "eval", "encodings"} - set(cfg)
    if missing:
        raise ValueError(f"config {path} lacks {sorted(missing)}")
    unknown = sorted(set(cfg["encodings"]) - set(ENCODINGS))
    if unknown:
        raise ValueError(f"config {path}: unknown encoding(s) {unknown}; choose from {', '.join(ENCODINGS)}")
    multiples = cfg["eval"]["multiples"]
    if (
        not multiples
        or multiples[0] != 1
        or any(not isinstance(m, int) or m < 1 for m in multiples)
        or sorted(set(multiples)) != multiples
    ):
        raise ValueError(f"config {path}: eval.multiples must be increasing integers starting at 1, got {multiples}")
    extensions = cfg["eval"].get("rope_extensions") or {}
    if not isinstance(extensions, dict):
        raise ValueError(f"config {path}: eval.rope_extensions must map method names to their parameters")
    if extensions and "rope" not in cfg["encodings"]:
        raise ValueError(f"config {path}: rope_extensions need the rope encoding")
    for method in extensions:
        if method not in EXTENSION_LABELS:
            raise ValueError(
                f"config {path}: rope extension {method!r} not supported here; choose from {', '.join(EXTENSION_LABELS)}"
            )
    if cfg["data"]["eval_windows"] < 1 or cfg["train"]["steps"] < 1 or cfg["threads"] < 1:
        raise ValueError(f"config {path}: eval_windows, steps and threads must be >= 1")
    return cfg


def model_shape(cfg: dict, tokenizer) -> ModelShape:
    m = cfg["model"]
    return ModelShape(
        vocab_size=len(tokenizer),
        hidden_size=m["hidden_size"],
        num_layers=m["num_layers"],
        num_heads=m["num_heads"],
        intermediate_size=m["intermediate_size"],
        window=cfg["train"]["window"],
        rope_theta=float(m["rope_theta"]),
    )
