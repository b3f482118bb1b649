"""A fine-tune folder loaded by code that knows nothing of rope-ext: peft's
AutoPeftModelForCausalLM and PeftModel.from_pretrained, transformers' AutoModelForCausalLM of the
adapter folder or of merged/. Where transformers' rope_parameters express the patch (yarn) these
give the fine-tuned model; where not (self_extend) the adapter folder is refused, and writing the
merged weights warns, each with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel
from transformers import AutoModelForCausalLM

import rope_ext
from rope_ext import record
from rope_ext.saving import PLAIN_BASE, SEALED_ADAPTER_CONFIG, load_finetuned
from rope_ext.training.finetune import main

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = ROOT / "recipes" / "configs" / "finetune_tiny.yaml"


# every test reads a fine-tune trained by a module fixture
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


def _train(tiny_path, out: Path, method: str) -> Path:
    main(
        [
            "--config",
            str(TINY_CONFIG),
            "--model",
            str(tiny_path),
            "--out",
            str(out),
            "--method",
            method,
            "--merge",
            "--max-steps",
            "4",
            "--warmup-steps",
            "1",
            "--seq-len",
            "256",
            "--eval-every",
            "0",
            "--save-every",
            "0",
        ]
    )
    return out


@pytest.fixture(scope="module")
def yarn_run(tiny_path, tmp_path_factory) -> Path:
    return _train(tiny_path, tmp_path_factory.mktemp("loading") / "yarn", "yarn")


@pytest.fixture(scope="module")
def self_extend_run(tiny_path, tmp_path_factory) -> tuple[Path, list[str]]:
    with pytest.warns(UserWarning) as caught:
        out = _train(tiny_path, tmp_path_factory.mktemp("loading") / "self_extend", "self_extend")
    return out, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def ids(heldout_ids) -> torch.LongTensor:
    return heldout_ids[None, :512]  # the patched window, 4x the trained one


@torch.no_grad()
def _logits(model, ids):
    return model.eval()(input_ids=ids).logits


def _peft_documented_load(out: Path):
    """peft's own recipe: the base the adapter config names, then the adapter."""
    base = AutoModelForCausalLM.from_pretrained(PeftConfig.from_pretrained(str(out)).base_model_name_or_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(out))


PLAIN_LOADS = {
    "AutoPeftModelForCausalLM": lambda out: AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32),
    "transformers AutoModelForCausalLM": lambda out: AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32),
    "PeftModel on the named base": _peft_documented_load,
}


def test_the_fine_tune_record_keeps_its_bytes(yarn_run, tiny_path):
    expected = {
        "version": 1,
        "base_model": str(tiny_path),
        "patch": {
            "method": "yarn",
            "factor": 4.0,
            "params": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": True,
                "attention_factor": None,
                "mscale": None,
                "mscale_all_dim": None,
            },
            "original_window": 128,
        },
        "max_length": 512,
        "seq_len": 256,
    }
    assert (yarn_run / "rope_ext_finetune.json").read_text() == json.dumps(expected, indent=2) + "\n"
    base_model, saved = record.read_finetune(yarn_run)
    assert base_model == str(tiny_path) and saved.max_length == 512
    assert saved == record.Patch("yarn", 4.0, expected["patch"]["params"], {"original_window": 128})


@pytest.mark.parametrize("load", PLAIN_LOADS.values(), ids=PLAIN_LOADS.keys())
def test_plain_loads_give_the_fine_tune_when_transformers_expresses_the_patch(yarn_run, tiny_path, ids, load):
    expected = _logits(load_finetuned(yarn_run, dtype=torch.float32), ids)
    torch.testing.assert_close(_logits(load(yarn_run), ids), expected, atol=1e-5, rtol=1e-5)
    # what the same adapter gives on the unpatched base it was trained from: another model
    unpatched = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), str(yarn_run))
    assert (_logits(unpatched, ids) - expected).abs().max() > 1


def test_the_plain_base_is_the_patched_config_over_linked_weights(yarn_run, tiny_path):
    view = yarn_run / PLAIN_BASE
    config = json.loads((view / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 4
    assert config["max_position_embeddings"] == 512 and config["rope_ext"]["method"] == "yarn"
    weights = view / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (tiny_path / "model.safetensors").resolve()
    assert json.loads((yarn_run / "adapter_config.json").read_text())["base_model_name_or_path"] == str(view)


def test_merged_weights_load_exactly_in_plain_transformers(yarn_run, ids):
    merged = yarn_run / "merged"
    torch.testing.assert_close(
        _logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), ids),
        _logits(rope_ext.from_pretrained(merged, dtype=torch.float32), ids),
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize(
    "load, error",
    [
        (PLAIN_LOADS["AutoPeftModelForCausalLM"], "Can't find 'adapter_config.json'"),
        (PLAIN_LOADS["transformers AutoModelForCausalLM"], "Unrecognized model"),
        (
            lambda out: PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(json.loads((out / "rope_ext_finetune.json").read_text())["base_model"]),
                str(out),
            ),
            "Can't find 'adapter_config.json'",
        ),
    ],
    ids=["AutoPeftModelForCausalLM", "transformers AutoModelForCausalLM", "PeftModel on the base"],
)
def test_plain_loads_are_refused_when_transformers_cannot_express_the_patch(self_extend_run, load, error):
    out, _ = self_extend_run
    with pytest.raises(ValueError, match=error):
        load(out)


def test_the_refused_folder_still_loads_through_rope_ext_and_says_so(self_extend_run, tiny_path, ids):
    out, warned = self_extend_run
    assert (out / SEALED_ADAPTER_CONFIG).is_file() and not (out / "adapter_config.json").exists()
    assert not (out / PLAIN_BASE).exists()
    assert any(SEALED_ADAPTER_CONFIG in w and f"rope_ext.from_pretrained({str(out)!r})" in w for w in warned)
    # writing merged/ warns that a plain from_pretrained of it is the unpatched model
    assert any("'self_extend' patch" in w and "rope_ext.from_pretrained(path)" in w for w in warned)
    tuned = rope_ext.from_pretrained(out, dtype=torch.float32)
    assert rope_ext.describe(tuned)["method"] == "self_extend"
    base = rope_ext.from_pretrained(tiny_path, dtype=torch.float32)
    rope_ext.patch(base, "self_extend", 4)
    assert (_logits(tuned, ids) - _logits(base, ids)).abs().max() > 1e-3  # the adapter is attached
    torch.testing.assert_close(
        _logits(rope_ext.from_pretrained(out / "merged", dtype=torch.float32), ids), _logits(tuned, ids), atol=2e-4, rtol=1e-4
    )
