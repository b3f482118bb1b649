"""The figures the eval commands save (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _mark_window(ax, window: int | None) -> None:
    if window:
        ax.axvline(window, color="grey", linestyle="--", linewidth=1)
        ax.text(window, 1.0, f" original window {window}", transform=ax.get_xaxis_transform(),
                color="grey", fontsize=8, va="top")


def bucket_plot(results: dict, title: str, window: int | None = None):
    """PPL against position in the window, one line per evaluated length."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for length in sorted(results):
        buckets = results[length]["buckets"]
        ax.plot([(b["start"] + b["end"]) / 2 for b in buckets], [b["ppl"] for b in buckets], marker="o", label=f"length {length}")
    _mark_window(ax, window)
    ax.set_yscale("log")
    ax.set_xlabel("position of the scored token in its window")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def ppl_vs_length(ppl: dict[str, dict[int, float]], window: int | None = None, title: str = "Perplexity vs length"):
    """One line per method: {method: {length: ppl}}."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for method, by_length in ppl.items():
        lengths = sorted(by_length)
        ax.plot(lengths, [by_length[n] for n in lengths], marker="o", label=method)
    _mark_window(ax, window)
    ax.set_xscale("log", base=2)
    ticks = sorted({n for by_length in ppl.values() for n in by_length})
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    return fig


def passkey_heatmap(accuracy: dict[int, dict[float, float]], title: str = "Passkey retrieval"):
    """Accuracy per (length, depth): {length: {depth: accuracy}}; depth on y, length on x."""
    lengths = sorted(accuracy)
    depths = sorted({d for row in accuracy.values() for d in row})
    grid = [[accuracy[n].get(d, float("nan")) for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.5 * len(depths) + 2))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, "-" if value != value else f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("depth of the key")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy")
    return fig
