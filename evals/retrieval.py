"""What a passkey result says beside its accuracy: how sure it is, and how much of the model's own
retrieval survives the extension.

- The Wilson score interval (Wilson 1927) for k correct of n trials at 95% (z = 1.959964): unlike
  the normal approximation it stays inside [0, 1] and is not empty at 0/n or n/n, where small
  passkey grids often are. Two methods whose intervals overlap are not told apart by the grid.
- Retained retrieval: accuracy at length N under a method divided by the unpatched model's
  accuracy on the same depths, seed and trials at its trained window (the baseline run), so
  1.0 means the patch retrieves at N what the model retrieves inside its own window. A run of
  fewer trials than its baseline (10 prompts where a long prompt is dear, against a 20-prompt
  baseline) is divided by the baseline's first trials of each depth, the same cells.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

Z95 = 1.959964  # the 97.5% quantile of the standard normal
# The passkey grid's default (rope-ext eval passkey), here where the command's parser reads it
# before torch loads: a dense sweep, since five depths can step over a band of depths a method
# does not read from.
DEFAULT_DEPTHS = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 0.05, 0.1, ... 0.95
DEFAULT_SEEDS = (0, 1)


def wilson(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of `correct` successes in `total` trials."""
    if total < 1 or not 0 <= correct <= total:
        raise ValueError(f"need 0 <= correct <= total and total >= 1, got {correct} of {total}")
    p = correct / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def counts(records: list[dict]) -> dict:
    """{"correct", "total", "accuracy", "interval"} of trial records."""
    correct, total = sum(bool(r["correct"]) for r in records), len(records)
    return {"correct": correct, "total": total, "accuracy": correct / total, "interval": list(wilson(correct, total))}


def with_seeds(result: dict) -> dict:
    """A passkey file in the form this version writes: a file of one seed, written before runs took
    several, records `seed` in its setup and none in its trials; it reads as `seeds` [seed] and
    each trial of that seed."""
    setup = result.get("setup")
    if not isinstance(setup, dict) or "seeds" in setup or "seed" not in setup:
        return result
    seed = setup["seed"]
    setup = {("seeds" if k == "seed" else k): ([v] if k == "seed" else v) for k, v in setup.items()}
    trials = [{**t, "seed": seed} if isinstance(t, dict) and "seed" not in t else t for t in result.get("trials") or []]
    return {**result, "setup": setup, "trials": trials}


def seeds_text(seeds) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(s) for s in seeds)


def read_baseline(path) -> dict:
    """The results file of a baseline run (passkey.json), checked to be one: ValueError naming the
    file and what is wrong."""
    path = Path(path)
    if path.is_dir():
        path = path / "passkey.json"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"--baseline: {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--baseline: {path} is not valid JSON ({err})") from None
    if not isinstance(result, dict) or not isinstance(result.get("setup"), dict) or not isinstance(result.get("trials"), list):
        raise ValueError(f"--baseline: {path} is not a passkey results file (no setup and trials)")
    if not result["trials"]:
        raise ValueError(f"--baseline: {path} holds no trial")
    if result["setup"].get("method") not in (None, "plain"):
        raise ValueError(f"--baseline: {path} measured {result['setup']['method']!r}; the baseline is the unpatched model")
    result = with_seeds(result)
    lengths = {r["length"] for r in result["trials"]}
    if len(lengths) != 1:
        raise ValueError(f"--baseline: {path} has lengths {sorted(lengths)}; the baseline is one length, the trained window")
    return {**result, "path": str(path)}


def check_baseline(baseline: dict, depths, trials: int, seeds, max_new_tokens: int) -> None:
    """ValueError unless the baseline asked the same depths and seeds as this run, answered with as
    many new tokens, and holds at least this run's trials at every depth and seed (baseline_summary
    counts the first `trials` of each): a run stopped by --limit holds fewer."""
    setup = baseline["setup"]
    theirs = sorted({r["depth"] for r in baseline["trials"]})
    differ = [
        name
        for name, same in (
            ("depths", theirs == sorted(set(depths))),
            ("trials", isinstance(setup.get("trials"), int) and setup["trials"] >= trials),
            ("seeds", setup.get("seeds") == sorted(set(seeds))),
            ("max_new_tokens", setup.get("max_new_tokens") == max_new_tokens),
        )
        if not same
    ]
    if differ:
        raise ValueError(
            f"--baseline: {baseline['path']} has other {', '.join(differ)} than this run "
            f"(depths {theirs}, trials {setup.get('trials')}, seeds {setup.get('seeds')}, "
            f"max_new_tokens {setup.get('max_new_tokens')}); retained retrieval compares the same prompts' depths and "
            "keys' seeds, answered alike, with at least this run's trials"
        )
    missing = sorted(
        {
            depth
            for depth in theirs
            for seed in setup["seeds"]
            if len({r["trial"] for r in baseline["trials"] if (r["depth"], r["seed"]) == (depth, seed) and r["trial"] < trials})
            < trials
        }
    )
    if missing:
        raise ValueError(
            f"--baseline: {baseline['path']} holds fewer than {trials} trials at depths {missing} (a run stopped by "
            f"--limit {setup.get('limit')}?); retained retrieval divides by the baseline's same prompts, all of them"
        )


def baseline_summary(baseline: dict, window: int | None, base_model: str | None, trials: int) -> dict:
    """What a result records of its baseline: the file, its length (checked against the model's
    trained window when known), the trials counted (its first `trials` of each depth, this run's)
    and their counts. `base_model`: the name (setup's "model") of the unpatched model this run
    extends, checked to be the baseline's; None where the run's checkpoint does not record its base
    (a checkpoint saved patched)."""
    theirs = baseline["setup"].get("model")
    if base_model is not None and theirs != base_model:
        raise ValueError(
            f"--baseline: {baseline['path']} measured model {theirs!r}, not {base_model!r}, the base of this run; "
            "retained retrieval divides by the same model's retrieval inside its own window"
        )
    length = baseline["trials"][0]["length"]
    if window is not None and length != window:
        raise ValueError(f"--baseline: {baseline['path']} was measured at {length} tokens, not at the trained window {window}")
    same = [r for r in baseline["trials"] if r["trial"] < trials]
    return {"path": baseline["path"], "length": length, "trials": trials, **counts(same)}


def retained(by_length: dict, base: dict) -> dict:
    """{length: accuracy / baseline accuracy}; None where the baseline retrieved nothing."""
    return {n: (None if base["accuracy"] == 0 else acc / base["accuracy"]) for n, acc in by_length.items()}
