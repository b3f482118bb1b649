"""The figures the eval commands save (matplotlib, Agg backend: no display needed).

Every figure keeps its legend outside the axes, so no curve hides behind it, and names the model in
its title. Perplexity axes are linear and clipped: one method that breaks (plain RoPE past its
window, linear interpolation without fine-tuning) reaches hundreds and would squash every other
curve into one band, so the axis stops at CLIP times the lowest value and the legend gives the
peak of each curve that leaves it. Heatmaps use cividis, readable with any colour vision and in
greyscale."""

from __future__ import annotations

import itertools
import math
import re

from rope_ext.extras import require

require("plots", "rope_ext.evals.plots (the figures)")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, MaxNLocator  # noqa: E402

CLIP = 2.0  # top of a perplexity axis, as a multiple of the lowest value plotted
MARKERS = "osD^vP*Xph"
LINESTYLES = ("-", "--", "-.", ":")


def model_name(label: str) -> str:
    """A checkpoint label without the content hash rope-ext puts in the folders it caches
    ("smollm2-135m-847fbcc544" -> "smollm2-135m")."""
    return re.sub(r"-[0-9a-f]{8,}$", "", label)


def _styles():
    """Marker and line style per curve, so curves differ by more than their colour."""
    return zip(itertools.cycle(MARKERS), itertools.cycle(LINESTYLES))


def _mark_window(ax, window: int | None) -> None:
    """A vertical line at the trained window, named in the legend."""
    if window:
        ax.axvline(window, color="black", linestyle="--", linewidth=1, label=f"trained window ({window} tokens)")


def _ppl_panels(panels: list[tuple], window: int | None) -> None:
    """Draw (ax, {label: (x, ppl)}) panels on one linear perplexity range, clipped at CLIP x the
    lowest value, and put the legend outside the last panel, with the peak of every curve that
    leaves the range."""
    values = [v for _, curves in panels for _, y in curves.values() for v in y]
    lowest, highest = min(values), max(values)
    top = min(CLIP * lowest, 1.05 * highest)
    for ax, curves in panels:
        for (label, (x, y)), (marker, style) in zip(curves.items(), _styles()):
            ax.plot(x, y, marker=marker, linestyle=style, markersize=4, label=label)
        _mark_window(ax, window)
        ax.set_ylim(0.95 * lowest, top)
        ax.set_ylabel("perplexity" + (f" (axis clipped at {CLIP:g}x the lowest)" if highest > top else ""))
        ax.grid(alpha=0.3)
    peaks = {label: max(max(curves[label][1]) for _, curves in panels if label in curves) for label in panels[0][1]}
    last = panels[-1][0]
    handles, labels = last.get_legend_handles_labels()
    last.legend(
        handles,
        [f"{label} (peak {peaks[label]:.0f}, off the axis)" if peaks.get(label, 0) > top else label for label in labels],
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0,
        fontsize=8,
    )


def _position_panel(ax, curves: dict[str, list[dict]]) -> tuple:
    ax.set_xlim(0, max(b["end"] for buckets in curves.values() for b in buckets))
    ax.xaxis.set_major_locator(MaxNLocator(6, integer=True))
    ax.set_xlabel("position of the scored token in its window (bucket centre)")
    return ax, {
        label: ([(b["start"] + b["end"]) / 2 for b in buckets], [b["ppl"] for b in buckets]) for label, buckets in curves.items()
    }


def _length_panel(ax, ppl: dict[str, dict[int, float]]) -> tuple:
    ax.set_xscale("log", base=2)
    ticks = sorted({int(n) for by_length in ppl.values() for n in by_length})
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("evaluation length (tokens)")
    return ax, {
        label: (sorted(int(n) for n in by_length), [by_length[n] for n in sorted(by_length, key=int)])
        for label, by_length in ppl.items()
    }


def ppl_by_position(curves: dict[str, list[dict]], window: int | None, title: str):
    """PPL against the position of the scored token, one line per curve: {label: buckets}, each
    bucket {"start", "end", "ppl"} (the `buckets` of a perplexity result)."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    _ppl_panels([_position_panel(ax, curves)], window)
    ax.set_title(title)
    return fig


def bucket_plot(results: dict, title: str, window: int | None = None):
    """PPL against position in the window, one line per evaluated length."""
    return ppl_by_position({f"length {n}": results[n]["buckets"] for n in sorted(results)}, window, title)


def _heatmap(fig, ax, rows: dict, columns: list, ylabel: str, xlabel: str, title: str) -> None:
    """Accuracy in [0, 1] per (row, column): {row: {column: accuracy}}, NaN where absent."""
    grid = [[rows[r].get(c, float("nan")) for c in columns] for r in rows]
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="cividis", aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(
                j,
                i,
                "-" if math.isnan(value) else f"{value:.2f}",
                ha="center",
                va="center",
                fontsize=8,
                color="black" if value > 0.5 else "white",
            )
    ax.set_xticks(range(len(columns)), [str(c) for c in columns])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy")


def passkey_heatmap(accuracy: dict, model: str, method: str):
    """Accuracy per (length, depth) of one method: {length: {depth: accuracy}} (keys may be the
    strings a JSON file holds); depth on y, length on x."""
    table = {int(n): {float(d): a for d, a in row.items()} for n, row in accuracy.items()}
    lengths = sorted(table)
    depths = sorted({d for row in table.values() for d in row})
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 3.5, 0.45 * len(depths) + 2))
    _heatmap(
        fig,
        ax,
        {f"{d:g}": {n: table[n].get(d, float("nan")) for n in lengths} for d in depths},
        lengths,
        "depth of the key",
        "prompt length (tokens)",
        f"{model_name(model)}, {method}: passkey retrieval",
    )
    return fig


def compare_figure(report: dict):
    """The figure of a `rope-ext compare` report (compare.json): PPL vs length and PPL by position
    at the longest length side by side, and below them, when the report has them, passkey accuracy
    per method and length (over depths and trials) and the RULER task's score per method and
    length, side by side when both are there."""
    setup, methods = report["setup"], report["methods"]
    labels = [m["label"] + ("" if m["factor"] is None else f" x{m['factor']:g}") for m in methods]
    longest = str(max(int(n) for n in methods[0]["ppl"]))
    heatmaps = []  # (title, {label: {length: score in [0, 1]}})
    if all(m.get("passkey") for m in methods):
        heatmaps.append(
            (
                "passkey retrieval",
                {label: {int(n): a for n, a in m["passkey"]["by_length"].items()} for label, m in zip(labels, methods)},
            )
        )
    if all(m.get("ruler") for m in methods):
        heatmaps.append(
            (
                f"RULER {setup['ruler']['task']}",
                {label: {int(n): a for n, a in m["ruler"]["by_length"].items()} for label, m in zip(labels, methods)},
            )
        )
    below = 0.3 * len(methods) + 1.5
    fig = plt.figure(figsize=(15, 5 + (below if heatmaps else 0)), layout="constrained")
    grid = fig.add_gridspec(2 if heatmaps else 1, 2, height_ratios=[5, below] if heatmaps else None)
    by_length, by_position = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    _ppl_panels(
        [
            _length_panel(
                by_length, {label: {int(n): r["ppl"] for n, r in m["ppl"].items()} for label, m in zip(labels, methods)}
            ),
            _position_panel(by_position, {label: m["ppl"][longest]["buckets"] for label, m in zip(labels, methods)}),
        ],
        setup["original_window"],
    )
    by_length.set_title("perplexity vs length")
    by_position.set_title(f"perplexity by position, {longest} tokens")
    for column, (title, table) in enumerate(heatmaps):
        ax = fig.add_subplot(grid[1, column] if len(heatmaps) == 2 else grid[1, :])
        _heatmap(fig, ax, table, sorted({n for row in table.values() for n in row}), "method", "prompt length (tokens)", title)
    fig.suptitle(f"{model_name(setup['model'])}: rope-ext compare")
    return fig


# (x label, y label, y scale): dpe's scales are powers of two, spread evenly on a log2 axis
SEARCHED = {
    "long_factor": ("rotated pair i (higher: lower frequency)", "rescale factor lambda_i", "linear"),
    "scales": ("group of frequency pairs g (higher: lower frequency)", "position scale s_g", "log2"),
}


def search_figure(records: list[dict], space: str, dimension: str, best, seeds: dict, model: str):
    """`rope-ext search`'s log: each evaluation's answer loss (log axis: PI's and NTK's losses are
    tens of times the best), marked by how the candidate was made, with the best so far; beside
    it the best values of the space's first `dimension` against the seeds' (per pair or group for
    a list, the loss against the value for a number; dpe's power-of-two scales on a log2 axis)."""
    fig, (losses, factors) = plt.subplots(1, 2, figsize=(12, 4.5))
    origins = sorted({r["origin"] for r in records})
    for (marker, _), origin in zip(_styles(), origins):
        mine = [r for r in records if r["origin"] == origin]
        losses.scatter([r["evaluation"] for r in mine], [r["loss"] for r in mine], marker=marker, label=origin)
    best_so_far = list(itertools.accumulate((r["loss"] for r in records), min))
    losses.step([r["evaluation"] for r in records], best_so_far, where="post", color="black", label="best so far")
    for previous, record in zip(records, records[1:]):
        if record["generation"] != previous["generation"]:
            losses.axvline(record["evaluation"] - 0.5, color="grey", linewidth=0.6, linestyle=":")
    losses.set(yscale="log", xlabel="evaluation (dotted: a new generation)", ylabel="answer loss (nats / token)")
    losses.xaxis.set_major_locator(MaxNLocator(integer=True))
    losses.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if dimension in SEARCHED:
        pairs = range(len(best))
        for (marker, style), (name, values) in zip(_styles(), seeds.items()):
            factors.plot(pairs, values, marker=marker, linestyle=style, markersize=3, label=name)
        factors.plot(pairs, best, color="black", marker="o", markersize=4, label="best found")
        xlabel, ylabel, scale = SEARCHED[dimension]
        factors.set(xlabel=xlabel, ylabel=ylabel)
        if scale == "log2":
            factors.set_yscale("log", base=2)
            factors.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        factors.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    else:
        factors.scatter([r[dimension] for r in records], [r["loss"] for r in records], marker=".", color="grey")
        factors.axvline(best, color="black", label="best found")
        factors.set(yscale="log", xlabel=dimension, ylabel="answer loss (nats / token)")
        factors.legend(fontsize=8)
    fig.suptitle(f"{model_name(model)}: {space} search, {len(records)} evaluations")
    fig.tight_layout()
    return fig


def passkey_sweep(runs: dict):
    """Dense passkey sweeps side by side, the needle-in-a-haystack picture: one column per run
    ({label: a passkey result, its `trials`}), one row per key depth, colour = the share of that
    depth's keys (every seed and trial) answered; each column's label carries its count and 95%
    interval over all depths."""
    from .retrieval import counts

    columns, table = [], {}
    for label, result in runs.items():
        c = counts(result["trials"])
        column = f"{label}\n{c['correct']}/{c['total']} ({c['interval'][0]:.2f}-{c['interval'][1]:.2f})"
        columns.append(column)
        for trial in result["trials"]:
            table.setdefault(float(trial["depth"]), {}).setdefault(column, []).append(bool(trial["correct"]))
    rows = {f"{d:g}": {c: sum(v) / len(v) for c, v in table[d].items()} for d in sorted(table)}
    fig, ax = plt.subplots(figsize=(2.3 * len(columns) + 2.5, 0.32 * len(rows) + 2.2))
    _heatmap(
        fig, ax, rows, columns, "depth of the key", "run (correct of all keys, 95% interval)", "passkey retrieval by key depth"
    )
    return fig
