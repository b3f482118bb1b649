"""The study's report: the markdown tables, the comparison with the articles' claims, the plot."""

from __future__ import annotations

from pathlib import Path

from .config import LABELS

NOT_APPLICABLE = "n/a (no positions past W)"

# The seed articles' claims (PG19, models trained at 4K; memory at 16K), quoted for comparison.
ARTICLE_CLAIMS = {
    "window": 4096,
    "ppl": {"rope": [12.3, 14.7, 21.4], "alibi": [12.1, 13.5, 16.8]},  # at 1x, 2x, 4x
    "memory_gb_at_4x": {"rope": 18.2, "alibi": 15.7},
}


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
    for row in results["rows"].values():
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
    for row in results["rows"].values():
        if "final_loss" in row:
            lines.append(
                f"| {row['label']} | {row['params']:,} | {row['final_loss']:.3f} | {row['seconds']:.0f} | {row['cpu_seconds']:.0f} |"
            )
    for title, field, fmt in (
        ("Peak memory of the evaluation (MB above the loaded model)", "peak_mb", ".1f"),
        ("Throughput (scored tokens/s)", "tokens_per_s", ","),
    ):
        lines += ["", f"## {title}", "", f"| encoding | {head} |", "|---" * (len(lengths) + 1) + "|"]
        for row in results["rows"].values():
            cells = " | ".join(cell_text(row["cells"][str(n)], field, fmt) for n in lengths)
            lines.append(f"| {row['label']} | {cells} |")
    lines += ["", "## Against the articles' claims", "", *claims_comparison(results), "", "## How this was measured", ""]
    env = results["environment"]
    lines += [
        "- Perplexity: exp of the mean next-token NLL over all scored tokens, one window per forward.",
        "- Peak memory: each cell runs in a fresh process forked from a clean server; the number is "
        "ru_maxrss (the kernel's RSS high-water mark) after the cell minus ru_maxrss once the model is "
        "loaded and warmed up. It covers activations, attention biases and logits; the weights are in the "
        "baseline. tracemalloc does not see torch's allocations and RSS sampling can miss short peaks.",
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
    for row in results["rows"].values():
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
