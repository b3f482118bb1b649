"""PoSE in the fine-tune recipe (rope_ext.training.pose, `--pose`): the tiny model (window 128)
patched with yarn x4 (512) trains on 128-token samples whose position ids skip up to 511."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rope_ext
from rope_ext.training import finetune
from rope_ext.training.checks import check_parallelism
from rope_ext.training.config import ConfigError, parse_args
from rope_ext.training.pose import SkipPositions, skipped_positions

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = ROOT / "recipes" / "configs" / "finetune_tiny.yaml"
WINDOW, PATCHED = 128, 512


pytestmark = pytest.mark.usefixtures("one_thread")


def _runs(positions: torch.Tensor) -> list[torch.Tensor]:
    """The maximal runs of consecutive position ids in one row."""
    breaks = (positions.diff() != 1).nonzero().flatten() + 1
    return list(torch.tensor_split(positions, breaks))


def test_skipped_positions_are_two_increasing_chunks_within_the_patched_window():
    for sample in range(200):
        ids = SkipPositions(WINDOW, PATCHED, seed=0)([sample])[0]
        assert ids.shape == (WINDOW,) and ids[0] == 0 and int(ids[-1]) <= PATCHED - 1
        assert bool((ids.diff() > 0).all())
        assert 1 <= len(_runs(ids)) <= 2 and all(len(r) for r in _runs(ids))
    # the skip reaches the far end of the window: the last position ranges over [c - 1, N - 1]
    last = {int(SkipPositions(WINDOW, PATCHED, seed=0)([s])[0, -1]) for s in range(200)}
    assert min(last) < WINDOW + 64 and max(last) > PATCHED - 64
    assert skipped_positions(2, 2, torch.Generator().manual_seed(0)).tolist() == [0, 1]
    with pytest.raises(ValueError, match="2 <= sequence length <= patched length, got 600 and 512"):
        skipped_positions(600, PATCHED, torch.Generator())


def test_skipped_positions_are_a_function_of_the_seed_and_the_sample():
    draw = SkipPositions(WINDOW, PATCHED, seed=3)
    assert torch.equal(draw([5, 9]), SkipPositions(WINDOW, PATCHED, seed=3)([5, 9]))
    assert torch.equal(draw([5, 9])[1], draw([9])[0])  # a row depends on its sample, not on the batch
    assert not torch.equal(draw([5]), draw([6]))
    assert not torch.equal(draw([5]), SkipPositions(WINDOW, PATCHED, seed=4)([5]))


class Recorder:
    """Wraps the recipe's lora_model: what the decoder and its rotary module get each forward."""

    def __init__(self, monkeypatch):
        self.rotary: list[torch.Tensor] = []
        self.decoder: list[dict] = []
        wrapped = finetune.lora_model

        def lora_model(model, cfg, targets):
            decoder = model.model
            decoder.rotary_emb.register_forward_pre_hook(self._rotary, with_kwargs=True)
            decoder.register_forward_pre_hook(self._decoder, with_kwargs=True)
            return wrapped(model, cfg, targets)

        monkeypatch.setattr(finetune, "lora_model", lora_model)

    def _rotary(self, module, args, kwargs):
        self.rotary.append(kwargs["position_ids"].detach().clone())

    def _decoder(self, module, args, kwargs):
        self.decoder.append({k: kwargs[k] for k in ("input_ids", "position_ids", "attention_mask")})


def _run(tiny_path, out: Path, *extra: str) -> dict:
    return finetune.main(
        [
            "--config",
            str(TINY_CONFIG),
            "--model",
            str(tiny_path),
            "--out",
            str(out),
            "--eval-every",
            "0",
            "--warmup-steps",
            "1",
            *extra,
        ]
    )


@pytest.mark.integration
def test_pose_reaches_the_patched_rotary_as_one_attended_sequence(tiny_path, tiny_model, tmp_path, monkeypatch):
    record = Recorder(monkeypatch)
    log = _run(tiny_path, tmp_path / "run", "--pose", "--max-steps", "3", "--save-every", "0", "--batch-size", "2")
    assert log["seq_len"] == WINDOW  # the original window is PoSE's default length
    assert len(record.rotary) == 3
    for positions in record.rotary:
        assert positions.shape == (2, WINDOW)
        for row in positions:
            assert int(row[-1]) <= PATCHED - 1 and len(_runs(row)) <= 2
    assert max(int(p.max()) for p in record.rotary) > WINDOW
    # The skip is not a document boundary: the last token still attends to the first chunk.
    call = record.decoder[0]
    row = next(i for i, p in enumerate(call["position_ids"]) if len(_runs(p)) == 2)
    rope_ext.patch(tiny_model, "yarn", 4)
    inputs = {k: None if v is None else v[row : row + 1] for k, v in call.items()}
    changed = {**inputs, "input_ids": inputs["input_ids"].clone()}
    changed["input_ids"][0, 0] = (changed["input_ids"][0, 0] + 1) % tiny_model.config.vocab_size
    with torch.no_grad():
        last = tiny_model(**inputs, use_cache=False).logits[0, -1]
        last_changed = tiny_model(**changed, use_cache=False).logits[0, -1]
    assert (last - last_changed).abs().max() > 1e-4


@pytest.mark.integration
def test_without_pose_the_positions_and_mask_are_unchanged(tiny_path, tmp_path, monkeypatch):
    record = Recorder(monkeypatch)
    _run(tiny_path, tmp_path / "run", "--max-steps", "2", "--save-every", "0", "--seq-len", "256")
    assert all(torch.equal(p, torch.arange(256)[None]) for p in record.rotary)
    assert all(call["attention_mask"] is None for call in record.decoder)


@pytest.mark.integration
def test_resumed_pose_run_draws_the_positions_of_the_uninterrupted_one(tiny_path, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    record = Recorder(monkeypatch)
    out = tmp_path / "run"
    args = ["--pose", "--max-steps", "4", "--save-every", "2", "--grad-accum", "2", "--lora-dropout", "0.1"]
    _run(tiny_path, out, *args)
    uninterrupted, positions = load_file(out / "adapter_model.safetensors"), record.rotary[:]
    assert len(positions) == 8 and any(int(p.max()) > WINDOW for p in positions)
    for name in ("adapter_model.safetensors", "adapter_config.json", "train_log.json"):
        (out / name).unlink()
    record.rotary.clear()
    log = _run(tiny_path, out, *args, "--resume")
    assert log["resumed_from_step"] == 2
    assert len(record.rotary) == 4
    for resumed, first in zip(record.rotary, positions[4:]):
        assert torch.equal(resumed, first)
    resumed_weights = load_file(out / "adapter_model.safetensors")
    for key in uninterrupted:
        torch.testing.assert_close(resumed_weights[key], uninterrupted[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "dynamic"], "cannot train the method 'dynamic': what a query sees depends on the length it has seen"),
        (["--method", "dynamic_yarn"], "cannot train the method 'dynamic_yarn'"),
        (["--method", "self_extend"], "cannot train the method 'self_extend'"),
        (["--method", "alibi_hybrid"], "cannot train the method 'alibi_hybrid': it acts inside attention"),
        (["--s2-groups", "2"], "training.pose cannot be combined with training.s2_groups"),
        (["--seq-len", "256"], "data.seq_len=256 is longer than the original window 128"),
    ],
)
def test_pose_refusals_come_before_training(tiny_path, tmp_path, extra, message):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        _run(tiny_path, out, "--pose", *extra)
    assert not out.exists()


@pytest.mark.integration
def test_static_methods_train_under_pose(tiny_path, tmp_path):
    for method in ("linear", "ntk", "llama3"):
        log = _run(tiny_path, tmp_path / method, "--pose", "--method", method, "--max-steps", "2", "--save-every", "0")
        assert log["config"]["training"]["pose"] and log["final_loss"] is not None


def test_pose_is_refused_under_context_parallelism():
    cfg, _ = parse_args(["--config", str(TINY_CONFIG), "--pose"])
    with pytest.raises(ConfigError, match="training.pose cannot run under context parallelism"):
        check_parallelism(cfg, cp_size=2)
    check_parallelism(cfg, cp_size=1)
