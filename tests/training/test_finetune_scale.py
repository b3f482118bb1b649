"""recipes/finetune.py at real model sizes, checked on the tiny trained model: checkpoints that
hold only what LoRA training changes, a half-precision or 4-bit base, the per-step log (train_log,
accelerate's trackers, loss.png) and the training data: tokenization through `datasets`, a token
cache read without pickle, binary sources refused."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rope_ext.evals.data import tokenize_documents
from rope_ext.training.checkpoints import TRAINED_STATE, checkpoints
from rope_ext.training.config import ConfigError, config_digest, identity_differences, parse_args
from rope_ext.training import data as training_data
from rope_ext.training.data import load_documents, tokenize_cached
from rope_ext.training.finetune import main
from rope_ext.training.model import load_kwargs
from rope_ext.training.outputs import loss_figure

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = ROOT / "recipes" / "configs" / "finetune_tiny.yaml"
SHORT = ["--max-steps", "4", "--warmup-steps", "1", "--seq-len", "256", "--eval-every", "0"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _args(tiny_path, out: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY_CONFIG), "--model", str(tiny_path), "--out", str(out), *SHORT, *extra]


@pytest.mark.integration
def test_checkpoints_hold_the_trained_weights_and_resume_exactly(tiny_path, tmp_path):
    """A checkpoint holds the LoRA weights and the trainable embeddings and norms, the optimizer,
    schedule and RNG, and no frozen base weight; resuming from it ends bit for bit where the
    uninterrupted run ends, with the same per-step log."""
    out = tmp_path / "run"
    args = _args(tiny_path, out, "--save-every", "2", "--train-embeddings", "--lora-dropout", "0.1")
    first = main(args)
    uninterrupted = load_file(out / "adapter_model.safetensors")
    (checkpoint,) = checkpoints(out)
    names = {p.name for p in checkpoint.iterdir()}
    assert names == {TRAINED_STATE, "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl", "trainer_state.json"}
    trained = load_file(checkpoint / TRAINED_STATE)
    # LoRA, the trained embeddings (and the head tied to them) and norms; no projection, no MLP
    assert {k.split(".")[-2] for k in trained if "lora_" not in k} == {
        "embed_tokens",
        "lm_head",
        "input_layernorm",
        "post_attention_layernorm",
        "norm",
    }
    assert torch.equal(trained["base_model.model.lm_head.weight"], trained["base_model.model.model.embed_tokens.weight"])
    assert sum(t.numel() for k, t in trained.items() if "lm_head" not in k) == first["trainable_params"]
    weights = 4 * sum(t.numel() for t in trained.values())  # float32
    assert weights < (checkpoint / TRAINED_STATE).stat().st_size < weights + 16384  # plus the safetensors header

    for name in ("adapter_model.safetensors", "train_log.json"):
        (out / name).unlink()
    resumed_log = main([*args, "--resume"])
    assert resumed_log["resumed_from_step"] == 2
    resumed = load_file(out / "adapter_model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    assert [(h["step"], h["loss"], h["lr"]) for h in resumed_log["history"]] == [
        (h["step"], h["loss"], h["lr"]) for h in first["history"]
    ]


@pytest.mark.integration
def test_per_step_log_trackers_and_loss_curve(tiny_path, tmp_path):
    pytest.importorskip("tensorboard")
    from matplotlib.image import imread
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    log = main(
        _args(tiny_path, out, "--save-every", "0", "--eval-every", "2", "--eval-tokens", "2048", "--log-with", "tensorboard")
    )
    history = log["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    # the learning rate each step trained with: warmup from 0 over 1 step, then cosine decay to 0
    peak = log["config"]["training"]["lr"]
    expected = [0.0] + [peak * 0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(3)]
    assert [h["lr"] for h in history] == pytest.approx(expected, abs=1e-12)
    assert log["final_loss"] == pytest.approx(sum(h["loss"] for h in history) / 4, abs=1e-5)
    assert all(h["tokens_per_s"] > 0 for h in history)
    assert json.loads((out / "train_log.json").read_text())["history"] == history

    events = EventAccumulator(str(out / "logs"))
    events.Reload()
    logged = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert [s for s, _ in logged["train/loss"]] == [1, 2, 3, 4]
    assert [v for _, v in logged["train/loss"]] == pytest.approx([h["loss"] for h in history], rel=1e-6)
    assert [v for _, v in logged["train/lr"]] == pytest.approx(expected, abs=1e-9)
    assert logged["eval/ppl"] == [(e["step"], pytest.approx(e["ppl"], rel=1e-6)) for e in log["evals"]]

    image = imread(out / "loss.png")
    assert image.shape[:2] == (400, 700) and image.std() > 0.05
    curve, held_out = loss_figure(log).axes[0].lines
    assert list(curve.get_ydata()) == [h["loss"] for h in history]
    assert list(held_out.get_xdata()) == [0, 2, 4]


def test_trackers_are_checked_before_training(tiny_path, tmp_path, monkeypatch):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbored'"):
        main(_args(tiny_path, out, "--log-with", "tensorbored"))
    from accelerate import tracking

    monkeypatch.setattr(tracking, "get_available_trackers", lambda: [])
    with pytest.raises(ConfigError, match=r"tensorboard tracker is not installed \(pip install tensorboard"):
        main(_args(tiny_path, out, "--log-with", "tensorboard"))
    assert not out.exists()


@pytest.mark.integration
def test_a_bfloat16_base_trains_with_float32_adapters(tiny_path, tmp_path):
    """--dtype bfloat16 on CPU: bf16 autocast over bf16 base weights, the trained weights in float32;
    the training-free perplexity is the float32 one to bf16 precision. In a process of its own:
    accelerate fixes one mixed precision per process."""
    bf16_args = _args(
        tiny_path, tmp_path / "bf16", "--dtype", "bfloat16", "--save-every", "0", "--eval-every", "4", "--eval-tokens", "2048"
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "finetune.py"), *bf16_args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    bf16 = json.loads((tmp_path / "bf16" / "train_log.json").read_text())
    fp32 = main(_args(tiny_path, tmp_path / "fp32", "--save-every", "0", "--eval-every", "4", "--eval-tokens", "2048"))
    assert bf16["mixed_precision"] == "bf16" and fp32["mixed_precision"] == "no"
    adapter = load_file(tmp_path / "bf16" / "adapter_model.safetensors")
    assert {t.dtype for t in adapter.values()} == {torch.float32}
    assert all(t.abs().max() > 0 for k, t in adapter.items() if "lora_B" in k)
    before_bf16, before_fp32 = bf16["evals"][0]["ppl"], fp32["evals"][0]["ppl"]
    assert before_bf16 != before_fp32 and before_bf16 == pytest.approx(before_fp32, rel=0.02)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dtype", "float64"], "model.dtype must be one of float32, bfloat16, float16"),
        (["--dtype", "bfloat16", "--precision", "no"], "model.dtype bfloat16 trains under bf16 autocast"),
        (["--dtype", "float16", "--precision", "bf16"], "model.dtype float16 trains under fp16 autocast"),
    ],
)
def test_base_dtype_settings_are_checked(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--config", str(TINY_CONFIG), *extra])


@pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is not None and torch.cuda.is_available(), reason="QLoRA can run here"
)
def test_a_4bit_base_is_refused_without_bitsandbytes_and_cuda(tiny_path, tmp_path):
    out = tmp_path / "run"
    lacking = "bitsandbytes" if importlib.util.find_spec("bitsandbytes") is None else "CUDA GPU"
    with pytest.raises(ConfigError, match=rf"model.load_in_4bit \(QLoRA\) needs .*{lacking}"):
        main(_args(tiny_path, out, "--load-in-4bit"))
    assert not out.exists()


def test_4bit_base_loads_as_nf4_on_the_training_device():
    cfg, _ = parse_args(["--config", str(TINY_CONFIG), "--load-in-4bit", "--dtype", "bfloat16"])
    kwargs = load_kwargs(cfg, torch.device("cuda", 1))
    quantization = kwargs["quantization_config"]
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4"
    assert quantization.bnb_4bit_compute_dtype == torch.bfloat16 and kwargs["dtype"] == torch.bfloat16
    assert kwargs["device_map"] == {"": torch.device("cuda", 1)}
    plain, _ = parse_args(["--config", str(TINY_CONFIG)])
    assert "quantization_config" not in load_kwargs(plain, torch.device("cpu"))


def test_tokenization_through_datasets_is_cached(tiny_tokenizer, tmp_path, monkeypatch):
    # Not through $ROPE_EXT_CACHE: datasets' map(num_proc=...) rebinds os.environ to a copy made
    # before the pool starts, so monkeypatch's undo would miss it and later tests would see the var.
    monkeypatch.setattr(training_data, "cache_dir", lambda: tmp_path / "cache")
    texts = [(f"doc{i}", f"Scene {i}. " + "Enter the ghost of Caesar, and speak. " * (5 + i)) for i in range(5)]
    texts += [("blank", "  \n"), ("tiny", "a")]
    expected = tokenize_documents(tiny_tokenizer, texts)
    got = tokenize_cached(texts, tiny_tokenizer, num_proc=2)
    assert [d.name for d in got] == [d.name for d in expected] == [f"doc{i}" for i in range(5)]
    assert all(torch.equal(a.ids, b.ids) and a.ids.dtype == torch.long for a, b in zip(got, expected))
    files = sorted((tmp_path / "cache" / "finetune-tokens").glob("*.arrow"))
    assert len(files) == 2  # one shard per process
    written = {f: f.stat().st_mtime_ns for f in files}
    again = tokenize_cached(texts, tiny_tokenizer, num_proc=2)
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(again, expected))
    assert {f: f.stat().st_mtime_ns for f in (tmp_path / "cache" / "finetune-tokens").glob("*.arrow")} == written
    with pytest.raises(ValueError, match="none of the 1 documents has text with at least 2 tokens"):
        tokenize_cached([("tiny", "a")], tiny_tokenizer)


def test_the_token_cache_is_read_without_pickle(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("ROPE_EXT_CACHE", str(tmp_path))
    texts = [("one", "The grass is green. " * 20), ("two", "The sky is blue. " * 30)]
    first = tokenize_cached(texts, tiny_tokenizer)
    assert [p.suffix for p in (tmp_path / "finetune-tokens").iterdir()] == [".arrow"]

    def no_pickle(*args, **kwargs):
        raise AssertionError("the cache was unpickled")

    monkeypatch.setattr(torch, "load", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    again = tokenize_cached(texts, tiny_tokenizer)
    assert [d.name for d in again] == ["one", "two"]
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(first, again))


def test_the_finetune_recipe_refuses_a_binary_source(tmp_path, tiny_tokenizer):
    path = tmp_path / "data.md"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    spec = {"source": str(path), "split": "train", "text_field": "text", "exclude": []}
    with pytest.raises(ConfigError, match="binary"):
        load_documents(spec, "exclude", tiny_tokenizer)


def test_the_tokenizing_processes_do_not_change_the_run():
    cfg, _ = parse_args(["--config", str(TINY_CONFIG)])
    more, _ = parse_args(["--config", str(TINY_CONFIG), "--num-proc", "4"])
    assert identity_differences(more, cfg) == [] and config_digest(more) == config_digest(cfg)
    other, _ = parse_args(["--config", str(TINY_CONFIG), "--dtype", "bfloat16"])
    assert identity_differences(other, cfg) == ["model.dtype: 'float32' in the run folder, 'bfloat16' now"]
