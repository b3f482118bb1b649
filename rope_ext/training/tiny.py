"""The tiny LLaMA that the tests measure context extension on (recipes/pretrain_tiny.py tells why
it is built this way), trained once and cached in cache_dir()/tiny-<hash>.

The hash covers the config, the source of TRAINING_MODULES (this module and the ones it trains
with) and the tokenizer, so a change to any of them trains a new checkpoint and a change
elsewhere does not.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from rope_ext.defaults import cache_dir, gutenberg_tokenizer

from . import loop, optim, plays
from .config import CONFIGS
from .loop import RecentLoss, next_token_loss, optimizer_step
from .optim import adamw_cosine
from .plays import split_plays, tokenize_plays

DEFAULT_CONFIG = CONFIGS / "tiny.yaml"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "train_log.json")
TRAINING_MODULES = (sys.modules[__name__], plays, optim, loop)


def load_config(config_path: str | os.PathLike | None = None) -> dict:
    path = Path(config_path or DEFAULT_CONFIG)
    if not path.is_file():
        raise FileNotFoundError(f"config {path} does not exist")
    cfg = yaml.safe_load(path.read_text())
    missing = {"model", "data", "training"} - set(cfg or {})
    if missing:
        raise ValueError(f"config {path} lacks section(s) {sorted(missing)}")
    return cfg


def load_tokenizer(cfg: dict):
    return gutenberg_tokenizer(vocab_size=cfg["data"]["tokenizer_vocab_size"])


def checkpoint_name(cfg: dict, tokenizer) -> str:
    """tiny-<hash of config, training source and tokenizer vocabulary>."""
    digest = hashlib.sha256()
    digest.update(json.dumps(cfg, sort_keys=True).encode())
    for module in TRAINING_MODULES:
        digest.update(Path(module.__file__).read_bytes())
    digest.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    return f"tiny-{digest.hexdigest()[:12]}"


def heldout_ids(tokenizer, config_path: str | os.PathLike | None = None) -> torch.LongTensor:
    """The held-out plays (never trained on) as one 1-D token stream."""
    cfg = load_config(config_path)
    return tokenize_plays(tokenizer, split_plays(cfg["data"]["heldout"])[1])


def build_model(cfg: dict, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        **cfg["model"],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def sample_windows(stream: torch.LongTensor, batch_size: int, length: int, generator) -> torch.LongTensor:
    """`batch_size` random slices of `length` tokens, from a seeded generator."""
    starts = torch.randint(0, len(stream) - length + 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(model, stream: torch.LongTensor, window: int, n_windows: int = 32) -> float:
    """In-window NLL on evenly spaced held-out windows: the number to compare with ln(vocab)."""
    starts = torch.linspace(0, len(stream) - window - 1, n_windows).long().tolist()
    tokens = torch.stack([stream[s : s + window + 1] for s in starts])
    model.eval()
    return next_token_loss(model, tokens).item()


@contextlib.contextmanager
def torch_threads(n: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train(cfg: dict, tokenizer, out_dir: Path) -> dict:
    """Train from scratch and save model, tokenizer and train_log.json into `out_dir`."""
    run = cfg["training"]
    window = cfg["model"]["max_position_embeddings"]
    torch.manual_seed(run["seed"])
    train_stems, heldout_stems = split_plays(cfg["data"]["heldout"])
    stream = tokenize_plays(tokenizer, train_stems)
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer, schedule = adamw_cosine(model, run["lr"], run["weight_decay"], run["warmup_steps"], run["steps"], run["betas"])
    generator = torch.Generator().manual_seed(run["seed"])

    model.train()
    tokens_per_step = run["batch_size"] * window
    recent = RecentLoss()
    start = time.perf_counter()
    bar = tqdm(range(run["steps"]), desc=f"pretrain tiny ({n_params / 1e6:.2f}M params)", unit="step")
    for step in bar:
        batch = sample_windows(stream, run["batch_size"], window + 1, generator)
        loss = next_token_loss(model, batch)
        optimizer_step(model, optimizer, schedule, loss, run["grad_clip"])
        recent.add(loss.item())
        elapsed = time.perf_counter() - start
        throughput = tokens_per_step * (step + 1) / elapsed
        bar.set_postfix(loss=f"{recent.mean:.3f}", tok_s=f"{throughput:,.0f}")
    seconds = time.perf_counter() - start

    held = heldout_loss(model, tokenize_plays(tokenizer, heldout_stems), window)
    log = {
        "params": n_params,
        "steps": run["steps"],
        "tokens": tokens_per_step * run["steps"],
        "train_tokens_available": len(stream),
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens_per_step * run["steps"] / seconds),
        "final_loss": round(recent.mean, 4),
        "heldout_loss_in_window": round(held, 4),
        "heldout_ppl_in_window": round(math.exp(held), 2),
        "vocab_uniform_ppl": len(tokenizer),
        "torch_threads": torch.get_num_threads(),
    }
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return log


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def check_replaceable(target: Path) -> None:
    """Refuse, before any training, to overwrite a directory that is not one of our checkpoints."""
    if target.exists() and not is_complete(target) and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not a tiny-model checkpoint; choose another --out")


def ensure_tiny(config_path: str | os.PathLike | None = None, force: bool = False, out: str | os.PathLike | None = None) -> Path:
    """The checkpoint directory for `config_path`, training it first if it is not cached.

    Training writes into a temporary sibling and renames it into place, under a lock file: a
    second process waits for the first and then reuses its checkpoint, and an interrupted run
    leaves no half-written directory behind."""
    cfg = load_config(config_path)
    tokenizer = load_tokenizer(cfg)
    target = Path(out) if out is not None else cache_dir() / checkpoint_name(cfg, tokenizer)
    if is_complete(target) and not force:
        return target
    check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(target) and not force:  # built by another process while we waited
            return target
        # Holding the lock, any partial directory belongs to a trainer that was killed.
        for partial in target.parent.glob(target.name + ".partial-*"):
            shutil.rmtree(partial, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".partial-", dir=target.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
            with torch_threads(cfg["training"]["threads"]):
                log = train(cfg, tokenizer, tmp)
            if target.exists():  # a checkpoint being replaced (--force) or an empty directory
                stale = Path(tempfile.mkdtemp(prefix=target.name + ".old-", dir=target.parent))
                target.rename(stale / target.name)
                shutil.rmtree(stale)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    print(f"rope-ext: tiny model in {target}: {json.dumps(log)}")
    return target
