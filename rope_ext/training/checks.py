"""The fine-tune's checks that need the model, the launch or the data: each raises ConfigError,
saying what to change, before the first step."""

from __future__ import annotations

import importlib.util
import math

import accelerate
import torch
from accelerate import tracking
from accelerate.utils import DistributedType, parse_flag_from_env

import rope_ext

from .config import HALF_PRECISION, ConfigError
from .distributed import is_sharded


def check_trackers(names: list[str]) -> None:
    """Every tracker of output.log_with known to accelerate and installed (accelerate itself
    drops a missing one without a word)."""
    known = tracking.LoggerType.list()
    available = {str(t) for t in tracking.get_available_trackers()}
    for name in names:
        if name not in known:
            raise ConfigError(f"output.log_with: unknown tracker {name!r}; accelerate knows {', '.join(known)}")
        if name not in available:
            raise ConfigError(
                f"output.log_with: the {name} tracker is not installed (pip install {name}, "
                "or `pip install rope-ext[tracking]` for tensorboard), or drop it from output.log_with"
            )


def check_launch(accelerator) -> None:
    """A launch that asks for FSDP or DeepSpeed gets it. accelerate makes a launch FSDP or DeepSpeed
    only on a GPU or another accelerator (AcceleratorState sets DistributedType.FSDP for the
    MULTI_GPU-like types alone, DEEPSPEED only without cpu=True, which the recipe passes on a
    machine without one); on a CPU it drops the plugin without a word, and the processes train as
    DDP over gloo (one process: alone). Without the deepspeed package, accelerate's Accelerator
    refuses a DeepSpeed launch itself."""
    for flag, name, wanted in (
        ("ACCELERATE_USE_FSDP", "FSDP", DistributedType.FSDP),
        ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed", DistributedType.DEEPSPEED),
    ):
        if parse_flag_from_env(flag) and accelerator.distributed_type != wanted:
            raise ConfigError(
                f"this launch asks for {name} ({flag}=true), which accelerate {accelerate.__version__} runs on GPUs and "
                f"other accelerators only; here it would train as {accelerator.distributed_type.name} instead. "
                "On a CPU use recipes/configs/accelerate/cpu_ddp.yaml (or single_device.yaml)"
            )


def check_precision(cfg: dict, mixed_precision: str) -> None:
    """A half-precision base needs the autocast of its dtype, whatever accelerate's config says."""
    needed = HALF_PRECISION.get(cfg["model"]["dtype"])
    if needed and mixed_precision != needed:
        raise ConfigError(
            f"model.dtype {cfg['model']['dtype']} trains under {needed} autocast; this launch's mixed "
            f"precision is {mixed_precision!r}: set training.precision to auto or {needed}"
        )


def check_quantization(cfg: dict, accelerator) -> None:
    """QLoRA's 4-bit base needs bitsandbytes and a CUDA GPU, and one unsharded replica per GPU."""
    if not cfg["model"]["load_in_4bit"]:
        return
    missing = [
        what
        for what, there in (
            ("the bitsandbytes package (pip install bitsandbytes)", importlib.util.find_spec("bitsandbytes") is not None),
            ("a CUDA GPU", torch.cuda.is_available()),
        )
        if not there
    ]
    if missing:
        raise ConfigError(
            f"model.load_in_4bit (QLoRA) needs {' and '.join(missing)}, which this machine lacks; "
            "train the base in bfloat16 instead (--no-load-in-4bit --dtype bfloat16)"
        )
    if is_sharded(accelerator):
        raise ConfigError(
            "model.load_in_4bit runs on one GPU or under DDP; FSDP and DeepSpeed shard parameters "
            "that bitsandbytes keeps packed: use a DDP or single-device accelerate config"
        )


def check_parallelism(cfg: dict, cp_size: int) -> None:
    if cp_size > 1:
        spec, _, _ = rope_ext.method.check(cfg["patch"]["method"], cfg["patch"]["factor"], cfg["patch"]["params"])
        if spec.dynamic or cfg["training"]["s2_groups"]:
            raise ConfigError(
                "context parallelism supports static methods with full attention only (no dynamic method, no s2_groups)"
            )
        if cfg["model"]["attn_implementation"] != "sdpa":
            raise ConfigError("context parallelism needs model.attn_implementation: sdpa")
        if cfg["training"]["pose"]:
            raise ConfigError(
                "training.pose cannot run under context parallelism: PoSE's skipped position ids go with an "
                "attention mask (so that transformers does not cut attention at the skip) that context "
                "parallelism does not shard; PoSE trains at the original window, which needs no sequence sharding"
            )


def length_multiple(cfg: dict, cp_size: int) -> tuple[int, list[str]]:
    """The number the training length must be a multiple of, and why."""
    multiple, reasons = 1, []
    if cfg["training"]["s2_groups"]:
        g = cfg["training"]["s2_groups"]
        multiple = math.lcm(multiple, 2 * g)
        reasons.append(f"shifted sparse attention with {g} groups of even size needs a multiple of {2 * g}")
    if cp_size > 1:
        multiple = math.lcm(multiple, 2 * cp_size)
        reasons.append(f"context parallelism over {cp_size} ranks splits the sequence into {2 * cp_size} load-balanced chunks")
    return multiple, reasons


def check_length(cfg: dict, seq_len: int, max_length: int, cp_size: int) -> None:
    if seq_len > max_length:
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than the patched window {max_length} "
            f"({cfg['patch']['method']} x{cfg['patch']['factor']}); raise patch.factor or shorten the sequences"
        )
    multiple, reasons = length_multiple(cfg, cp_size)
    if seq_len % multiple:
        lower, upper = seq_len // multiple * multiple, (seq_len // multiple + 1) * multiple
        raise ConfigError(
            f"the training length {seq_len} is not a multiple of {multiple}: {'; '.join(reasons)}. "
            f"Use --seq-len {lower or upper}" + (f" or {upper}" if lower and upper <= max_length else "")
        )


def check_pose_length(seq_len: int, original_window: int) -> None:
    if seq_len > original_window:
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than the original window {original_window}: PoSE (training.pose) "
            f"trains at the original window or shorter; use --seq-len {original_window} or less"
        )


def check_sequences(sequences, seq_len: int, batch_size: int, dp_size: int) -> None:
    per_step = batch_size * dp_size
    if len(sequences) < per_step:
        raise ConfigError(
            f"the training data gives {len(sequences)} sequence(s) of {seq_len + 1} tokens; one micro-step over "
            f"{dp_size} rank(s) x batch {batch_size} needs {per_step}: add text or shorten data.seq_len"
        )


def check_eval_documents(documents: list, seq_len: int, max_tokens: int) -> None:
    if min(len(d) for d in documents) < seq_len:
        raise ConfigError(
            f"eval: {len(documents)} document(s) sharing eval.max_tokens={max_tokens} leaves one shorter "
            f"than a window of {seq_len} tokens; raise eval.max_tokens or name fewer, longer documents in eval.include"
        )
