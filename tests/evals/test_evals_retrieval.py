"""The retrieval protocol (evals/retrieval.py): Wilson intervals, and the retained retrieval of a
patched run against the unpatched model's baseline run at its trained window."""

from __future__ import annotations

import json

import pytest

import rope_ext
from rope_ext import cli
from rope_ext.evals import retrieval

TRAINED = 128  # the tiny model's window


@pytest.mark.parametrize(
    "correct, total, expected",
    [
        (8, 10, (0.4902, 0.9433)),  # Wilson's interval at 95%, computed by hand from its formula
        (0, 10, (0.0, 0.2775)),
        (10, 10, (0.7225, 1.0)),
        (16, 20, (0.5840, 0.9193)),
    ],
)
def test_wilson_interval(correct, total, expected):
    low, high = retrieval.wilson(correct, total)
    assert (low, high) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("correct, total", [(0, 0), (3, 2), (-1, 4)])
def test_wilson_refuses_impossible_counts(correct, total):
    with pytest.raises(ValueError, match="correct <= total"):
        retrieval.wilson(correct, total)


def run_passkey(tiny_path, out, *extra) -> dict:
    argv = [
        "--model",
        str(tiny_path),
        "--depths",
        "0.2",
        "0.8",
        "--trials",
        "2",
        "--seeds",
        "0",
        "--max-new-tokens",
        "6",
        "--no-progress",
        "--output",
        str(out),
        *extra,
    ]
    assert cli.call(["eval", "passkey"] + argv) == 0
    return json.loads((out / "passkey.json").read_text())


def test_a_patched_run_reports_its_retained_retrieval_against_the_baseline(tiny_path, tmp_path):
    base = run_passkey(tiny_path, tmp_path / "plain", "--lengths", str(TRAINED))
    assert base["counts_overall"]["total"] == 4 and base["counts"]["128"]["interval"] == list(
        retrieval.wilson(base["counts"]["128"]["correct"], 4)
    )
    result = run_passkey(
        tiny_path,
        tmp_path / "yarn",
        "--lengths",
        "200",
        "256",
        "--method",
        "yarn",
        "--factor",
        "2",
        "--baseline",
        str(tmp_path / "plain"),
    )
    baseline = result["baseline"]
    assert baseline["length"] == TRAINED and baseline["total"] == 4
    assert baseline["accuracy"] == base["accuracy_overall"] and baseline["path"].endswith("plain/passkey.json")
    for n in ("200", "256"):
        expected = None if base["accuracy_overall"] == 0 else result["by_length"][n] / base["accuracy_overall"]
        assert result["retained"][n] == expected
        counts = result["counts"][n]
        assert counts["total"] == 4 and counts["accuracy"] == result["by_length"][n]
    table = (tmp_path / "yarn" / "passkey.md").read_text()
    assert "retained" in table and "95% interval" in table and f"{TRAINED}-token window" in table


def baseline_file(
    path,
    method="plain",
    depths=(0.2, 0.8),
    trials=2,
    seed=0,
    lengths=(TRAINED,),
    model=None,
    wrong_from=None,
    max_new_tokens=6,
    limit=None,
):
    trials_ = [
        {"length": n, "depth": d, "trial": t, "correct": wrong_from is None or t < wrong_from}
        for n in lengths
        for d in depths
        for t in range(trials)
    ][:limit]
    path.mkdir()
    setup = {"model": model, "method": method, "trials": trials, "seed": seed, "max_new_tokens": max_new_tokens, "limit": limit}
    (path / "passkey.json").write_text(json.dumps({"setup": setup, "trials": trials_}))
    return path


@pytest.mark.parametrize(
    "change, words",
    [
        ({"depths": (0.5,)}, "other depths"),
        ({"trials": 1}, "other trials"),
        ({"seed": 7}, "other seeds"),
        ({"method": "yarn"}, "the baseline is the unpatched model"),
        ({"lengths": (128, 256)}, "the baseline is one length"),
        ({"max_new_tokens": 3}, "other max_new_tokens"),
        ({"limit": 3}, "holds fewer than 2 trials at depths [0.8] (a run stopped by --limit 3?)"),
    ],
)
def test_a_baseline_that_does_not_match_is_refused_before_the_model_loads(no_model, tmp_path, capsys, change, words):
    base = baseline_file(tmp_path / "base", **change)
    argv = [
        "eval",
        "passkey",
        "--depths",
        "0.2",
        "0.8",
        "--trials",
        "2",
        "--seeds",
        "0",
        "--method",
        "yarn",
        "--factor",
        "2",
        "--max-new-tokens",
        "6",
        "--baseline",
        str(base),
        "--output",
        str(tmp_path / "out"),
    ]
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err


def test_a_run_of_fewer_trials_is_divided_by_the_baseline_s_same_trials(tiny_path, tmp_path):
    """10 prompts at 64k against the 20-prompt baseline: the baseline's first trials of each depth
    (the same cells) are counted, not all of them; here trials 2 and 3 of the baseline miss."""
    base = baseline_file(tmp_path / "base", trials=4, model=tiny_path.name, wrong_from=2)
    result = run_passkey(
        tiny_path, tmp_path / "out", "--lengths", "256", "--method", "yarn", "--factor", "2", "--baseline", str(base)
    )
    assert result["baseline"]["trials"] == 2 and result["baseline"]["total"] == 4 and result["baseline"]["accuracy"] == 1.0
    assert result["retained"]["256"] == result["by_length"]["256"]
    assert (
        "4/4" in (tmp_path / "out" / "passkey.md").read_text()
        and "trials 0-1 of each depth" in (tmp_path / "out" / "passkey.md").read_text()
    )


def test_a_missing_baseline_is_refused_before_the_model_loads(no_model, tmp_path, capsys):
    argv = [
        "eval",
        "passkey",
        "--method",
        "yarn",
        "--factor",
        "2",
        "--baseline",
        str(tmp_path / "nowhere.json"),
        "--output",
        str(tmp_path / "out"),
    ]
    assert cli.main(argv) == 2
    assert "nowhere.json does not exist" in capsys.readouterr().err


def test_a_baseline_at_another_length_than_the_trained_window_is_refused(tiny_path, tmp_path):
    base = baseline_file(tmp_path / "base", lengths=(200,), model=tiny_path.name)
    with pytest.raises(ValueError, match="not at the trained window 128"):
        run_passkey(tiny_path, tmp_path / "out", "--lengths", "256", "--method", "yarn", "--factor", "2", "--baseline", str(base))


def test_a_baseline_of_another_model_is_refused_before_the_measurement(tiny_path, tmp_path):
    """The baseline is the run's own base model at its window: a file measured on another model
    (same depths, trials and seed) is refused naming both, before any trial is asked."""
    base = baseline_file(tmp_path / "base", model="smollm2-135m-0123456789ab")
    with pytest.raises(ValueError, match=f"measured model 'smollm2-135m-0123456789ab', not '{tiny_path.name}'"):
        run_passkey(tiny_path, tmp_path / "out", "--lengths", "256", "--method", "yarn", "--factor", "2", "--baseline", str(base))
    assert not (tmp_path / "out" / "passkey.partial.json").exists()


def test_a_fine_tune_is_compared_with_the_baseline_of_its_base(tiny_model, tiny_tokenizer, tiny_path, tmp_path):
    """A fine-tune folder's results name the folder; its baseline is its base model's run."""
    from peft import LoraConfig, get_peft_model

    from rope_ext.saving import save_record

    rope_ext.patch(tiny_model, "yarn", factor=2)
    tuned = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    out = tmp_path / "tiny_yarn_x2"
    tuned.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    save_record(out, str(tiny_path), tuned)
    own = baseline_file(tmp_path / "own", model=tiny_path.name)
    result = run_passkey(out, tmp_path / "ft", "--lengths", "256", "--baseline", str(own))
    assert result["setup"]["model"] == "tiny_yarn_x2" and result["baseline"]["path"].endswith("own/passkey.json")
    other = baseline_file(tmp_path / "other", model="tiny_yarn_x2")
    with pytest.raises(ValueError, match=f"measured model 'tiny_yarn_x2', not '{tiny_path.name}'"):
        run_passkey(out, tmp_path / "ft2", "--lengths", "256", "--baseline", str(other))


def test_the_committed_smollm2_baseline_is_one_for_the_embedded_model():
    """The README's and docs/evals.md's `--baseline docs/results/smollm2-plain-passkey-8k-t4.json`:
    a baseline read as such (the unpatched model, one length, the 20-prompt protocol) and measured
    on the embedded SmolLM2 as this install names it, which the run checks it against."""
    from pathlib import Path

    from rope_ext import defaults

    path = Path(__file__).resolve().parents[2] / "docs" / "results" / "smollm2-plain-passkey-8k-t4.json"
    baseline = retrieval.read_baseline(path)
    retrieval.check_baseline(baseline, [0.1, 0.3, 0.5, 0.7, 0.9], 4, [0], 10)
    assert baseline["setup"]["model"] == f"smollm2-135m-{defaults.smollm2_key()}"


def test_a_baseline_of_one_seed_written_before_runs_took_several_reads_as_that_seed(tmp_path):
    """Files from before --seeds record `seed` in their setup and none per trial: they read as
    seeds [seed], so they still serve as the baseline of a run of that seed, and of no other."""
    baseline = retrieval.read_baseline(baseline_file(tmp_path / "base", seed=3))
    assert baseline["setup"]["seeds"] == [3] and {t["seed"] for t in baseline["trials"]} == {3}
    retrieval.check_baseline(baseline, [0.2, 0.8], 2, [3], 6)
    with pytest.raises(ValueError, match="other seeds"):
        retrieval.check_baseline(baseline, [0.2, 0.8], 2, [3, 4], 6)


def test_a_baseline_missing_a_seed_s_trials_is_refused(tmp_path):
    base = baseline_file(tmp_path / "base", trials=1)
    result = json.loads((base / "passkey.json").read_text())
    result["setup"] = {**{k: v for k, v in result["setup"].items() if k != "seed"}, "seeds": [0, 1]}
    result["trials"] = [{**t, "seed": 0} for t in result["trials"]] + [{**result["trials"][0], "seed": 1}]
    (base / "passkey.json").write_text(json.dumps(result))
    with pytest.raises(ValueError, match="holds fewer than 1 trials at depths \\[0.8\\]"):
        retrieval.check_baseline(retrieval.read_baseline(base), [0.2, 0.8], 1, [0, 1], 6)


def test_the_readme_s_dense_table_reads_its_results_files():
    """Each row of the README's dense retrieval table states what its linked results file holds:
    the count, the Wilson interval, the retained ratio and the depths it misses."""
    import json
    import re
    from collections import Counter
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    table = readme[readme.index("### Retrieval at 32768 tokens, dense") :]
    rows = [line for line in table.splitlines() if re.search(r"\[file\]\(docs/results/.*-dense\.md\)", line)]
    assert len(rows) >= 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        result = json.loads((root / re.search(r"\((docs/results/[^)]*)\.md\)", row)[1]).with_suffix(".json").read_text())
        overall = result["counts_overall"]
        low, high = overall["interval"]
        assert cells[1] == f"{overall['correct']}/{overall['total']}"
        assert cells[2] == f"{low:.2f}-{high:.2f}"
        baseline = result.get("baseline")
        assert cells[3] == (f"{overall['accuracy'] / baseline['accuracy']:.2f}" if baseline else "")
        missed = Counter(trial["depth"] for trial in result["trials"] if not trial["correct"])
        assert cells[4] == ", ".join(f"{d:g}: {missed[d]}" for d in sorted(missed))
