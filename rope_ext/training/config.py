"""The fine-tune's configuration: every key with its default, the YAML and flags that override
them, and the checks that need no model and no data."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
from importlib import resources
from pathlib import Path

import yaml

import rope_ext
import rope_ext.method
from rope_ext.loading import DTYPES, parse_params

# The recipes' configs: recipes/configs in a checkout, shipped in the wheel as rope_ext/recipes/configs.
CONFIGS = Path(str(resources.files("rope_ext.recipes") / "configs"))

# Every key the YAML may set, with its default. Unknown keys are an error (a typo must not be
# silently ignored).
DEFAULTS: dict = {
    "model": {
        "path": "smollm2",  # smollm2 | tiny | local folder | hub id
        "attn_implementation": "sdpa",
        # the frozen base's weights; LoRA and the trainable embeddings/norms train in float32 on top
        "dtype": "float32",  # float32 | bfloat16 | float16
        "load_in_4bit": False,  # QLoRA: the base quantized to 4-bit NF4 by bitsandbytes (CUDA only)
    },
    "patch": {"method": "yarn", "factor": 4.0, "params": {}},
    "lora": {
        "r": 8,
        "alpha": 16,
        "dropout": 0.0,
        "target_modules": "auto",  # auto = the attention projections of the model family
        "train_embeddings": False,  # LongLoRA: embeddings and norms trainable next to the LoRA weights
        "train_norms": False,
    },
    # Text sources as rope_ext.evals.data reads them: gutenberg (one document per play, named by
    # file stem), a local text/JSONL file or folder, or a `datasets` id.
    "data": {
        "source": "gutenberg",
        "exclude": [],  # document names kept out of training
        "split": "train",
        "text_field": "text",
        "seq_len": None,  # default: the patched window, original_window * factor (the original window with training.pose)
        "num_proc": 1,  # processes tokenizing the documents (datasets' Dataset.map)
    },
    "training": {
        "seed": 0,
        "max_steps": 1000,
        "batch_size": 1,  # sequences per device per micro-step
        "grad_accum": 8,
        "lr": 2.0e-4,
        "warmup_steps": 20,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "gradient_checkpointing": True,
        # None: accelerate's setting (`accelerate config`, `--mixed_precision`); auto: bf16 (fp16
        # where unsupported) on GPU, fp32 on CPU; no, bf16, fp16 as accelerate names them
        "precision": None,
        "s2_groups": 0,  # LongLoRA shifted sparse attention with this many groups (0: full attention)
        "pose": False,  # PoSE: train at data.seq_len <= the original window with position ids that skip up to the patched window
    },
    "eval": {
        "every": 0,  # perplexity at the target length every N steps (and before/after training); 0: off
        "source": "gutenberg",
        "include": [],  # document names to evaluate on (empty: every document)
        "split": "validation",
        "text_field": "text",
        "max_tokens": 65536,  # in all: each document is cut to its first max_tokens / documents tokens
    },
    "output": {
        "dir": "runs/finetune",
        "save_every": 100,
        "keep": 2,  # checkpoints kept on disk
        "merge": False,
        "log_with": [],  # accelerate trackers (tensorboard, wandb, ...) fed the per-step loss, lr and tokens/s
    },
}

# Sections whose values change what is trained: a resumed run must match them exactly, all but
# the keys that only change how the same result is computed.
IDENTITY_SECTIONS = ("model", "patch", "lora", "data", "training")
NOT_IDENTITY = {("data", "num_proc")}
# The autocast a half-precision base needs: the float32 trainable norms and embeddings feed its
# half-precision matmuls.
HALF_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


# (flag, config key, type, help). argparse and the override both come from this table.
FLAGS = [
    ("--model", "model.path", str, "smollm2 | tiny | local folder | hub id"),
    ("--attn-implementation", "model.attn_implementation", str, "transformers attention backend"),
    ("--dtype", "model.dtype", str, "dtype of the frozen base weights: float32 | bfloat16 | float16"),
    ("--load-in-4bit", "model.load_in_4bit", bool, "QLoRA: quantize the frozen base to 4-bit NF4 (bitsandbytes, CUDA)"),
    ("--method", "patch.method", str, "rope-ext method (rope_ext.methods())"),
    ("--factor", "patch.factor", float, "scale over the model's original window"),
    ("--lora-r", "lora.r", int, "LoRA rank"),
    ("--lora-alpha", "lora.alpha", float, "LoRA alpha"),
    ("--lora-dropout", "lora.dropout", float, "LoRA dropout"),
    ("--target-modules", "lora.target_modules", _csv, "comma-separated module names, or auto"),
    ("--train-embeddings", "lora.train_embeddings", bool, "also train the input embeddings (LongLoRA)"),
    ("--train-norms", "lora.train_norms", bool, "also train the normalisation layers (LongLoRA)"),
    ("--dataset", "data.source", str, "gutenberg | text/JSONL file or folder | datasets id (clears data.exclude)"),
    ("--exclude", "data.exclude", _csv, "comma-separated document names kept out of training"),
    ("--dataset-split", "data.split", str, "datasets split"),
    ("--text-field", "data.text_field", str, "datasets text column"),
    ("--num-proc", "data.num_proc", int, "processes tokenizing the documents (datasets map)"),
    ("--seq-len", "data.seq_len", int, "training sequence length (default: the patched window; the original window with --pose)"),
    ("--max-steps", "training.max_steps", int, "optimizer steps"),
    ("--batch-size", "training.batch_size", int, "sequences per device per micro-step"),
    ("--grad-accum", "training.grad_accum", int, "micro-steps per optimizer step"),
    ("--lr", "training.lr", float, "peak learning rate"),
    ("--warmup-steps", "training.warmup_steps", int, "linear warmup steps before the cosine decay"),
    ("--weight-decay", "training.weight_decay", float, "AdamW weight decay"),
    ("--grad-clip", "training.grad_clip", float, "gradient norm clip (0: off)"),
    ("--gradient-checkpointing", "training.gradient_checkpointing", bool, "recompute activations in backward"),
    ("--precision", "training.precision", str, "auto | no | bf16 | fp16 (unset: accelerate's own setting)"),
    ("--s2-groups", "training.s2_groups", int, "LongLoRA shifted sparse attention groups (0: off)"),
    (
        "--pose",
        "training.pose",
        bool,
        "PoSE positional skip-wise training: short sequences, position ids up to the patched window",
    ),
    ("--seed", "training.seed", int, "seed for LoRA init, data order and dropout"),
    ("--eval-every", "eval.every", int, "perplexity eval at the target length every N steps (0: off)"),
    (
        "--eval-source",
        "eval.source",
        str,
        "held-out text: gutenberg | text/JSONL file or folder | datasets id (clears eval.include)",
    ),
    ("--eval-include", "eval.include", _csv, "comma-separated document names to evaluate on (empty: every document)"),
    ("--eval-split", "eval.split", str, "datasets split of the held-out text"),
    ("--eval-text-field", "eval.text_field", str, "datasets text column of the held-out text"),
    ("--eval-tokens", "eval.max_tokens", int, "held-out tokens scored per eval"),
    ("--out", "output.dir", str, "output folder"),
    ("--save-every", "output.save_every", int, "checkpoint every N steps (0: no checkpoints)"),
    ("--keep-checkpoints", "output.keep", int, "checkpoints kept on disk"),
    ("--merge", "output.merge", bool, "also write merged full weights to OUT/merged"),
    ("--log-with", "output.log_with", _csv, "comma-separated accelerate trackers, e.g. tensorboard (logs in OUT/logs)"),
]


class ConfigError(ValueError):
    """A bad setting, found before any training starts."""


def config_file(name: str | Path) -> Path:
    """`name` as a path, or else the shipped config of that name (`finetune_tiny.yaml`), so that
    the configs the docs name serve an install without the checkout too."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if (CONFIGS / path).is_file():
        return CONFIGS / path
    shipped = ", ".join(sorted(p.name for p in CONFIGS.glob("finetune_*.yaml")))
    raise ConfigError(f"config {path} does not exist (shipped configs, by name: {shipped})")


def _merge(base: dict, update: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in (update or {}).items():
        if key not in base:
            raise ConfigError(f"unknown config key {where}{key!r}; valid keys here: {', '.join(base)}")
        if isinstance(base[key], dict) and key != "params":
            if not isinstance(value, dict):
                raise ConfigError(f"config key {where}{key} must be a mapping, got {value!r}")
            out[key] = _merge(base[key], value, f"{where}{key}.")
        else:
            out[key] = value
    return out


def parse_args(argv: list[str] | None = None, description: str | None = None) -> tuple[dict, str | None]:
    """(config, resume) from the YAML and the flags; flags win."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config: a path, or a shipped config's name (finetune_tiny.yaml)")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue from the newest checkpoint in --out (or from the checkpoint folder given)",
    )
    parser.add_argument(
        "--param", action="append", default=[], metavar="KEY=VALUE", help="method parameter (patch.params), repeatable"
    )
    for flag, key, kind, help_text in FLAGS:
        # the default shown is the built-in one; the flag's own default (None) means "keep the YAML's"
        section, name = key.split(".")
        shown = f"{help_text} (default: {_shown(DEFAULTS[section][name])})"
        if kind is bool:
            parser.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=shown)
        else:
            parser.add_argument(flag, dest=key, type=kind, default=None, help=shown)
    args = parser.parse_args(argv)

    cfg = copy.deepcopy(DEFAULTS)
    if args.config:
        path = config_file(args.config)
        cfg = _merge(cfg, yaml.safe_load(path.read_text()) or {})
    for _, key, _, _ in FLAGS:
        value = getattr(args, key)
        if value is not None:
            section, name = key.split(".")
            cfg[section][name] = value
    # the YAML's names belong to the YAML's source
    if args.__dict__["data.source"] is not None and args.__dict__["data.exclude"] is None:
        cfg["data"]["exclude"] = []
    if args.__dict__["eval.source"] is not None and args.__dict__["eval.include"] is None:
        cfg["eval"]["include"] = []
    try:
        cfg["patch"]["params"].update(parse_params(args.param))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_config(cfg)
    return cfg, args.resume


def _shown(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, list):
        return ",".join(value) or "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _positive_int(cfg: dict, key: str, minimum: int = 1) -> None:
    section, name = key.split(".")
    value = cfg[section][name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")


def _number(cfg: dict, key: str, minimum: float = 0.0) -> None:
    """A float >= minimum; YAML reads `2e-4` (no dot) as a string, so numeric strings are accepted."""
    section, name = key.split(".")
    value = cfg[section][name]
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number) or number < minimum:
        raise ConfigError(f"{key} must be a number >= {minimum}, got {value!r}")
    cfg[section][name] = number


def check_config(cfg: dict) -> None:
    """Checks that need no model and no data."""
    method = cfg["patch"]["method"]
    try:
        spec, _, _ = rope_ext.method.check(method, cfg["patch"]["factor"], cfg["patch"]["params"])
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for key in ("training.max_steps", "training.batch_size", "training.grad_accum", "lora.r", "eval.max_tokens", "data.num_proc"):
        _positive_int(cfg, key)
    for key in ("training.warmup_steps", "training.s2_groups", "eval.every", "output.save_every", "output.keep"):
        _positive_int(cfg, key, minimum=0)
    for key in ("training.lr", "training.weight_decay", "training.grad_clip", "lora.alpha", "lora.dropout"):
        _number(cfg, key)
    if cfg["data"]["seq_len"] is not None:
        _positive_int(cfg, "data.seq_len", minimum=2)
    if cfg["training"]["warmup_steps"] >= cfg["training"]["max_steps"]:
        raise ConfigError("training.warmup_steps must be smaller than training.max_steps")
    if cfg["training"]["precision"] not in (None, "auto", "no", "bf16", "fp16"):
        raise ConfigError(
            f"training.precision must be auto, no, bf16, fp16 or unset (accelerate's setting), "
            f"got {cfg['training']['precision']!r}"
        )
    check_dtype(cfg)
    trackers = cfg["output"]["log_with"]
    if not isinstance(trackers, list) or not all(isinstance(t, str) for t in trackers):
        raise ConfigError(f"output.log_with must be a list of tracker names, e.g. [tensorboard], got {trackers!r}")
    if not 0 <= cfg["lora"]["dropout"] < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {cfg['lora']['dropout']}")
    if cfg["training"]["s2_groups"] and (spec.dynamic or spec.needs_attention_interface):
        # the method as bound to its parameters: alibi_hybrid's rope decides whether it rotates in attention
        inside = "rotates queries and keys inside attention" if spec.dynamic else "adds its own step to attention"
        raise ConfigError(
            f"shifted sparse attention (training.s2_groups) replaces the model's attention function, and {method!r} "
            f"with these parameters {inside}: train it with full attention (s2_groups: 0)"
        )
    if cfg["training"]["pose"]:
        check_pose_method(method, spec)
        if cfg["training"]["s2_groups"]:
            raise ConfigError(
                "training.pose cannot be combined with training.s2_groups: PoSE trains at the original window "
                "with full attention, shifted sparse attention at the extended one; use one of them"
            )


def check_dtype(cfg: dict) -> None:
    dtype, precision = cfg["model"]["dtype"], cfg["training"]["precision"]
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not isinstance(cfg["model"]["load_in_4bit"], bool):
        raise ConfigError(f"model.load_in_4bit must be true or false, got {cfg['model']['load_in_4bit']!r}")
    needed = HALF_PRECISION.get(dtype)
    if needed and precision not in (None, "auto", needed):
        raise ConfigError(
            f"model.dtype {dtype} trains under {needed} autocast; training.precision {precision!r} "
            f"does not give it: set training.precision to auto or {needed}"
        )


def pose_refusal(spec) -> str | None:
    """Why PoSE cannot train the (bound) method `spec`, or None: PoSE needs frequencies that are
    fixed and a rotation by the position ids alone."""
    if spec.dynamic:
        return "what a query sees depends on the length it has seen, which skipped position ids misstate"
    if spec.needs_attention_interface:
        return "it acts inside attention on token distances, which PoSE's skipped position ids do not reach"
    return None


def check_pose_method(name: str, spec) -> None:
    reason = pose_refusal(spec)
    if reason:
        static = ", ".join(n for n, m in rope_ext.method.REGISTRY.items() if pose_refusal(m) is None)
        raise ConfigError(f"training.pose cannot train the method {name!r}: {reason}; PoSE trains the static methods: {static}")


def _identity(cfg: dict) -> dict:
    return {s: {k: v for k, v in cfg[s].items() if (s, k) not in NOT_IDENTITY} for s in IDENTITY_SECTIONS}


def config_digest(cfg: dict) -> str:
    identity = _identity(cfg)
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _diff(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{where}{k}.")]
    return [] if a == b else [f"{where.rstrip('.')}: {b!r} in the run folder, {a!r} now"]


def identity_differences(cfg: dict, saved: dict) -> list[str]:
    """What `cfg` changes, against the config a run folder was trained with, that a resumed run
    must keep."""
    now, then = _identity(cfg), _identity({s: saved.get(s) or {} for s in IDENTITY_SECTIONS})
    return [d for s in IDENTITY_SECTIONS for d in _diff(now[s], then[s], f"{s}.")]
