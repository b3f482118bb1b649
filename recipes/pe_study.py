"""Position-encoding study: train one small decoder per position encoding, compare extrapolation.

    python recipes/pe_study.py [--config recipes/configs/pe_study.yaml] [--out results/pe_study] [--overwrite]

Every encoding (learned absolute, sinusoidal, T5 relative bias, DeBERTa disentangled attention,
ALiBi, RoPE) gets the same LLaMA-shaped decoder, the same initial weights, the same training
windows in the same order, and the same number of steps, on the Gutenberg plays with window W.
Each is then scored on held-out plays at W, 2W, 4W, 8W; the RoPE model is also scored with the
training-free extensions of `rope_ext.patch` (factor = length / W) as extra rows.

Every evaluation cell (one model at one length) runs in a fresh process forked from a clean
server, so its peak memory is its own: ru_maxrss after the run minus ru_maxrss once the model is
loaded and warmed up. tracemalloc would miss torch's allocations and sampling RSS can miss short
peaks; the kernel's high-water mark misses nothing. tokens/s = scored tokens / wall time.

Writes pe_study.json, pe_study.md and pe_study.png into --out, plus the trained checkpoints, and
refuses to replace earlier results unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from datasets import Dataset
from tqdm import tqdm
from transformers import get_cosine_schedule_with_warmup

import rope_ext
from rope_ext.defaults import gutenberg_documents, gutenberg_tokenizer
from rope_ext.study.model import ENCODINGS, ModelShape, build_model, count_parameters

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "pe_study.yaml"
DEFAULT_OUT = Path("results") / "pe_study"
OUTPUT_FILES = ("pe_study.json", "pe_study.md", "pe_study.png", "checkpoints")

LABELS = {
    "learned": "Learned absolute (BERT)",
    "sinusoidal": "Sinusoidal (Transformer)",
    "t5": "T5 relative bias",
    "deberta": "DeBERTa disentangled",
    "alibi": "ALiBi",
    "rope": "RoPE (LLaMA)",
}
EXTENSION_LABELS = {"ntk": "RoPE + NTK", "dynamic": "RoPE + dynamic NTK", "yarn": "RoPE + YaRN"}
NOT_APPLICABLE = "n/a (no positions past W)"

# The seed articles' claims (PG19, models trained at 4K; memory at 16K), quoted for comparison.
ARTICLE_CLAIMS = {
    "window": 4096,
    "ppl": {"rope": [12.3, 14.7, 21.4], "alibi": [12.1, 13.5, 16.8]},  # at 1x, 2x, 4x
    "memory_gb_at_4x": {"rope": 18.2, "alibi": 15.7},
}


# ---------------------------------------------------------------------------------------- config


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
    if not multiples or multiples[0] != 1 or any(not isinstance(m, int) or m < 1 for m in multiples) or sorted(set(multiples)) != multiples:
        raise ValueError(f"config {path}: eval.multiples must be increasing integers starting at 1, got {multiples}")
    extensions = cfg["eval"].get("rope_extensions") or {}
    if not isinstance(extensions, dict):
        raise ValueError(f"config {path}: eval.rope_extensions must map method names to their parameters")
    if extensions and "rope" not in cfg["encodings"]:
        raise ValueError(f"config {path}: rope_extensions need the rope encoding")
    for method in extensions:
        if method not in EXTENSION_LABELS:
            raise ValueError(f"config {path}: rope extension {method!r} not supported here; choose from {', '.join(EXTENSION_LABELS)}")
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


# ------------------------------------------------------------------------------------------ data


def token_stream(tokenizer, stems: list[str]) -> torch.LongTensor:
    """The plays tokenized and concatenated, each followed by eos (no bos)."""
    docs = gutenberg_documents()
    ids: list[int] = []
    for stem in stems:
        ids.extend(tokenizer(docs[stem], add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def split_corpus(cfg: dict, tokenizer) -> tuple[torch.LongTensor, torch.LongTensor]:
    """(training stream, evaluation tokens): the held-out plays are never trained on, and the
    evaluation takes exactly eval_windows * longest length + 1 tokens from them."""
    stems = list(gutenberg_documents())
    heldout = list(cfg["data"]["heldout"])
    unknown = sorted(set(heldout) - set(stems))
    if unknown:
        raise ValueError(f"held-out play(s) {unknown} not in the corpus; choose from {stems}")
    train = token_stream(tokenizer, [s for s in stems if s not in heldout])
    held = token_stream(tokenizer, heldout)
    need = cfg["data"]["eval_windows"] * cfg["train"]["window"] * cfg["eval"]["multiples"][-1] + 1
    if len(held) < need:
        raise ValueError(f"held-out plays give {len(held)} tokens, the evaluation needs {need}: add plays or lower eval_windows")
    return train, held[:need]


def training_windows(stream: torch.LongTensor, window: int) -> Dataset:
    """Non-overlapping training sequences of window + 1 tokens (inputs plus the next token)."""
    return Dataset.from_dict({"input_ids": stream.unfold(0, window + 1, window).tolist()}).with_format("torch")


def batches(windows: Dataset, batch_size: int, seed: int):
    """Batches of shuffled windows, reshuffled every epoch, identical for every encoding."""
    epoch = 0
    while True:
        for batch in windows.shuffle(seed=seed + epoch).iter(batch_size=batch_size, drop_last_batch=True):
            yield batch["input_ids"]
        epoch += 1


# ------------------------------------------------------------------------------------------ train


def next_token_loss(model, tokens: torch.LongTensor, reduction: str = "mean") -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction=reduction)


def train_encoding(name: str, cfg: dict, shape: ModelShape, windows: Dataset) -> tuple[torch.nn.Module, dict]:
    run = cfg["train"]
    model = build_model(name, shape, cfg["seed"], **(cfg["encodings"][name] or {}))
    # Norm gains and biases are not decayed: shrinking them only fights the normalisation.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": run["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=run["lr"],
        betas=tuple(run["betas"]),
    )
    schedule = get_cosine_schedule_with_warmup(optimizer, run["warmup_steps"], run["steps"])
    torch.manual_seed(cfg["seed"])
    model.train()
    recent: list[float] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    bar = tqdm(range(run["steps"]), desc=f"train {name}", unit="step", leave=False)
    for _, batch in zip(bar, batches(windows, run["batch_size"], cfg["seed"])):
        loss = next_token_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run["grad_clip"])
        optimizer.step()
        schedule.step()
        recent = (recent + [loss.item()])[-20:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
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
        "final_loss": round(sum(recent) / len(recent), 4),  # mean of the last 20 steps
        "max_length": encoding.max_length if encoding is not None else None,
    }


def save_checkpoint(path: Path, name: str, shape: ModelShape, params: dict, model) -> None:
    torch.save({"encoding": name, "shape": shape.to_dict(), "params": params, "state_dict": model.state_dict()}, path)


def load_checkpoint(path: str | os.PathLike):
    ckpt = torch.load(path, weights_only=True)
    model = build_model(ckpt["encoding"], ModelShape(**ckpt["shape"]), 0, **ckpt["params"])
    model.load_state_dict(ckpt["state_dict"])
    return model.eval()


# ------------------------------------------------------------------------------------------- eval


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def evaluate_cell(
    checkpoint: str, method: str | None, params: dict, length: int, tokens: torch.LongTensor, threads: int
) -> dict:
    """Perplexity, throughput and peak memory of one model at one length; run in a fresh process.

    `tokens` holds n * length + 1 tokens: n non-overlapping windows, each scored on every token."""
    torch.set_num_threads(threads)
    model = load_checkpoint(checkpoint)
    patch = None
    if method is not None:
        info = rope_ext.patch(model, method, factor=length / model.config.max_position_embeddings, **params)
        patch = {"method": info.method, "factor": info.factor, "params": info.params, "max_length": info.max_length}
    windows = tokens[:-1].view(-1, length)
    targets = tokens[1:].view(-1, length)
    with torch.inference_mode():
        model(input_ids=windows[:1, :8])  # warm-up: thread pool and allocator, not part of the peak
        baseline = max_rss_mb()
        nll = 0.0
        start = time.perf_counter()
        for inputs, labels in zip(windows, targets):
            logits = model(input_ids=inputs[None]).logits[0]
            nll += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        seconds = time.perf_counter() - start
    peak = max_rss_mb()
    # the whole process, model loading included: evaluation processes are grandchildren of the
    # study (children of the fork server), so RUSAGE_CHILDREN there would never see them
    process_cpu = cpu_seconds()
    return {
        "ppl": math.exp(nll / targets.numel()),
        "nll": nll / targets.numel(),
        "tokens": targets.numel(),
        "windows": len(windows),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(targets.numel() / seconds),
        "peak_mb": round(peak - baseline, 1),
        "process_peak_mb": round(peak, 1),
        "process_cpu_seconds": round(process_cpu, 2),
        "patch": patch,
    }


def evaluation_pool():
    """A pool whose every task runs in a new process forked from a server that has imported torch
    but never computed anything: each cell starts from the same clean memory state."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", "transformers", "rope_ext.study.model"])
    return context.Pool(1, maxtasksperchild=1)


# ---------------------------------------------------------------------------------------- output


def cell_text(cell: dict, key: str, fmt: str) -> str:
    if "na" in cell:
        return NOT_APPLICABLE
    if "same_as" in cell:
        return "= RoPE"
    return format(cell[key], fmt)


def render_markdown(results: dict) -> str:
    window = results["window"]
    lengths = results["lengths"]
    head = " | ".join(f"{n} ({n // window}x)" for n in lengths)
    sep = "|---" * (len(lengths) + 2) + "|"
    lines = [
        f"# Position-encoding study (W = {window} tokens)",
        "",
        f"Same LLaMA-shaped decoder for every row ({results['shape_text']}), same initial weights, "
        f"{results['train']['steps']} steps x {results['train']['batch_size']} windows of W tokens "
        f"({results['train']['tokens']:,} training tokens, seed {results['seed']}), Gutenberg plays minus "
        f"{', '.join(results['heldout'])}. Each cell scores the same {results['eval_tokens']:,} held-out tokens "
        f"in non-overlapping windows of the column's length.",
        "",
        "## Perplexity",
        "",
        f"| encoding | params | {head} |",
        sep,
    ]
    for key, row in results["rows"].items():
        cells = " | ".join(cell_text(row["cells"][str(n)], "ppl", ".2f") for n in lengths)
        params = f"{row['params'] / 1e6:.3f}M" if "params" in row else "as RoPE"
        lines.append(f"| {row['label']} | {params} | {cells} |")
    lines += [
        "",
        "## Training (same steps, windows and initial weights for every row)",
        "",
        "| encoding | params | final train loss | train time (s) | train CPU (s) |",
        "|---|---|---|---|---|",
    ]
    for key, row in results["rows"].items():
        if "final_loss" in row:
            lines.append(
                f"| {row['label']} | {row['params']:,} | {row['final_loss']:.3f} | {row['seconds']:.0f} | {row['cpu_seconds']:.0f} |"
            )
    for title, field, fmt in (("Peak memory of the evaluation (MB above the loaded model)", "peak_mb", ".1f"),
                              ("Throughput (scored tokens/s)", "tokens_per_s", ",")):
        lines += ["", f"## {title}", "", f"| encoding | {head} |", "|---" * (len(lengths) + 1) + "|"]
        for row in results["rows"].values():
            cells = " | ".join(cell_text(row["cells"][str(n)], field, fmt) for n in lengths)
            lines.append(f"| {row['label']} | {cells} |")
    lines += ["", "## Against the articles' claims", "", *claims_comparison(results), "", "## How this was measured", ""]
    env = results["environment"]
    lines += [
        f"- Perplexity: exp of the mean next-token NLL over all scored tokens, one window per forward.",
        f"- Peak memory: each cell runs in a fresh process forked from a clean server; the number is "
        f"ru_maxrss (the kernel's RSS high-water mark) after the cell minus ru_maxrss once the model is "
        f"loaded and warmed up. It covers activations, attention biases and logits; the weights are in the "
        f"baseline. tracemalloc does not see torch's allocations and RSS sampling can miss short peaks.",
        f"- Throughput: scored tokens / wall time of the cell, batch 1, torch threads: {env['threads']}.",
        f"- Machine: {env['cpus']} CPUs, torch {env['torch']}, transformers {env['transformers']}; load "
        f"average {env['load_start']} at start, {env['load_end']} at the end (other work shares this machine, "
        f"so throughput is indicative).",
        f"- Wall time {results['wall_seconds'] / 60:.1f} min; CPU time {results['cpu_seconds'] / 60:.1f} min "
        f"({results['train_cpu_seconds'] / 60:.1f} training, {results['eval_cpu_seconds'] / 60:.1f} in the "
        f"evaluation processes, the rest data preparation and bookkeeping).",
    ]
    return "\n".join(lines) + "\n"


def claims_comparison(results: dict) -> list[str]:
    """The articles' RoPE-vs-ALiBi numbers next to ours, as ratios to the 1x value: absolute
    perplexities of 4K-window PG19 models and of tiny Shakespeare models are not comparable,
    the growth with length is."""
    window, rows = results["window"], results["rows"]
    lines = [
        f"The articles: PG19, trained at {ARTICLE_CLAIMS['window']} tokens. Here: Gutenberg plays, W = {window}. "
        "Ratios are perplexity at the length over perplexity at 1x.",
        "",
        "| | articles 1x / 2x / 4x | articles ratio 2x, 4x | measured 1x / 2x / 4x | measured ratio 2x, 4x |",
        "|---|---|---|---|---|",
    ]
    for key in ("rope", "alibi"):
        claim = ARTICLE_CLAIMS["ppl"][key]
        if key not in rows or any(str(window * m) not in rows[key]["cells"] for m in (1, 2, 4)):
            continue
        ours = [rows[key]["cells"][str(window * m)]["ppl"] for m in (1, 2, 4)]
        lines.append(
            f"| {LABELS[key]} | {' / '.join(f'{v:.1f}' for v in claim)} | {claim[1] / claim[0]:.2f}, {claim[2] / claim[0]:.2f} "
            f"| {' / '.join(f'{v:.2f}' for v in ours)} | {ours[1] / ours[0]:.2f}, {ours[2] / ours[0]:.2f} |"
        )
    if "rope" in rows and "alibi" in rows and str(4 * window) in rows["rope"]["cells"]:
        rope, alibi = (rows[k]["cells"][str(4 * window)]["peak_mb"] for k in ("rope", "alibi"))
        claim = ARTICLE_CLAIMS["memory_gb_at_4x"]
        lines += [
            "",
            f"Memory at 4x: the articles claim ALiBi/RoPE = {claim['alibi']} / {claim['rope']} GB = "
            f"{claim['alibi'] / claim['rope']:.2f}; measured {alibi:.1f} / {rope:.1f} MB = {alibi / rope:.2f}.",
        ]
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, row in results["rows"].items():
        cells = row["cells"]
        if row.get("extension"):  # at 1x an extension is plain RoPE: start its line there
            cells = {**cells, str(results["window"]): results["rows"]["rope"]["cells"][str(results["window"])]}
        points = sorted((int(n), c["ppl"]) for n, c in cells.items() if "ppl" in c)
        xs, ys = zip(*points)
        label = row["label"] + (" (W only)" if len(points) == 1 else "")
        ax.plot(xs, ys, marker="o", linestyle="--" if row.get("extension") else "-", label=label)
    ax.axvline(results["window"], color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xticks(results["lengths"], [f"{n}\n({n // results['window']}x)" for n in results["lengths"]])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity (held-out plays, log scale)")
    ax.set_title(f"Perplexity vs length, trained at W = {results['window']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- main


def check_out_dir(out: Path, overwrite: bool) -> None:
    existing = [name for name in OUTPUT_FILES if (out / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{out} already holds {', '.join(existing)}; pass --overwrite or choose another --out")


def run_study(cfg: dict, out: Path, overwrite: bool = False) -> dict:
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
            tqdm.write(f"{rows[key]['label']:<26} {length:>6}: ppl {result['ppl']:9.2f}  {result['peak_mb']:7.1f} MB  {result['tokens_per_s']:>7,} tok/s")

    import transformers

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    out = Path(args.out)
    results = run_study(cfg, out, args.overwrite)
    (out / "pe_study.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = render_markdown(results)
    (out / "pe_study.md").write_text(markdown)
    plot(results, out / "pe_study.png")
    print(markdown)
    print(f"results in {out}/: pe_study.json, pe_study.md, pe_study.png", file=sys.stderr)


if __name__ == "__main__":
    main()
