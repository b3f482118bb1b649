"""LoRA fine-tune of a rope-ext patched model at its extended window (YaRN / LongLoRA style).

    accelerate launch recipes/finetune.py --config recipes/configs/finetune_tiny.yaml [--flags]
    python recipes/finetune.py --config ...            # one process, same thing

Loads a checkpoint ("smollm2" = the embedded SmolLM2, "tiny" = the test suite's tiny model, a
local folder or a hub id), patches it with `rope_ext.patch(method, factor)`, wraps it in a peft
LoRA (optionally training embeddings and norms too, as LongLoRA does), packs documents into
sequences of the target length and trains with warmup + cosine, gradient accumulation and
(optionally) gradient checkpointing and LongLoRA's shifted sparse attention. Flags override the
YAML. Runs on one CPU, DDP, FSDP2 or DeepSpeed through accelerate (recipes/configs/accelerate/).

Output folder: the adapter + tokenizer + rope_ext_finetune.json (reload with
`rope_ext.lora.load_finetuned(out)`), train_log.json and results.md (the perplexity at the
target length over training), checkpoints/step-N (every --save-every steps, written atomically;
`--resume` continues from the newest with the same data order) and, with --merge, merged/ (a full
patched model: `rope_ext.from_pretrained(out / "merged")`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from rope_ext.evals.loading import parse_params

RECIPES = Path(__file__).resolve().parent

# Every key the YAML may set, with its default. Unknown keys are an error (a typo must not be
# silently ignored).
DEFAULTS: dict = {
    "model": {
        "path": "smollm2",  # smollm2 | tiny | local folder | hub id
        "attn_implementation": "sdpa",
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
        "seq_len": None,  # default: the patched window, original_window * factor
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
        "precision": "auto",  # auto: bf16 (fp16 where unsupported) on GPU, fp32 on CPU; overrides the accelerate config
        "s2_groups": 0,  # LongLoRA shifted sparse attention with this many groups (0: full attention)
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
    },
}

# Sections whose values change what is trained: a resumed run must match them exactly.
IDENTITY_SECTIONS = ("model", "patch", "lora", "data", "training")

# The LoRA targets when lora.target_modules is "auto", by rope_ext family adapter name.
FAMILY_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "glm": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "chatglm": ["query_key_value", "dense"],
}


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


# (flag, config key, type, help). argparse and the override both come from this table.
FLAGS = [
    ("--model", "model.path", str, "smollm2 | tiny | local folder | hub id"),
    ("--attn-implementation", "model.attn_implementation", str, "transformers attention backend"),
    ("--method", "patch.method", str, "rope-ext method (rope_ext.methods())"),
    ("--factor", "patch.factor", float, "scale over the model's original window"),
    ("--lora-r", "lora.r", int, "LoRA rank"),
    ("--lora-alpha", "lora.alpha", float, "LoRA alpha"),
    ("--lora-dropout", "lora.dropout", float, "LoRA dropout"),
    ("--target-modules", "lora.target_modules", _csv, "comma-separated module names, or auto"),
    ("--train-embeddings", "lora.train_embeddings", bool, "also train the input embeddings (LongLoRA)"),
    ("--train-norms", "lora.train_norms", bool, "also train the normalisation layers (LongLoRA)"),
    ("--dataset", "data.source", str, "gutenberg | text/JSONL file or folder | datasets id (clears data.exclude)"),
    ("--dataset-split", "data.split", str, "datasets split"),
    ("--text-field", "data.text_field", str, "datasets text column"),
    ("--seq-len", "data.seq_len", int, "training sequence length (default: the patched window)"),
    ("--max-steps", "training.max_steps", int, "optimizer steps"),
    ("--batch-size", "training.batch_size", int, "sequences per device per micro-step"),
    ("--grad-accum", "training.grad_accum", int, "micro-steps per optimizer step"),
    ("--lr", "training.lr", float, "peak learning rate"),
    ("--warmup-steps", "training.warmup_steps", int, "linear warmup steps before the cosine decay"),
    ("--weight-decay", "training.weight_decay", float, "AdamW weight decay"),
    ("--grad-clip", "training.grad_clip", float, "gradient norm clip (0: off)"),
    ("--gradient-checkpointing", "training.gradient_checkpointing", bool, "recompute activations in backward"),
    ("--precision", "training.precision", str, "auto | no | bf16 | fp16"),
    ("--s2-groups", "training.s2_groups", int, "LongLoRA shifted sparse attention groups (0: off)"),
    ("--seed", "training.seed", int, "seed for LoRA init, data order and dropout"),
    ("--eval-every", "eval.every", int, "perplexity eval at the target length every N steps (0: off)"),
    ("--eval-tokens", "eval.max_tokens", int, "held-out tokens scored per eval"),
    ("--out", "output.dir", str, "output folder"),
    ("--save-every", "output.save_every", int, "checkpoint every N steps (0: no checkpoints)"),
    ("--keep-checkpoints", "output.keep", int, "checkpoints kept on disk"),
    ("--merge", "output.merge", bool, "also write merged full weights to OUT/merged"),
]


class ConfigError(ValueError):
    """A bad setting, found before any training starts."""


# --------------------------------------------------------------------------------------------
# Configuration


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


def parse_args(argv: list[str] | None = None) -> tuple[dict, str | None]:
    """(config, resume) from the YAML and the flags; flags win."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML config (recipes/configs/finetune_*.yaml)")
    parser.add_argument(
        "--resume", nargs="?", const="latest", default=None,
        help="continue from the newest checkpoint in --out (or from the checkpoint folder given)",
    )
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="method parameter, repeatable")
    for flag, key, kind, help_text in FLAGS:
        if kind is bool:
            parser.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=key, type=kind, default=None, help=help_text)
    args = parser.parse_args(argv)

    cfg = copy.deepcopy(DEFAULTS)
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"config {path} does not exist")
        cfg = _merge(cfg, yaml.safe_load(path.read_text()) or {})
    for _, key, _, _ in FLAGS:
        value = getattr(args, key)
        if value is not None:
            section, name = key.split(".")
            cfg[section][name] = value
    if args.__dict__["data.source"] is not None:
        cfg["data"]["exclude"] = []  # the YAML's names belong to the YAML's source
    try:
        cfg["patch"]["params"].update(parse_params(args.param))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_config(cfg)
    return cfg, args.resume


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
    import rope_ext

    known = rope_ext.methods()
    method = cfg["patch"]["method"]
    if method not in known:
        raise ConfigError(f"unknown method {method!r}; valid methods: {', '.join(known)}")
    for key in ("training.max_steps", "training.batch_size", "training.grad_accum", "lora.r", "eval.max_tokens"):
        _positive_int(cfg, key)
    for key in ("training.warmup_steps", "training.s2_groups", "eval.every", "output.save_every", "output.keep"):
        _positive_int(cfg, key, minimum=0)
    for key in ("training.lr", "training.weight_decay", "training.grad_clip", "lora.alpha", "lora.dropout"):
        _number(cfg, key)
    if cfg["data"]["seq_len"] is not None:
        _positive_int(cfg, "data.seq_len", minimum=2)
    if cfg["training"]["warmup_steps"] >= cfg["training"]["max_steps"]:
        raise ConfigError("training.warmup_steps must be smaller than training.max_steps")
    if cfg["training"]["precision"] not in ("auto", "no", "bf16", "fp16"):
        raise ConfigError(f"training.precision must be auto, no, bf16 or fp16, got {cfg['training']['precision']!r}")
    if not 0 <= cfg["lora"]["dropout"] < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {cfg['lora']['dropout']}")
    if cfg["training"]["s2_groups"] and known[method]["dynamic"]:
        raise ConfigError(f"shifted sparse attention (training.s2_groups) cannot be combined with the dynamic method {method!r}")


def config_digest(cfg: dict) -> str:
    identity = {k: cfg[k] for k in IDENTITY_SECTIONS}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _diff(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{where}{k}.")]
    return [] if a == b else [f"{where.rstrip('.')}: {b!r} in the run folder, {a!r} now"]


# --------------------------------------------------------------------------------------------
# Model, data


def _pretrain_tiny():
    spec = importlib.util.spec_from_file_location("pretrain_tiny", RECIPES / "pretrain_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resolve_model(name: str) -> tuple[str, str]:
    """(path or hub id to load, name to record for reloading)."""
    from rope_ext.lora import EMBEDDED_DEFAULT, resolve_base

    if name == EMBEDDED_DEFAULT:
        return resolve_base(name), name
    if name == "tiny":
        path = str(_pretrain_tiny().ensure_tiny())
        return path, path
    if Path(name).exists():
        path = str(Path(name).resolve())
        return path, path
    return name, name  # a hub id


def load_documents(spec: dict, names_key: str, tokenizer) -> list:
    """Tokenized documents (rope_ext.evals.data.Document) of a `data` or `eval` section:
    `names_key` "exclude" drops the named documents, "include" keeps only them."""
    from rope_ext.evals.data import iter_texts

    texts = list(iter_texts(spec["source"], spec["split"], spec["text_field"]))
    names = set(spec[names_key])
    unknown = sorted(names - {name for name, _ in texts})
    if unknown:
        raise ConfigError(f"{names_key}: no document named {unknown} in {spec['source']!r}; names: {sorted(n for n, _ in texts)}")
    if names_key == "exclude":
        texts = [(n, t) for n, t in texts if n not in names]
    elif names:
        texts = [(n, t) for n, t in texts if n in names]
    try:
        return tokenize_cached(texts, tokenizer)
    except ValueError as err:
        raise ConfigError(f"{spec['source']!r}: {err}") from None


def tokenize_cached(texts: list[tuple[str, str]], tokenizer) -> list:
    """rope_ext.evals.data.tokenize_documents, kept on disk under cache_dir() by a hash of the
    texts and the tokenizer: every rank of every run over the same corpus tokenizes it once."""
    from rope_ext.defaults import cache_dir
    from rope_ext.evals.data import Document, tokenize_documents

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer has no serialised form to key the cache on
        return tokenize_documents(tokenizer, texts)
    digest = hashlib.sha256(backend.to_str().encode())
    for name, text in texts:
        digest.update(f"{len(name)}:{name}:{len(text)}:".encode())
        digest.update(text.encode("utf-8", "surrogatepass"))
    path = cache_dir() / "finetune-tokens" / f"{digest.hexdigest()[:20]}.pt"
    if path.is_file():
        saved = torch.load(path)
        return [Document(name, ids) for name, ids in zip(saved["names"], saved["ids"])]
    documents = tokenize_documents(tokenizer, texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    torch.save({"names": [d.name for d in documents], "ids": [d.ids for d in documents]}, tmp)
    tmp.rename(path)
    return documents


def token_stream(documents: list, eos_id: int | None) -> torch.LongTensor:
    """The documents concatenated, each followed by eos (no bos, as in pretraining)."""
    if eos_id is None:
        raise ConfigError("the tokenizer has no eos token to separate packed documents")
    eos = torch.tensor([eos_id])
    return torch.cat([part for doc in documents for part in (doc.ids, eos)])


def first_tokens(documents: list, limit: int) -> list:
    """Each document cut to its first limit / len(documents) tokens, so that every document
    counts and the eval costs `limit` tokens at most."""
    from rope_ext.evals.data import Document

    share = limit // len(documents)
    return [Document(doc.name, doc.ids[:share]) for doc in documents]


def pack(stream: torch.LongTensor, seq_len: int) -> torch.LongTensor:
    """[n, seq_len + 1] blocks; consecutive blocks share one token, so every token is a target once."""
    n = (len(stream) - 1) // seq_len
    return torch.stack([stream[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)]) if n else stream.new_zeros((0, seq_len + 1))


class DataOrder:
    """Which packed sequence each (step, micro-step, rank, row) trains on: a fresh seeded
    permutation per pass over the data. A pure function of the position, so a resumed run sees
    exactly the batches the interrupted one would have."""

    def __init__(self, n: int, seed: int, batch_size: int, grad_accum: int, world: int):
        self.n, self.seed = n, seed
        self.batch_size, self.grad_accum, self.world = batch_size, grad_accum, world
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))}
        return self._perms[epoch]

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        first = ((step * self.grad_accum + micro) * self.world + rank) * self.batch_size
        return [int(self._perm(k // self.n)[k % self.n]) for k in range(first, first + self.batch_size)]


# --------------------------------------------------------------------------------------------
# LongLoRA shifted sparse attention (training only; evaluation uses the model's full attention)


def s2_attention(groups: int):
    """An AttentionInterface function: causal attention inside `groups` equal blocks of the
    sequence; the second half of the heads uses blocks shifted by half a block, so information
    crosses block borders. The shifted heads' two half-size edge blocks attend on their own
    (no wrap-around, so no token sees the future)."""

    def blocks(q, k, v, size, dropout, scaling):
        b, h, s, d = q.shape
        n = s // size

        def split(x):
            return x.reshape(b, h, n, size, d).transpose(1, 2).reshape(b * n, h, size, d)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), dropout_p=dropout, is_causal=True, scale=scaling)
        return out.reshape(b, n, h, size, d).transpose(1, 2).reshape(b, h, s, d)

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        _, heads, seq, _ = query.shape
        size = seq // groups
        if seq % groups or size % 2:
            raise ValueError(f"shifted sparse attention needs a length divisible by {2 * groups}, got {seq}")
        repeat = heads // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        half, edge = heads // 2, size // 2
        plain = blocks(query[:, :half], key[:, :half], value[:, :half], size, dropout, scaling)
        qs, ks, vs = query[:, half:], key[:, half:], value[:, half:]
        middle = blocks(qs[:, :, edge:-edge], ks[:, :, edge:-edge], vs[:, :, edge:-edge], size, dropout, scaling)

        def ends(x):
            return torch.cat((x[:, :, :edge], x[:, :, -edge:]), dim=2)

        outer = blocks(ends(qs), ends(ks), ends(vs), edge, dropout, scaling)
        shifted = torch.cat((outer[:, :, :edge], middle, outer[:, :, edge:]), dim=2)
        return torch.cat((plain, shifted), dim=1).transpose(1, 2).contiguous(), None

    return attention


def register_s2(groups: int) -> str:
    from transformers import AttentionInterface

    name = f"rope_ext_s2_{groups}"
    AttentionInterface.register(name, s2_attention(groups))
    return name


# --------------------------------------------------------------------------------------------
# Checks that need the model, the accelerator and the data


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


def context_parallel_size(accelerator) -> int:
    pc = accelerator.parallelism_config
    return pc.cp_size if pc is not None and pc.cp_enabled else 1


def data_parallel_rank(accelerator) -> tuple[int, int]:
    """(rank, size) over the ranks that get different data: ranks of one context-parallel group
    share a batch."""
    pc = accelerator.parallelism_config
    if pc is not None and pc.cp_enabled:
        if pc.data_parallel_size == 1:
            return 0, 1
        return accelerator.torch_device_mesh["dp"].get_local_rank(), pc.data_parallel_size
    return accelerator.process_index, accelerator.num_processes


def has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 knows every device type
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def choose_precision(setting: str) -> str:
    """auto: bf16 on a GPU that has it, else fp16 on a GPU, fp32 on CPU."""
    if setting != "auto":
        return setting
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "no"


# --------------------------------------------------------------------------------------------
# Checkpoints


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a checkpoint is complete once renamed into place)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(accelerator, out: Path, step: int, digest: str, keep: int, evals: list[dict]) -> None:
    """accelerate's full training state (model, optimizer, scheduler, RNG of every rank) into a
    temporary folder, renamed into place only when every rank has finished writing."""
    root = out / "checkpoints"
    tmp = root / f".step-{step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"step": step, "config_digest": digest, "evals": evals}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
        final = root / f"step-{step}"
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoints(out)[:-keep] if keep else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def find_resume(out: Path, resume: str, cfg: dict, world: int) -> Path:
    """The checkpoint to resume from, after checking it belongs to this exact configuration."""
    run_config = out / "run_config.json"
    if not run_config.is_file():
        raise ConfigError(f"--resume: {out} is not a fine-tune run folder (no run_config.json)")
    saved = json.loads(run_config.read_text())
    differences = [d for s in IDENTITY_SECTIONS for d in _diff(cfg[s], saved["config"].get(s), f"{s}.")]
    if differences:
        raise ConfigError(f"--resume: {out} was trained with another configuration:\n  " + "\n  ".join(differences))
    if saved["data_parallel_size"] != world:
        raise ConfigError(
            f"--resume: {out} was trained on {saved['data_parallel_size']} data-parallel rank(s), this launch has {world}; "
            "the data order and batch size depend on it"
        )
    if resume == "latest":
        found = checkpoints(out)
        if not found:
            raise ConfigError(f"--resume: no checkpoint in {out / 'checkpoints'}")
        return found[-1]
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise ConfigError(f"--resume {path}: not a complete checkpoint folder")
    if json.loads((path / "trainer_state.json").read_text())["config_digest"] != config_digest(cfg):
        raise ConfigError(f"--resume {path}: this checkpoint was written by another configuration")
    return path


# --------------------------------------------------------------------------------------------
# Evaluation


def evaluate(model, documents: list, seq_len: int) -> dict:
    """Perplexity at the training length (rope_ext.evals.perplexity, non-overlapping windows)."""
    from rope_ext.evals.perplexity import evaluate as perplexity

    was_training = model.training
    model.eval()
    # FSDP2 keeps the root module's parameters (embeddings, final norm, LM head) sharded outside
    # its own forward; the eval calls the decoder and the head separately, so gather them first.
    gathered = hasattr(model, "unshard") and hasattr(model, "reshard")
    if gathered:
        model.unshard()
    try:
        result = perplexity(model, documents, [seq_len], progress=False)[seq_len]
    finally:
        if gathered:
            model.reshard()
        model.train(was_training)
    return {"ppl": round(result["ppl"], 4), "nll": round(result["nll"], 5), "tokens": result["tokens"]}


# --------------------------------------------------------------------------------------------
# Training


def trainable_extras(model, cfg: dict) -> list[str]:
    """Module names peft should train in full (LongLoRA's embeddings and norms)."""
    names = []
    if cfg["lora"]["train_embeddings"]:
        embed = model.get_input_embeddings()
        names += [n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is embed]
    if cfg["lora"]["train_norms"]:
        names += sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if "norm" in type(m).__name__.lower() and n})
    return names


def param_digest(model) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def write_results(out: Path, log: dict) -> None:
    rows = [
        f"| {e['step']} | {e['ppl']:.3f} | {e['nll']:.4f} | {e['tokens']} |" for e in log["evals"]
    ]
    patch = log["config"]["patch"]
    text = "\n".join([
        f"# Fine-tune: {patch['method']} x{patch['factor']} at {log['seq_len']} tokens",
        "",
        f"Base model `{log['base_model']}` (window {log['patch']['original_window']}), LoRA r={log['config']['lora']['r']}, "
        f"{log['steps']} steps, {log['tokens_trained']:,} tokens, {log['seconds']} s ({log['tokens_per_s']:,} tokens/s).",
        "",
        f"Held-out perplexity at {log['seq_len']} tokens (step 0 = the training-free patch):",
        "",
        "| step | PPL | NLL | tokens |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    (out / "results.md").write_text(text)


def train(cfg: dict, resume: str | None) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, gather_object, set_seed
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

    import rope_ext
    from rope_ext.lora import load_finetuned, save_record

    run = cfg["training"]
    accelerator = Accelerator(
        mixed_precision=choose_precision(run["precision"]),
        gradient_accumulation_steps=run["grad_accum"],
        # On a machine without an accelerator this makes a multi-process launch (torchrun,
        # `accelerate launch --multi_gpu`, recipes/configs/accelerate/cpu_ddp.yaml) CPU DDP over gloo.
        cpu=not has_accelerator(),
    )
    main = accelerator.is_main_process
    out = Path(cfg["output"]["dir"]).resolve()
    dp_rank, dp_size = data_parallel_rank(accelerator)
    cp_size = context_parallel_size(accelerator)
    digest = config_digest(cfg)

    # ---- everything that can refuse the run happens before the first step
    if resume:
        resume_from = find_resume(out, resume, cfg, dp_size)
    elif checkpoints(out) or (out / "adapter_config.json").exists():
        raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    if cp_size > 1:
        if rope_ext.methods()[cfg["patch"]["method"]]["dynamic"] or run["s2_groups"]:
            raise ConfigError("context parallelism supports static methods with full attention only (no dynamic method, no s2_groups)")
        if cfg["model"]["attn_implementation"] != "sdpa":
            raise ConfigError("context parallelism needs model.attn_implementation: sdpa")

    with accelerator.main_process_first():
        model_path, base_record = resolve_model(cfg["model"]["path"])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=cfg["model"]["attn_implementation"]
    )
    try:
        info = rope_ext.patch(model, cfg["patch"]["method"], cfg["patch"]["factor"], **cfg["patch"]["params"])
    except ValueError as err:
        raise ConfigError(f"rope_ext.patch: {err}") from None
    seq_len = cfg["data"]["seq_len"] or info.max_length
    check_length(cfg, seq_len, info.max_length, cp_size)

    with accelerator.main_process_first():  # the first rank fills the token cache for the others
        train_docs = load_documents(cfg["data"], "exclude", tokenizer)
        eval_docs = load_documents(cfg["eval"], "include", tokenizer) if cfg["eval"]["every"] else None
    sequences = pack(token_stream(train_docs, tokenizer.eos_token_id), seq_len)
    per_step = run["batch_size"] * dp_size
    if len(sequences) < per_step:
        raise ConfigError(
            f"the training data gives {len(sequences)} sequence(s) of {seq_len + 1} tokens; one micro-step over "
            f"{dp_size} rank(s) x batch {run['batch_size']} needs {per_step}: add text or shorten data.seq_len"
        )
    if eval_docs is not None:
        eval_docs = first_tokens(eval_docs, cfg["eval"]["max_tokens"])
        if min(len(d) for d in eval_docs) < seq_len:
            raise ConfigError(
                f"eval: {len(eval_docs)} document(s) sharing eval.max_tokens={cfg['eval']['max_tokens']} leaves one shorter "
                f"than a window of {seq_len} tokens; raise eval.max_tokens or name fewer, longer documents in eval.include"
            )

    targets = cfg["lora"]["target_modules"]
    if targets == "auto":
        if info.family not in FAMILY_TARGETS:
            raise ConfigError(f"no default LoRA targets for family {info.family!r}: set lora.target_modules")
        targets = FAMILY_TARGETS[info.family]
    missing = [t for t in targets if not any(n.split(".")[-1] == t for n, _ in model.named_modules())]
    if missing:
        raise ConfigError(f"lora.target_modules {missing} name no module of {type(model).__name__}")

    # ---- model
    set_seed(run["seed"])
    if run["gradient_checkpointing"]:
        model.activation_checkpointing_enable({"use_reentrant": False})
    model.config.use_cache = False
    extras = trainable_extras(model, cfg)
    lora = LoraConfig(
        r=cfg["lora"]["r"], lora_alpha=cfg["lora"]["alpha"], lora_dropout=cfg["lora"]["dropout"],
        target_modules=targets, modules_to_save=extras or None, task_type="CAUSAL_LM",
        # a trained copy of tied input embeddings must stay tied to the LM head
        ensure_weight_tying=cfg["lora"]["train_embeddings"] and bool(getattr(model.config, "tie_word_embeddings", False)),
    )
    model = get_peft_model(model, lora)
    full_attention = model.get_base_model().config._attn_implementation
    if run["s2_groups"]:
        model.get_base_model().set_attn_implementation(register_s2(run["s2_groups"]))

    # Norm gains are not decayed: shrinking them only fights the normalisation.
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay, no_decay = [p for p in trainable if p.dim() >= 2], [p for p in trainable if p.dim() < 2]
    n_trainable, n_total = sum(p.numel() for p in trainable), sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": run["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}], lr=run["lr"]
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, run["warmup_steps"], run["max_steps"])
    if accelerator.state.deepspeed_plugin is not None:
        # No dataloader goes through prepare(), so DeepSpeed is told the micro-batch size here.
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = run["batch_size"]
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler is stepped once per optimizer step by this loop (a prepared one would step
    # once per process), and checkpointed with the rest of the state.
    accelerator.register_for_checkpointing(scheduler)

    start, evals = 0, []
    if resume:
        accelerator.load_state(str(resume_from))
        resumed = json.loads((resume_from / "trainer_state.json").read_text())
        start, evals = resumed["step"], resumed["evals"]
    elif main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(
            {"config": cfg, "config_digest": digest, "data_parallel_size": dp_size}, indent=2, default=str
        ) + "\n")
    accelerator.wait_for_everyone()

    order = DataOrder(len(sequences), run["seed"], run["batch_size"], run["grad_accum"], dp_size)
    positions = torch.arange(seq_len, device=accelerator.device)[None].expand(run["batch_size"], -1)
    tokens_per_step = run["batch_size"] * seq_len * run["grad_accum"] * dp_size

    # A replicated model (DDP, one process) is evaluated by the main process alone; a sharded one
    # (FSDP, DeepSpeed) needs every rank in each forward.
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    def run_eval(step: int) -> None:
        paused = time.perf_counter()
        if main or sharded:
            base = accelerator.unwrap_model(model).get_base_model()
            if run["s2_groups"]:  # evaluate as the model will be used: full attention
                base.set_attn_implementation(full_attention)
            result = {"step": step, **evaluate(accelerator.unwrap_model(model), eval_docs, seq_len)}
            if run["s2_groups"]:
                base.set_attn_implementation(register_s2(run["s2_groups"]))
            evals[:] = [e for e in evals if e["step"] != step] + [result]
            if main:
                tqdm.write(f"step {step}: held-out PPL at {seq_len} tokens = {result['ppl']:.3f}")
        accelerator.wait_for_everyone()
        pauses.append(time.perf_counter() - paused)

    pauses: list[float] = []  # eval and checkpoint seconds, left out of the throughput
    if eval_docs is not None and start == 0:
        run_eval(0)
    pauses.clear()  # the step-0 eval runs before the clock starts

    model.train()
    bar = tqdm(total=run["max_steps"], initial=start, disable=not main, unit="step",
               desc=f"{info.method} x{info.factor:g} @ {seq_len} ({n_trainable / 1e6:.2f}M of {n_total / 1e6:.1f}M trainable)")
    began, losses = time.perf_counter(), []
    for step in range(start, run["max_steps"]):
        step_loss = torch.zeros((), device=accelerator.device)
        for micro in range(run["grad_accum"]):
            batch = sequences[order.indices(step, micro, dp_rank)].to(accelerator.device)
            inputs, labels, pos = batch[:, :-1].contiguous(), batch[:, 1:].contiguous(), positions.clone()
            # Context parallelism shards the sequence of every buffer in place (a no-op without it).
            split = accelerator.maybe_context_parallel(
                buffers=[inputs, labels, pos], buffer_seq_dims=[1, 1, 1], no_restore_buffers={inputs, labels, pos}
            ) if cp_size > 1 else contextlib.nullcontext()
            with accelerator.accumulate(model), split:
                logits = model(input_ids=inputs, position_ids=pos, use_cache=False).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                accelerator.backward(loss)
                if accelerator.sync_gradients and run["grad_clip"]:
                    accelerator.clip_grad_norm_(model.parameters(), run["grad_clip"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach() / run["grad_accum"]
        if not optimizer.step_was_skipped:
            scheduler.step()
        losses = (losses + [accelerator.reduce(step_loss, "mean").item()])[-20:]
        done = step + 1
        elapsed = time.perf_counter() - began - sum(pauses)
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses) / len(losses):.4f}", tok_s=f"{tokens_per_step * (done - start) / elapsed:,.0f}",
                        lr=f"{scheduler.get_last_lr()[0]:.2e}")
        if eval_docs is not None and (done % cfg["eval"]["every"] == 0 or done == run["max_steps"]):
            run_eval(done)
        if cfg["output"]["save_every"] and done % cfg["output"]["save_every"] == 0 and done < run["max_steps"]:
            paused = time.perf_counter()
            save_checkpoint(accelerator, out, done, digest, cfg["output"]["keep"], evals)
            pauses.append(time.perf_counter() - paused)
    bar.close()
    seconds = time.perf_counter() - began - sum(pauses)

    # ---- outputs
    rank_digests = None
    if accelerator.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        # DDP keeps a full replica per rank: they must agree bit for bit.
        rank_digests = gather_object([param_digest(accelerator.unwrap_model(model))])
        if len(set(rank_digests)) > 1:
            raise RuntimeError(f"data-parallel ranks ended with different weights: {rank_digests}")
    if run["s2_groups"]:
        accelerator.unwrap_model(model).get_base_model().set_attn_implementation(full_attention)
    state = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(str(out), state_dict=state, is_main_process=main)
    log = {}
    if main:
        tokenizer.save_pretrained(out)
        save_record(out, base_record, unwrapped, {"seq_len": seq_len})
        log = {
            "config": cfg,
            "base_model": base_record,
            "patch": info.to_dict(),
            "seq_len": seq_len,
            "sequences_available": len(sequences),
            "trainable_params": n_trainable,
            "total_params": n_total,
            "steps": run["max_steps"],
            "resumed_from_step": start,
            "tokens_trained": tokens_per_step * (run["max_steps"] - start),
            "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens_per_step * (run["max_steps"] - start) / seconds),
            "final_loss": round(sum(losses) / len(losses), 5) if losses else None,
            "evals": sorted(evals, key=lambda e: e["step"]),
            "processes": accelerator.num_processes,
            "data_parallel_size": dp_size,
            "distributed_type": accelerator.distributed_type.name,
            "mixed_precision": accelerator.mixed_precision,
            "rank_digests": rank_digests,
        }
        (out / "train_log.json").write_text(json.dumps(log, indent=2, default=str) + "\n")
        write_results(out, log)
        if cfg["output"]["merge"]:
            merged = load_finetuned(out, merge=True, dtype=torch.float32)
            merged.save_pretrained(out / "merged")
            tokenizer.save_pretrained(out / "merged")
        print(f"rope-ext: fine-tune written to {out}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return log


def main(argv: list[str] | None = None) -> dict:
    try:
        cfg, resume = parse_args(argv)
        return train(cfg, resume)
    except ConfigError as err:
        if __name__ == "__main__":
            sys.exit(f"finetune: error: {err}")
        raise


if __name__ == "__main__":
    main()
