"""bench/gpu_check.py --dry-run: the whole GPU check on the CPU at toy sizes, as the GPU runs it."""

import importlib.util
import json
from pathlib import Path

import pytest

from rope_ext.method import REGISTRY

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


pytestmark = pytest.mark.slow  # the dry run takes long


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(gpu_check, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "gpu-check.json"
    with pytest.warns(UserWarning):  # the causal schedule's many groups, the window from max_position_embeddings
        code = gpu_check.main(["--dry-run", "--out", str(out)])
    return code, json.loads(out.read_text())


def test_every_method_matches_its_fp32_reference_through_fused_kernels(dry_run):
    code, results = dry_run
    assert code == 0
    assert set(results["exactness"]) == set(REGISTRY)
    for name, result in results["exactness"].items():
        assert result["passed"], (name, result)
        assert result["explicit_score_calls"] == 0
        # past the window every method that rotates inside attention attends through the fused
        # kernels (dynamic's groups too); a static method runs the model's own attention
        assert (result["fused_calls"] > 0) == REGISTRY[name].dynamic, name
    assert results["provenance"]["torch"] and "git_commit" in results["provenance"]


def test_every_variant_is_timed_against_plain_at_every_length(gpu_check, dry_run):
    _, results = dry_run
    runs = results["speed"]
    assert [(r["variant"], r["length"]) for r in runs] == [
        (v, n) for n in (160, 320) for v in [*gpu_check.SPEED, gpu_check.PLAIN_AGAIN]
    ]
    for run in runs:
        assert "skipped" not in run
        assert run["prefill_s"] > 0 and run["decode_ms"] > 0 and run["decode_kernel_ms"] > 0 and run["kv_gib"] > 0
        plain = [r for r in runs if r["length"] == run["length"] and r["variant"].startswith("plain")]
        for key, ratio in (
            ("prefill_s", "prefill_vs_plain"),
            ("decode_ms", "decode_vs_plain"),
            ("decode_kernel_ms", "decode_kernel_vs_plain"),
            ("kv_gib", "kv_vs_plain"),
        ):
            assert run[ratio] == pytest.approx(run[key] / min(r[key] for r in plain))


def test_the_dry_run_decodes_plain_and_yarn_compiled_exactly_and_says_why_not_the_others(gpu_check, dry_run):
    """(e): the variants the dry run compiles decode through torch.compile, warmed up first (no frame
    traced while timed), their greedy tokens those of eager decode and their logits within bf16's
    rounding of eager's; each other variant says why it decoded eagerly only."""
    for run in dry_run[1]["speed"]:
        compiled = run["compiled"]
        if run["variant"] in gpu_check.DRY_RUN_COMPILED:
            assert compiled["same_tokens"] and compiled["max_rel_gap"] < 2**-6, run
            assert compiled["graph_breaks"] == 0 and run["frames_compiled_while_timed"] == 0
            plain = [r for r in dry_run[1]["speed"] if r["length"] == run["length"] and r["variant"].startswith("plain")]
            assert run["decode_compiled_vs_plain"] == pytest.approx(
                run["decode_compiled_ms"] / min(r["decode_compiled_ms"] for r in plain)
            )
        else:
            assert compiled["skipped"].startswith("not compiled in the dry run") and "decode_compiled_ms" not in run


def test_dynamic_runs_at_its_default_granularity(dry_run):
    window = dry_run[1]["speed_model"]["window"]
    for run in (r for r in dry_run[1]["speed"] if r["variant"] == "dynamic"):
        assert run["params"]["granularity"] == window // 8


def test_sink_window_runs_with_its_bounded_cache(dry_run):
    """The check fills sink_window's own cache (rope_ext.chunked.new_cache): past sinks + window
    tokens its KV memory stays within that bound, where plain's grows with the prompt."""
    window = dry_run[1]["speed_model"]["window"]
    for run in (r for r in dry_run[1]["speed"] if r["variant"] == "sink_window"):
        assert run["kv_gib"] <= run["kv_bound_gib"] and run["kv_vs_bound"] <= 1
        assert run["kv_vs_plain"] < window / run["length"] * 1.01


def test_the_issue_targets_are_checked_on_the_runs(gpu_check, dry_run):
    """Every target of TARGETS has a check per variant, with what was measured; the peak of the
    CUDA allocator is not measured on the CPU, nor the compiled decode of what the dry run does not
    compile, and each says so."""
    checks = dry_run[1]["targets"]
    assert [(c["target"], c["variant"]) for c in checks] == [(t[0], v) for t in gpu_check.TARGETS for v in t[1]]
    for check in checks:
        dry_run_skips = check["measure"] == "decode_compiled_vs_plain" and check["variant"] not in gpu_check.DRY_RUN_COMPILED
        if check["measure"] == "peak_vs_plain" or dry_run_skips:
            assert check["values"] == {} and check["met"] is None
        else:
            assert check["values"] and check["met"] == all(v <= check["bound"] for v in check["values"].values())


def test_a_run_that_would_not_fit_the_budget_is_skipped_with_the_prediction(gpu_check, tmp_path):
    out = tmp_path / "gpu.json"
    with pytest.warns(UserWarning):
        gpu_check.main(["--dry-run", "--out", str(out), "--budget-s", "0"])
    runs = json.loads(out.read_text())["speed"]
    assert runs and all(r["skipped"].startswith("predicted prefill") and "prefill_s" not in r for r in runs)
