"""The position-encoding study: the encodings, the compact decoder, and one run of the recipe at
test size (recipes/configs/pe_study_test.yaml) through its command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rope_ext.study.config import load_config
from rope_ext.study.encodings import DebertaDisentangled, T5RelativeBias
from rope_ext.study.model import ENCODINGS, ModelShape, build_model
from rope_ext.study.run import run_study

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "pe_study.py"
TEST_CONFIG = ROOT / "recipes" / "configs" / "pe_study_test.yaml"
SHAPE = ModelShape(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, window=16)
ENCODING_PARAMS = {"t5": {"num_buckets": 8, "max_distance": 16}, "deberta": {"num_buckets": 8, "max_distance": 16}}


def test_compact_decoder_is_llama_without_its_rotation():
    """With RoPE's frequencies zeroed and ALiBi's slopes zeroed, neither model has any position
    information left; with the same seed they must then be the same network."""
    llama = build_model("rope", SHAPE, seed=3).eval()
    compact = build_model("alibi", SHAPE, seed=3).eval()
    llama.model.rotary_emb.inv_freq.zero_()
    compact.encoding.slopes.zero_()
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(compact(input_ids=tokens).logits, llama(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)


def test_every_encoding_starts_from_the_same_weights():
    reference = build_model("rope", SHAPE, seed=5).state_dict()
    for name in ENCODINGS:
        model = build_model(name, SHAPE, seed=5, **ENCODING_PARAMS.get(name, {}))
        own = {k for k in model.state_dict() if k.startswith("model.encoding.")}
        assert set(model.state_dict()) - own == set(reference), name
        for key, value in model.state_dict().items():
            if key not in own:
                assert torch.equal(value, reference[key]), (name, key)


@pytest.mark.parametrize("name", [n for n in ENCODINGS if n != "rope"])
def test_encodings_are_causal(name):
    model = build_model(name, SHAPE, seed=0, **ENCODING_PARAMS.get(name, {})).eval()
    tokens = torch.randint(0, SHAPE.vocab_size, (1, SHAPE.window))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % SHAPE.vocab_size
    with torch.no_grad():
        before, after = model(input_ids=tokens).logits, model(input_ids=changed).logits
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert (before[:, 10:] - after[:, 10:]).abs().max() > 1e-4


def test_learned_positions_refuse_lengths_past_the_window():
    model = build_model("learned", SHAPE, seed=0).eval()
    model(input_ids=torch.zeros(1, SHAPE.window, dtype=torch.long))
    with pytest.raises(ValueError, match="no positions past 16"):
        model(input_ids=torch.zeros(1, SHAPE.window + 1, dtype=torch.long))


def test_relative_buckets():
    t5 = T5RelativeBias(num_heads=2, num_buckets=32, max_distance=128)
    buckets = t5.bucket(torch.arange(1000)).tolist()
    assert buckets[:16] == list(range(16))  # exact below num_buckets / 2
    assert buckets == sorted(buckets) and buckets[100] < 31 and set(buckets[128:]) == {31}  # log-spaced, then clamped
    deberta = DebertaDisentangled(hidden_size=8, num_buckets=128, max_distance=256)
    buckets = deberta.bucket(torch.arange(1000)).tolist()
    assert buckets[:65] == list(range(65))  # exact up to num_buckets / 2
    assert buckets == sorted(buckets) and buckets[255] == 127 and set(buckets[255:]) == {127}


def test_refuses_to_replace_results(tmp_path):
    (tmp_path / "pe_study.json").write_text("{}")
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_study(load_config(TEST_CONFIG), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pe_study.json"]
    assert (tmp_path / "pe_study.json").read_text() == "{}"


def test_rejects_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TEST_CONFIG.read_text().replace("  alibi: {}", "  nope: {}"))
    with pytest.raises(ValueError, match="unknown encoding"):
        load_config(bad)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("pe_study")
    proc = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(TEST_CONFIG), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "pe_study.json").read_text()), (out / "pe_study.md").read_text()


@pytest.mark.integration
def test_study_table(study):
    out, results, markdown = study
    window, lengths, rows = results["window"], results["lengths"], results["rows"]
    assert lengths == [window, 2 * window, 4 * window]
    assert set(rows) == {*ENCODINGS, "rope+ntk", "rope+dynamic", "rope+yarn"}
    for key, row in rows.items():
        for length in lengths:
            cell = row["cells"][str(length)]
            if key == "learned" and length > window:
                assert cell == {"na": "n/a (no positions past W)"}
            elif row.get("extension") and length == window:
                assert cell == {"same_as": "rope"}
            else:
                assert math.isfinite(cell["ppl"]) and cell["ppl"] > 1, (key, length, cell)
                assert cell["peak_mb"] >= 0 and cell["tokens_per_s"] > 0, (key, length, cell)
    for name in ENCODINGS:
        # trained: far below the 1024-token vocabulary's uniform perplexity
        assert rows[name]["cells"][str(window)]["ppl"] < 150, name
    learned_ppl_line = next(line for line in markdown.splitlines() if line.startswith("| Learned absolute"))
    assert learned_ppl_line.endswith("| n/a (no positions past W) | n/a (no positions past W) |")
    assert "| ALiBi |" in markdown and "= RoPE" in markdown
    assert (out / "pe_study.png").stat().st_size > 10_000


@pytest.mark.integration
def test_alibi_extrapolates_better_than_sinusoidal(study):
    _, results, _ = study
    four_w = str(4 * results["window"])
    alibi = results["rows"]["alibi"]["cells"][four_w]["ppl"]
    sinusoidal = results["rows"]["sinusoidal"]["cells"][four_w]["ppl"]
    assert alibi < 0.95 * sinusoidal, (alibi, sinusoidal)
