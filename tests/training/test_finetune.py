"""recipes/finetune.py (rope_ext.training.finetune): LoRA fine-tuning of a patched model at its
extended window.

The central run is the README's CPU DDP command (2 processes, gloo) on the tiny trained model:
yarn x4 (512 tokens, 4x the 128-token window), 100 steps. It must end with identical weights on
both ranks and with a clearly lower held-out perplexity at 512 tokens than the training-free patch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rope_ext
from rope_ext.defaults import SMOLLM2_WINDOW
from rope_ext.record import FINETUNE_FILE as RECORD_FILE
from rope_ext.saving import load_finetuned
from rope_ext.training.checkpoints import checkpoints
from rope_ext.training.checks import length_multiple
from rope_ext.training.config import DEFAULTS, ConfigError, parse_args
from rope_ext.training.data import first_tokens, load_documents
from rope_ext.training.distributed import choose_precision
from rope_ext.training.finetune import main
from rope_ext.training.order import DataOrder
from rope_ext.training.s2_attention import s2_attention

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "finetune.py"
TINY_CONFIG = ROOT / "recipes" / "configs" / "finetune_tiny.yaml"
GPU_CONFIG = ROOT / "recipes" / "configs" / "finetune_smollm2_gpu.yaml"
ACCELERATE_CONFIGS = sorted((ROOT / "recipes" / "configs" / "accelerate").glob("*.yaml"))


def _accelerate_launch() -> list[str]:
    script = Path(sys.executable).with_name("accelerate")
    return [str(script), "launch"] if script.is_file() else [sys.executable, "-m", "accelerate.commands.launch"]


def _snapshot(folder: Path) -> dict:
    """Every file under `folder` with its size and modification time."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ddp_run(tiny_path, tmp_path_factory):
    """(output folder, train_log) of the README's CPU DDP run, with --merge."""
    out = tmp_path_factory.mktemp("finetune") / "ddp"
    cmd = [
        *_accelerate_launch(),
        "--config_file",
        str(ROOT / "recipes/configs/accelerate/cpu_ddp.yaml"),
        str(RECIPE),
        "--config",
        str(TINY_CONFIG),
        "--model",
        str(tiny_path),
        "--out",
        str(out),
        "--merge",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        pytest.fail(f"the DDP fine-tune failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    print(f"\nCPU DDP fine-tune: {time.perf_counter() - started:.1f} s wall")
    return out, json.loads((out / "train_log.json").read_text())


def _eval_documents(tokenizer):
    """The held-out text the recipe evaluates on (finetune_tiny.yaml's eval section)."""
    cfg, _ = parse_args(["--config", str(TINY_CONFIG)])
    return first_tokens(load_documents(cfg["eval"], "include", tokenizer), cfg["eval"]["max_tokens"])


@pytest.mark.integration
def test_ddp_ranks_end_with_the_same_weights(ddp_run):
    out, log = ddp_run
    assert log["distributed_type"] == "MULTI_CPU" and log["processes"] == 2
    assert len(log["rank_digests"]) == 2 and log["rank_digests"][0] == log["rank_digests"][1]
    from safetensors.torch import load_file

    lora_b = [t for k, t in load_file(out / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and all(t.abs().max() > 0 for t in lora_b), "LoRA B starts at zero: training must have moved it"


@pytest.mark.integration
def test_finetune_beats_the_training_free_patch(ddp_run, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rope_ext.evals.perplexity import evaluate

    out, log = ddp_run
    docs = _eval_documents(AutoTokenizer.from_pretrained(tiny_path))
    patched = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    rope_ext.patch(patched, "yarn", 4)
    before = evaluate(patched, docs, [128, 512], progress=False)
    tuned = load_finetuned(out, dtype=torch.float32)
    after = evaluate(tuned, docs, [128, 512], progress=False)
    print(
        f"\nheld-out PPL, yarn x4 patch alone: {before[128]['ppl']:.2f} at 128, {before[512]['ppl']:.2f} at 512; "
        f"after the fine-tune: {after[128]['ppl']:.2f} at 128, {after[512]['ppl']:.2f} at 512"
    )
    assert after[512]["ppl"] < 0.93 * before[512]["ppl"]
    # The recipe's own evals (step 0 and the last step) are the same numbers: the saved adapter
    # reloads into the model that was trained.
    assert log["evals"][0]["step"] == 0 and log["evals"][-1]["step"] == log["steps"]
    assert log["evals"][0]["ppl"] == pytest.approx(before[512]["ppl"], rel=1e-4)
    assert log["evals"][-1]["ppl"] == pytest.approx(after[512]["ppl"], rel=1e-4)


@pytest.mark.integration
def test_merged_weights_reload_with_from_pretrained(ddp_run, heldout_ids):
    out, _ = ddp_run
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["patch"]["method"] == "yarn" and record["max_length"] == 512
    merged = rope_ext.from_pretrained(out / "merged", dtype=torch.float32).eval()
    assert rope_ext.describe(merged)["method"] == "yarn"
    adapter = load_finetuned(out, dtype=torch.float32)
    ids = heldout_ids[None, :512]
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(input_ids=ids).logits, atol=2e-4, rtol=1e-4)


def _run_args(tiny_path, out: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY_CONFIG), "--model", str(tiny_path), "--out", str(out), *extra]


@pytest.mark.integration
def test_resume_reproduces_the_uninterrupted_run(tiny_path, tmp_path):
    """A run stopped after its step-2 checkpoint and resumed ends where the uninterrupted run
    ended: same data order, optimizer, schedule and dropout draws. Also trains with LongLoRA's
    shifted sparse attention and trainable norms."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    args = _run_args(
        tiny_path,
        out,
        "--max-steps",
        "4",
        "--warmup-steps",
        "1",
        "--save-every",
        "2",
        "--seq-len",
        "256",
        "--s2-groups",
        "2",
        "--lora-dropout",
        "0.1",
        "--eval-every",
        "0",
    )
    main(args)
    uninterrupted = load_file(out / "adapter_model.safetensors")
    assert [p.name for p in checkpoints(out)] == ["step-2"]
    # What a kill after the step-2 checkpoint leaves: the checkpoint and the run config.
    for name in ("adapter_model.safetensors", "adapter_config.json", "train_log.json"):
        (out / name).unlink()
    log = main([*args, "--resume"])
    assert log["resumed_from_step"] == 2
    resumed = load_file(out / "adapter_model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], atol=1e-6, rtol=0)


@pytest.fixture
def short_text(tmp_path) -> Path:
    path = tmp_path / "short.txt"
    path.write_text("Friends, Romans, countrymen, lend me your ears.\n" * 4)
    return path


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "rope2000"], "unknown method 'rope2000'"),
        (["--factor", "1"], "factor must be a finite number > 1"),
        (["--s2-groups", "4", "--seq-len", "500"], "not a multiple of 8"),
        (["--seq-len", "1024"], "longer than the patched window 512"),
        (["--dataset", "SHORT_TEXT"], "gives 0 sequence"),
        (["--warmup-steps", "100"], "warmup_steps must be smaller"),
    ],
)
def test_bad_input_fails_before_training(tiny_path, tmp_path, short_text, extra, message):
    out = tmp_path / "run"
    extra = [str(short_text) if e == "SHORT_TEXT" else e for e in extra]
    with pytest.raises(ConfigError, match=message):
        main(_run_args(tiny_path, out, *extra))
    assert not out.exists()


def test_unknown_yaml_key_is_an_error(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("training:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match="unknown config key training.'epochs'"):
        parse_args(["--config", str(config)])


@pytest.mark.integration
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--resume", "--lr", "1e-4"], r"another configuration:\n  training.lr: 0.002 in the run folder, 0.0001 now"),
        (["--resume"], "trained on 2 data-parallel rank"),
        ([], "already holds a run; pass --resume"),
    ],
)
def test_resume_refuses_another_run(ddp_run, tiny_path, extra, message):
    out, _ = ddp_run
    before = _snapshot(out)
    with pytest.raises(ConfigError, match=message):
        main(_run_args(tiny_path, out, *extra))
    assert _snapshot(out) == before


def _reference_s2(query, key, value, groups):
    """Shifted sparse attention from its definition: one boolean mask per head."""
    heads, seq = query.shape[1], query.shape[2]
    size = seq // groups
    i = torch.arange(seq)
    causal = i[None, :] <= i[:, None]
    plain = (i[:, None] // size == i[None, :] // size) & causal
    shifted_block = (i + size // 2) // size
    shifted = (shifted_block[:, None] == shifted_block[None, :]) & causal
    mask = torch.stack([plain if h < heads // 2 else shifted for h in range(heads)])
    repeat = heads // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask[None]).transpose(1, 2)


@pytest.mark.parametrize("groups", [2, 4])
def test_s2_attention_matches_its_block_mask(groups):
    query, key, value = torch.randn(2, 4, 32, 8), torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    out, _ = s2_attention(groups)(None, query, key, value, None)
    torch.testing.assert_close(out, _reference_s2(query, key, value, groups))
    # No token sees a later one: changing the last token changes no earlier output.
    later = value.clone()
    later[:, :, -1] += 1
    out_later, _ = s2_attention(groups)(None, query, key, later, None)
    torch.testing.assert_close(out_later[:, :-1], out[:, :-1])


def test_data_order_is_a_function_of_the_position():
    order = DataOrder(n=10, seed=3, batch_size=2, grad_accum=1, world=2)
    again = DataOrder(n=10, seed=3, batch_size=2, grad_accum=1, world=2)
    first_pass = [i for step in range(3) for rank in range(2) for i in order.indices(step, 0, rank)][:10]
    assert sorted(first_pass) == list(range(10))  # one pass sees every sequence once
    assert again.indices(7, 0, 1) == order.indices(7, 0, 1)  # a resumed run sees the same batches
    assert order.indices(0, 0, 0) != order.indices(0, 0, 1)


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_validates(path):
    """Each config loads as accelerate launch loads it: known keys only, a launch that passes
    accelerate's checks, and plugins (FSDP, DeepSpeed, parallelism) built from its environment."""
    from unittest import mock

    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    parser = launch_command_parser()
    known = {action.dest for action in parser._actions}
    config = load_config_from_file(str(path))
    for section, values in config.__dict__.items():
        if isinstance(values, dict):
            for key in values:
                flag = f"fsdp_{key}" if section == "fsdp_config" and not key.startswith("fsdp") else key
                assert flag in known, f"{path.name}: {section}.{key} is no `accelerate launch` option"
    args, defaults, precision_from_config = _validate_launch_command(parser.parse_args(["--config_file", str(path), "train.py"]))
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(
            [*defaults.deepspeed_config, *(["mixed_precision"] if precision_from_config else [])]
        )
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    with mock.patch.dict(os.environ, env):
        if args.use_fsdp:
            assert FullyShardedDataParallelPlugin().fsdp_version == 2
        if args.use_deepspeed:
            assert DeepSpeedPlugin().zero_stage == 3
        if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true":
            parallel = ParallelismConfig()
            assert parallel.cp_size > 1 and parallel.total_size == args.num_processes
            multiple, _ = length_multiple(DEFAULTS, parallel.cp_size)
            assert multiple == 2 * parallel.cp_size


def test_gpu_config_targets_32k_on_smollm2():
    cfg, _ = parse_args(["--config", str(GPU_CONFIG)])
    assert cfg["model"]["path"] == "smollm2" and cfg["patch"]["method"] == "yarn"
    assert cfg["patch"]["factor"] * SMOLLM2_WINDOW == 32768
    assert set(cfg["eval"]["include"]) <= set(cfg["data"]["exclude"])  # never evaluate on training text
    assert choose_precision(cfg["training"]["precision"]) in ("bf16", "fp16", "no")
