"""Training one model of the study, and its checkpoint."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from datasets import Dataset
from tqdm import tqdm

from rope_ext.training.loop import RecentLoss, next_token_loss, optimizer_step
from rope_ext.training.optim import adamw_cosine

from .data import batches
from .model import ModelShape, build_model, count_parameters


def train_encoding(name: str, cfg: dict, shape: ModelShape, windows: Dataset) -> tuple[torch.nn.Module, dict]:
    run = cfg["train"]
    model = build_model(name, shape, cfg["seed"], **(cfg["encodings"][name] or {}))
    optimizer, schedule = adamw_cosine(model, run["lr"], run["weight_decay"], run["warmup_steps"], run["steps"], run["betas"])
    torch.manual_seed(cfg["seed"])
    model.train()
    recent = RecentLoss()
    start, cpu_start = time.perf_counter(), time.process_time()
    bar = tqdm(range(run["steps"]), desc=f"train {name}", unit="step", leave=False)
    for _, batch in zip(bar, batches(windows, run["batch_size"], cfg["seed"])):
        loss = next_token_loss(model, batch)
        optimizer_step(model, optimizer, schedule, loss, run["grad_clip"])
        recent.add(loss.item())
        bar.set_postfix(loss=f"{recent.mean:.3f}")
    seconds = time.perf_counter() - start
    tokens = run["steps"] * run["batch_size"] * shape.window
    model.eval()
    encoding = getattr(model, "encoding", None)
    return model, {
        "params": count_parameters(model),
        "steps": run["steps"],
        "tokens": tokens,
        "seconds": round(seconds, 1),
        "cpu_seconds": round(time.process_time() - cpu_start, 1),
        "tokens_per_s": round(tokens / seconds),
        "final_loss": round(recent.mean, 4),
        "max_length": encoding.max_length if encoding is not None else None,
    }


def save_checkpoint(path: Path, name: str, shape: ModelShape, params: dict, model) -> None:
    torch.save({"encoding": name, "shape": shape.to_dict(), "params": params, "state_dict": model.state_dict()}, path)


def load_checkpoint(path: str | os.PathLike):
    ckpt = torch.load(path, weights_only=True)
    model = build_model(ckpt["encoding"], ModelShape(**ckpt["shape"]), 0, **ckpt["params"])
    model.load_state_dict(ckpt["state_dict"])
    return model.eval()
