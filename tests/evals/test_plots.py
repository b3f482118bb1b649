"""The eval figures: legend outside the axes, a linear perplexity axis clipped so that one broken
method does not squash the others, the trained window marked, model and method in the titles, a
search's power-of-two scales on a log2 axis."""

from __future__ import annotations


from rope_ext.evals import plots


def buckets(values, width=1024):
    return [{"start": i * width, "end": (i + 1) * width, "tokens": width, "ppl": v} for i, v in enumerate(values)]


def report(passkey: bool) -> dict:
    """A compare.json of three methods, one of which breaks past the window."""
    methods = []
    for label, factor, values in (("plain", None, [30, 31, 400]), ("yarn", 2.0, [32, 33, 34]), ("ntk", 2.0, [31, 32, 36])):
        ppl = {"1024": {"ppl": values[0], "buckets": buckets(values[:1])}, "3072": {"ppl": values[2], "buckets": buckets(values)}}
        methods.append(
            {"label": label, "factor": factor, "ppl": ppl, "passkey": {"by_length": {1024: 1.0, 3072: 0.4}} if passkey else None}
        )
    return {"setup": {"model": "smollm2-135m-847fbcc544", "original_window": 2048}, "methods": methods}


def assert_legend_outside(fig):
    """The figure's one legend overlaps none of its axes."""
    fig.canvas.draw()
    (legend,) = [a.get_legend() for a in fig.axes if a.get_legend() is not None]
    renderer = fig.canvas.get_renderer()
    assert not any(legend.get_window_extent(renderer).overlaps(a.get_window_extent(renderer)) for a in fig.axes)


def test_compare_figure_keeps_the_legend_out_and_clips_the_broken_curve():
    fig = plots.compare_figure(report(passkey=False))
    assert fig.get_suptitle() == "smollm2-135m: rope-ext compare"  # no cache hash
    by_length, by_position = fig.axes
    assert_legend_outside(fig)
    for ax in (by_length, by_position):
        assert ax.get_yscale() == "linear"
        low, high = ax.get_ylim()
        assert high <= plots.CLIP * 30 and low < 30  # plain's 400 is off the axis, the rest fill it
        assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_label().startswith("trained")] == [2048]
    labels = [t.get_text() for t in by_position.get_legend().get_texts()]
    assert labels == ["plain (peak 400, off the axis)", "yarn x2", "ntk x2", "trained window (2048 tokens)"]


def test_bucket_plot_keeps_the_legend_out():
    results = {1024: {"buckets": buckets([30, 31])}, 2048: {"buckets": buckets([30, 31])}}
    assert_legend_outside(plots.bucket_plot(results, "tiny, yarn x2: PPL by position", window=1024))


def test_passkey_heatmaps_name_model_and_method():
    fig = plots.passkey_heatmap({"1024": {"0.5": 1.0, "0.1": 0.0}}, "tiny-caa8bb5123e9", "yarn x2")
    (ax, _colorbar) = fig.axes
    assert ax.get_title() == "tiny, yarn x2: passkey retrieval"
    assert ax.images[0].get_cmap().name == "cividis"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0.1", "0.5"]
    compare = plots.compare_figure(report(passkey=True))
    assert_legend_outside(compare)
    ax = compare.axes[2]
    assert ax.get_title() == "passkey retrieval" and compare.get_suptitle().startswith("smollm2-135m")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["plain", "yarn x2", "ntk x2"]
    assert ax.images[0].get_cmap().name == "cividis"


def test_a_sweep_figure_puts_runs_side_by_side_with_each_depth_over_every_seed():
    def run(correct):  # {(depth, seed): answered}
        return {"trials": [{"depth": d, "seed": s, "correct": c} for (d, s), c in correct.items()]}

    fig = plots.passkey_sweep(
        {
            "plain 8k": run({(0.05, 0): True, (0.05, 1): True, (0.2, 0): True, (0.2, 1): False}),
            "rerope x4 32k": run({(0.05, 0): True, (0.05, 1): True, (0.2, 0): False, (0.2, 1): False}),
        }
    )
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0.05", "0.2"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["plain 8k\n3/4 (0.30-0.95)", "rerope x4 32k\n2/4 (0.15-0.85)"]
    assert ax.images[0].get_array().tolist() == [[1.0, 1.0], [0.5, 0.0]]


def search_records(dimension: str, values: list) -> list[dict]:
    return [
        {"evaluation": i, "generation": i // 2, "origin": "mutation" if i else "uniform", dimension: v, "loss": 1.0 / (i + 1)}
        for i, v in enumerate(values)
    ]


def test_search_figure_spreads_dpe_s_power_of_two_scales_on_a_log2_axis_labelled_in_plain_numbers():
    best, seeds = [4, 4, 8, 16], {"uniform": [8] * 4, "preset": [1, 1, 4, 32]}
    fig = plots.search_figure(search_records("scales", [[8] * 4, best]), "dpe", "scales", best, seeds, "smollm2-135m-847fbcc544")
    losses, scales = fig.axes
    assert fig.get_suptitle() == "smollm2-135m: dpe search, 2 evaluations"
    assert losses.get_yscale() == "log" and scales.get_yscale() == "log"
    assert scales.yaxis.get_transform().base == 2
    fig.canvas.draw()
    low, high = scales.get_ylim()
    labels = [t.get_text() for t in scales.get_yticklabels() if low <= t.get_position()[1] <= high]
    assert labels == ["1", "2", "4", "8", "16", "32"]
    assert [line.get_label() for line in scales.get_lines()] == ["uniform", "preset", "best found"]
    # longrope's factors are not powers of two: their axis stays linear
    fig = plots.search_figure(search_records("long_factor", [[1.0, 2.0]]), "longrope", "long_factor", [1.0, 2.0], {}, "tiny")
    assert fig.axes[1].get_yscale() == "linear"
