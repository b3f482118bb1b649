"""lm-eval's RULER tasks through `rope-ext lm-eval`: a rope_ext run names the evaluated
checkpoint's tokenizer for them, so `--tasks niah_single_1` needs no tokenizer in --metadata."""

from __future__ import annotations

import json

import pytest

from rope_ext.defaults import SMOLLM2
from rope_ext.evals import lm_eval_model
from rope_ext.evals.lm_eval_model import main, with_task_tokenizer


@pytest.mark.integration
def test_ruler_builds_its_prompts_with_the_evaluated_models_tokenizer(tiny_path, tiny_tokenizer, tmp_path, monkeypatch):
    """No pretrained in --model_args (the embedded model, the tiny one here) and no tokenizer in
    --metadata: without the tokenizer rope-ext names, lm-eval's RULER task has none to build with."""

    def embedded(name):
        return str(tiny_path) if name in (None, "", SMOLLM2) else name

    monkeypatch.setattr(lm_eval_model, "resolve_checkpoint", embedded)
    out = tmp_path / "ruler"
    rc = main(
        [
            "run",
            "--model",
            "rope_ext",
            "--model_args",
            "method=yarn,factor=4",
            "--tasks",
            "niah_single_1",
            "--metadata",
            json.dumps({"max_seq_lengths": [512]}),
            "--limit",
            "2",
            "--output_path",
            str(out),
            "--log_samples",
        ]
    )
    assert rc == 0
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]["niah_single_1"]
    assert 0.0 <= results["512,none"] <= 1.0  # RULER's per-length key: the share of needles found
    (samples_file,) = out.rglob("samples_niah_single_1_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 2
    for s in samples:  # sized by the tiny tokenizer: its tokens plus the 128-token answer budget
        assert s["doc"]["max_length"] == 512
        assert s["doc"]["length"] == len(tiny_tokenizer(s["doc"]["input"]).input_ids) + 128


def test_a_tokenizer_the_user_names_is_kept(monkeypatch):
    monkeypatch.setattr(lm_eval_model, "resolve_checkpoint", lambda name: f"resolved:{name}")
    assert with_task_tokenizer({"pretrained": "x"}, {"max_seq_lengths": [512]}) == {
        "max_seq_lengths": [512],
        "tokenizer": "resolved:x",
    }
    assert with_task_tokenizer({}, {}) == {"tokenizer": "resolved:None"}
    assert with_task_tokenizer({"pretrained": "x"}, {"tokenizer": "mine"}) == {"tokenizer": "mine"}
    assert with_task_tokenizer({"pretrained": "x", "tokenizer": "its own"}, {}) == {}  # lm-eval merges model_args in
