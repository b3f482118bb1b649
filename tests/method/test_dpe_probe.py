"""`rope-ext dpe-probe` (rope_ext.tuning.dpe_probe): the authors' detection of each dimension group's
effective distance, on the tiny trained model: one group moved at a time with the others at the
base scale, each setting's numbers those of the patch it names, the best scale per group the one
that retrieves most, refusals before a model loads."""

import json

import pytest
from helpers import cli_error_line, load_llama

import rope_ext
from rope_ext import cli
from rope_ext.tuning.dpe_probe import RESULT, TABLE
from rope_ext.method.dpe import group_distances
from rope_ext.tuning.search import DEPTHS, answer_loss, needles


def test_each_group_is_moved_alone_and_its_best_scale_is_reported(tiny_path, tiny_tokenizer, tmp_path):
    out = tmp_path / "probe"
    argv = ["dpe-probe", "--model", str(tiny_path), "--factor", "4", "--candidates", "2,32", "--samples", "1"]
    assert cli.main(argv + ["--needle", "words", "--dtype", "float32", "--output", str(out), "--no-progress"]) == 0
    result = json.loads((out / RESULT).read_text())
    setup = result["setup"]
    assert (setup["length"], setup["window"], setup["base"], setup["candidates"]) == (512, 16, 8, [2, 8, 32])
    assert [g["pairs"] for g in result["groups"]] == [[2 * g, 2 * g + 2] for g in range(8)]
    for group in result["groups"]:
        assert [r["scale"] for r in group["rows"]] == [2, 8, 32]
        assert [r["largest_distance"] for r in group["rows"]] == [group_distances(512, [s], 16)[0] for s in (2, 8, 32)]
        assert group["rows"][1]["loss"] == result["baseline"]["loss"]  # every group at the base is one setting
        assert group["best"] == max(group["rows"], key=lambda r: (r["correct"], -r["loss"]))
    assert result["scales"] == [g["best"]["scale"] for g in result["groups"]]
    assert result["param"] in (out / TABLE).read_text()
    # the slowest groups barely turn within 512 tokens: moving one changes less than moving a fast one
    spread = [max(r["loss"] for r in g["rows"]) - min(r["loss"] for r in g["rows"]) for g in result["groups"]]
    assert spread[0] > spread[7]

    # a setting's numbers are those of the patch that moves that group, checked apart
    model = load_llama(tiny_path)
    scales = [8, 8, 8, 2, 8, 8, 8, 8]
    rope_ext.patch(model, "dpe", factor=4, scales=scales)
    loss = answer_loss(model, needles(tiny_tokenizer, 512, 1, 0, "words", DEPTHS))
    assert loss == pytest.approx(result["groups"][3]["rows"][0]["loss"], abs=1e-6)
    assert loss != pytest.approx(result["baseline"]["loss"], abs=1e-3)


def test_a_group_count_that_does_not_split_the_pairs_fails_naming_it(tiny_path, tmp_path, capsys):
    argv = ["dpe-probe", "--model", str(tiny_path), "--factor", "4", "--groups", "3", "--output", str(tmp_path / "o")]
    assert cli.main(argv + ["--dtype", "float32", "--no-progress"]) == 1
    assert "--groups 3 does not split this model's 16 frequency pairs" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--factor", "1"], "factor must be a finite number > 1"),
        (["--candidates", "0,2"], "--candidates: each scale must be an int in [1,"),
        (["--candidates", "2,x"], "--candidates must be comma-separated whole numbers"),
        (["--groups", "0"], "--groups must be an int in [1,"),
        (["--samples", "0"], "--samples must be an int in [1,"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_loads(no_model, tmp_path, capsys, extra, message):
    argv = ["dpe-probe", "--model", str(tmp_path), "--factor", "4", "--output", str(tmp_path / "o")]
    (tmp_path / "config.json").write_text("{}")
    assert message in cli_error_line(argv + extra, capsys)


def test_the_default_model_is_the_embedded_smollm2(no_model, tmp_path):
    """Without --model the probe runs on the embedded SmolLM2 (checked, not loaded here)."""
    from rope_ext.tuning.dpe_probe import check

    args = cli.build_parser("dpe-probe").parse_args(["dpe-probe", "--factor", "4", "--output", str(tmp_path / "o")])
    assert args.model is None and args.groups == 8 and args.samples == 10
    assert check(args)["candidates"] is None
