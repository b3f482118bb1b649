"""The whole study: train one model per encoding, score every model at every length, and write
pe_study.json, pe_study.md and pe_study.png."""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from rope_ext.defaults import gutenberg_tokenizer

from .config import EXTENSION_LABELS, LABELS, model_shape
from .data import split_corpus, training_windows
from .measure import cpu_seconds, evaluate_cell, evaluation_pool
from .report import ARTICLE_CLAIMS, NOT_APPLICABLE, plot, render_markdown
from .train import save_checkpoint, train_encoding

OUTPUT_FILES = ("pe_study.json", "pe_study.md", "pe_study.png", "checkpoints")


def check_out_dir(out: Path, overwrite: bool) -> None:
    existing = [name for name in OUTPUT_FILES if (out / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{out} already holds {', '.join(existing)}; pass --overwrite or choose another --out")


def run_study(cfg: dict, out: Path, overwrite: bool = False) -> dict:
    """Train and score every row of `cfg` into `out` (its checkpoints); returns pe_study.json's
    content. Refuses to replace earlier results unless `overwrite`."""
    check_out_dir(out, overwrite)
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    torch.set_num_threads(cfg["threads"])
    tokenizer = gutenberg_tokenizer(vocab_size=cfg["data"]["tokenizer_vocab_size"])
    shape = model_shape(cfg, tokenizer)
    window = shape.window
    lengths = [window * m for m in cfg["eval"]["multiples"]]
    train_stream, eval_tokens = split_corpus(cfg, tokenizer)
    windows = training_windows(train_stream, window)

    ckpt_dir = out / "checkpoints"
    if overwrite and ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    ckpt_dir.mkdir(parents=True)
    rows: dict[str, dict] = {}
    for name in tqdm(list(cfg["encodings"]), desc="train encodings", unit="model"):
        model, log = train_encoding(name, cfg, shape, windows)
        save_checkpoint(ckpt_dir / f"{name}.pt", name, shape, cfg["encodings"][name] or {}, model)
        rows[name] = {"label": LABELS[name], **log, "cells": {}}
        tqdm.write(f"{name}: {log['params']:,} params, final loss {log['final_loss']}, {log['seconds']} s")
    extensions = cfg["eval"].get("rope_extensions") or {}
    for method in extensions:
        rows[f"rope+{method}"] = {"label": EXTENSION_LABELS[method], "extension": method, "cells": {}}

    cells = []
    for key, row in rows.items():
        for length in lengths:
            if row.get("max_length") is not None and length > row["max_length"]:
                row["cells"][str(length)] = {"na": NOT_APPLICABLE}
            elif row.get("extension") and length == window:
                row["cells"][str(length)] = {"same_as": "rope"}  # factor 1: every extension is the identity
            else:
                cells.append((key, length))
    threads = cfg["threads"]
    with evaluation_pool() as pool:
        for key, length in tqdm(cells, desc="evaluate", unit="cell"):
            method = rows[key].get("extension")
            checkpoint = ckpt_dir / f"{'rope' if method else key}.pt"
            params = (extensions[method] or {}) if method else {}
            n = len(eval_tokens) // length
            result = pool.apply(evaluate_cell, (str(checkpoint), method, params, length, eval_tokens[: n * length + 1], threads))
            rows[key]["cells"][str(length)] = result
            tqdm.write(
                f"{rows[key]['label']:<26} {length:>6}: ppl {result['ppl']:9.2f}  {result['peak_mb']:7.1f} MB  {result['tokens_per_s']:>7,} tok/s"
            )

    eval_cpu = sum(c.get("process_cpu_seconds", 0.0) for row in rows.values() for c in row["cells"].values())
    m = cfg["model"]
    return {
        "window": window,
        "lengths": lengths,
        "seed": cfg["seed"],
        "heldout": list(cfg["data"]["heldout"]),
        "eval_tokens": len(eval_tokens) - 1,
        "shape": shape.to_dict(),
        "shape_text": f"hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']} heads, SwiGLU {m['intermediate_size']}, vocab {shape.vocab_size}",
        "train": {k: cfg["train"][k] for k in ("steps", "batch_size", "lr", "warmup_steps")}
        | {"tokens": cfg["train"]["steps"] * cfg["train"]["batch_size"] * window},
        "rows": rows,
        "article_claims": ARTICLE_CLAIMS,
        "config": cfg,
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "threads": threads,
            "load_start": round(load_start, 2),
            "load_end": round(os.getloadavg()[0], 2),
            "memory_measure": "ru_maxrss delta in a fresh forked process per cell",
        },
        "wall_seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN) + eval_cpu, 1),
        "train_cpu_seconds": round(sum(row.get("cpu_seconds", 0.0) for row in rows.values()), 1),
        "eval_cpu_seconds": round(eval_cpu, 1),
    }


def write_results(results: dict, out: Path) -> str:
    """pe_study.json, pe_study.md and pe_study.png into `out`; returns the markdown."""
    (out / "pe_study.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = render_markdown(results)
    (out / "pe_study.md").write_text(markdown)
    plot(results, out / "pe_study.png")
    return markdown
