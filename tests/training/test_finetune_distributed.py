"""recipes/finetune.py on 2 CPU processes over gloo: DDP (recipes/configs/accelerate/cpu_ddp.yaml)
and FSDP2 (the GPU config recipes/configs/accelerate/fsdp2.yaml), each interrupted after its step-2
checkpoint and resumed.

accelerate 1.15 does not run FSDP on a CPU: AcceleratorState turns a launch into
DistributedType.FSDP only for the MULTI_GPU-like device types, so on this machine an FSDP launch
trains as DDP (MULTI_CPU) and the recipe refuses it. torch's fully_shard itself runs on gloo. So
the FSDP2 runs here go through this file's __main__: it builds the accelerate state as an FSDP
launch on a GPU machine would have it (DistributedType.FSDP, the FSDP plugin from the launch's
environment) and hands over to the recipe, whose Accelerator, prepare (accelerate's
fsdp2_prepare_model -> fully_shard), checkpoints and gathering are then those of a GPU run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rope_ext.training.checkpoints import checkpoints
from rope_ext.training.config import ConfigError
from rope_ext.training.finetune import main

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = ROOT / "recipes" / "configs" / "accelerate"
TINY_CONFIG = ROOT / "recipes" / "configs" / "finetune_tiny.yaml"
# 4 steps of 2 x 256 tokens, a checkpoint after step 2, dropout (whose draws the per-rank RNG in
# the checkpoint must restore) and held-out evals at steps 0, 2 and 4.
SHORT = [
    "--max-steps",
    "4",
    "--warmup-steps",
    "1",
    "--seq-len",
    "256",
    "--save-every",
    "2",
    "--lora-dropout",
    "0.1",
    "--eval-every",
    "2",
    "--eval-tokens",
    "2048",
]


def _launch(config: str, script: Path, args: list[str], *extra: str) -> None:
    """`accelerate launch` of `script` on 2 processes."""
    launcher = Path(sys.executable).with_name("accelerate")
    # port 0: accelerate picks a free port, so that another launch on the machine (the configs'
    # default is 29500) makes this one neither fail nor join it
    cmd = [
        str(launcher),
        "launch",
        "--config_file",
        str(ACCELERATE / config),
        "--main_process_port",
        "0",
        *extra,
        str(script),
        *args,
    ]
    started = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True, text=True, timeout=600
    )
    if proc.returncode:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    print(f"\n{script.name} under {config}: {time.perf_counter() - started:.1f} s wall")


def _interrupted_and_resumed(out: Path, launch) -> dict:
    """Run to the end, then leave `out` as a kill after the step-2 checkpoint would (the run config
    and the checkpoint) and resume it; the adapters and logs of both runs."""
    launch([])
    runs = {"uninterrupted": (load_file(out / "adapter_model.safetensors"), json.loads((out / "train_log.json").read_text()))}
    assert [p.name for p in checkpoints(out)] == ["step-2"]
    for entry in out.iterdir():
        if entry.name not in ("run_config.json", "checkpoints"):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    launch(["--resume"])
    runs["resumed"] = (load_file(out / "adapter_model.safetensors"), json.loads((out / "train_log.json").read_text()))
    runs["out"] = out
    return runs


@pytest.fixture(scope="module")
def ddp(tiny_path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ddp") / "run"
    args = ["--config", str(TINY_CONFIG), "--model", str(tiny_path), "--out", str(out), *SHORT]
    return _interrupted_and_resumed(out, lambda extra: _launch("cpu_ddp.yaml", ROOT / "recipes" / "finetune.py", [*args, *extra]))


@pytest.fixture(scope="module")
def fsdp2(tiny_path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp2") / "run"
    args = ["--config", str(TINY_CONFIG), "--model", str(tiny_path), "--out", str(out), *SHORT]
    # fsdp2.yaml asks for bf16; on a CPU the recipe trains fp32 (training.precision auto), and the
    # Accelerator __main__ builds must agree with the recipe's.
    return _interrupted_and_resumed(
        out, lambda extra: _launch("fsdp2.yaml", Path(__file__), [*args, *extra], "--mixed_precision", "no")
    )


def _assert_same_run(a: tuple, b: tuple, exact: bool) -> None:
    (weights_a, log_a), (weights_b, log_b) = a, b
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        if exact:
            assert torch.equal(weights_a[key], weights_b[key]), key
        else:
            torch.testing.assert_close(weights_a[key], weights_b[key], atol=1e-6, rtol=0)
    for field, numbers in (("history", ("loss", "lr")), ("evals", ("ppl", "nll"))):
        assert [h["step"] for h in log_a[field]] == [h["step"] for h in log_b[field]]
        values_a, values_b = ([h[n] for h in log[field] for n in numbers] for log in (log_a, log_b))
        assert values_a == (values_b if exact else pytest.approx(values_b, rel=1e-6)), field


@pytest.mark.integration
def test_ddp_resume_is_bit_equal_to_the_uninterrupted_run(ddp):
    """Two CPU processes: the resumed run ends with the uninterrupted run's weights, per-step log and
    evals, bit for bit (same batches per rank, optimizer, schedule, and each rank's dropout draws)."""
    resumed_log = ddp["resumed"][1]
    assert resumed_log["distributed_type"] == "MULTI_CPU" and resumed_log["processes"] == 2
    assert resumed_log["resumed_from_step"] == 2 and [e["step"] for e in resumed_log["evals"]] == [0, 2, 4]
    _assert_same_run(ddp["resumed"], ddp["uninterrupted"], exact=True)


@pytest.mark.integration
def test_fsdp2_on_cpu_trains_as_ddp_does(fsdp2, ddp):
    """FSDP2 (accelerate's fsdp2.yaml: one fully_shard unit per decoder layer, sharded state dicts)
    over gloo ends where DDP ends: the same weights, losses and held-out perplexities, to 1e-6 (the
    two reduce the gradients and the clipping norm with other collectives, which may round
    differently); on this machine they were bit-equal."""
    weights, log = fsdp2["uninterrupted"]
    assert log["distributed_type"] == "FSDP" and log["processes"] == 2 and log["data_parallel_size"] == 2
    assert all(t.abs().max() > 0 for k, t in weights.items() if "lora_B" in k)  # it trained
    _assert_same_run(fsdp2["uninterrupted"], ddp["uninterrupted"], exact=False)


@pytest.mark.integration
def test_fsdp2_checkpoint_holds_only_the_trained_weights(fsdp2):
    """The FSDP2 checkpoint holds the trained weights (each rank its shards), AdamW's moments of
    them, the schedule and each rank's RNG: no frozen base weight."""
    import torch.distributed.checkpoint as dcp

    (checkpoint,) = checkpoints(fsdp2["out"])
    assert {p.name for p in checkpoint.iterdir()} == {
        "pytorch_model_fsdp_0",
        "optimizer_0",
        "custom_checkpoint_0.pkl",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "trainer_state.json",
    }
    weights = dcp.FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
    # the LoRA weights and the trainable norms (finetune_tiny.yaml); no projection, no MLP, no embedding
    assert {k.split(".")[-2] for k in weights if "lora_" not in k} == {"input_layernorm", "post_attention_layernorm", "norm"}
    assert sum(math.prod(m.size) for m in weights.values()) == fsdp2["uninterrupted"][1]["trainable_params"]
    assert all(len(m.chunks) == 2 for m in weights.values() if len(m.size) == 2)  # sharded over the 2 ranks
    optimizer = dcp.FileSystemReader(str(checkpoint / "optimizer_0")).read_metadata().state_dict_metadata
    moments = {k.rsplit(".", 1)[0] for k in optimizer if k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert len(moments) == len(weights)


@pytest.mark.integration
def test_fsdp2_resume_is_bit_equal_to_the_uninterrupted_run(fsdp2):
    resumed_log = fsdp2["resumed"][1]
    assert resumed_log["distributed_type"] == "FSDP" and resumed_log["resumed_from_step"] == 2
    _assert_same_run(fsdp2["resumed"], fsdp2["uninterrupted"], exact=True)


@pytest.mark.integration
def test_resume_refuses_another_checkpoint_layout(fsdp2, tiny_path):
    out = fsdp2["out"]
    with pytest.raises(ConfigError, match="checkpointed by a fsdp launch, this one is replicated"):
        main(["--config", str(TINY_CONFIG), "--model", str(tiny_path), "--out", str(out), *SHORT, "--resume"])


def test_an_fsdp_launch_on_a_cpu_is_refused(tiny_path, tmp_path, monkeypatch):
    """What `accelerate launch --config_file fsdp2.yaml` tells the recipe on this machine:
    accelerate would drop the plugin and train unsharded; the recipe refuses before any output."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"asks for FSDP \(ACCELERATE_USE_FSDP=true\).*here it would train as NO instead"):
        main(["--config", str(TINY_CONFIG), "--model", str(tiny_path), "--out", str(out), *SHORT])
    assert not out.exists()


def test_a_deepspeed_launch_on_a_cpu_is_refused(monkeypatch):
    """Without the deepspeed package accelerate's Accelerator itself raises on a DeepSpeed launch;
    with it, on a CPU, it would drop the plugin as it does FSDP's. The check, on this process's
    Accelerator (made before the launch variable is set):"""
    from accelerate import Accelerator

    from rope_ext.training.checks import check_launch

    accelerator = Accelerator(cpu=True)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match=r"asks for DeepSpeed \(ACCELERATE_USE_DEEPSPEED=true\).*train as NO instead"):
        check_launch(accelerator)


def _run_recipe_as_fsdp2() -> None:
    """The recipe under the accelerate state an FSDP launch gets on a GPU machine (see the module
    docstring): run as `accelerate launch --config_file fsdp2.yaml ... tests/training/test_finetune_distributed.py ARGS`."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True)  # the gloo process group, as the recipe's Accelerator makes it here
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    # Both shared states: every later AcceleratorState() copies PartialState's distributed type.
    for state in (accelerator.state, PartialState()):
        state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables of the launch
    main(sys.argv[1:])


if __name__ == "__main__":
    _run_recipe_as_fsdp2()
