"""Pretrain the tiny LLaMA that the tests measure context extension on.

    python recipes/pretrain_tiny.py [--config recipes/configs/tiny.yaml] [--out DIR] [--force]

A ~1M-parameter LlamaForCausalLM with a 128-token window, trained from scratch in a few CPU
minutes on the Gutenberg plays (rope_ext.defaults) with the Gutenberg BPE tokenizer. Every
training sequence is exactly one window long, so the model never sees a position >= W: that is
what makes plain RoPE fail past W and gives the scaling methods something to fix.

The checkpoint (weights, config, tokenizer, train_log.json) is cached in
cache_dir()/tiny-<hash>, where the hash covers the config, this file and the tokenizer, so an
edited recipe or config trains a new one. Importable: `ensure_tiny()` and `heldout_ids()`.

Speed: training runs on `training.threads` torch threads (1): about 3 CPU minutes. Two threads
are faster only on idle cores; on cores that other jobs also use they slow down several-fold.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

from rope_ext.defaults import cache_dir, gutenberg_documents, gutenberg_tokenizer

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.yaml"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "train_log.json")


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
    """tiny-<hash of config, recipe source and tokenizer vocabulary>."""
    digest = hashlib.sha256()
    digest.update(json.dumps(cfg, sort_keys=True).encode())
    digest.update(Path(__file__).resolve().read_bytes())
    digest.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    return f"tiny-{digest.hexdigest()[:12]}"


def split_plays(cfg: dict) -> tuple[list[str], list[str]]:
    """(training stems, held-out stems), validated against the installed corpus."""
    stems = list(gutenberg_documents())
    heldout = list(cfg["data"]["heldout"])
    unknown = sorted(set(heldout) - set(stems))
    if unknown:
        raise ValueError(f"held-out play(s) {unknown} not in the corpus; choose from {stems}")
    return [s for s in stems if s not in heldout], heldout


def tokenize_plays(tokenizer, stems: list[str]) -> torch.LongTensor:
    """The plays tokenized and concatenated, each followed by eos; no bos anywhere, as in training."""
    docs = gutenberg_documents()
    ids: list[int] = []
    for stem in stems:
        ids.extend(tokenizer(docs[stem], add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def heldout_ids(tokenizer, config_path: str | os.PathLike | None = None) -> torch.LongTensor:
    """The held-out plays (never trained on) as one 1-D token stream."""
    cfg = load_config(config_path)
    return tokenize_plays(tokenizer, split_plays(cfg)[1])


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


def causal_lm_loss(model, tokens: torch.LongTensor) -> torch.Tensor:
    """Mean next-token NLL; `tokens` carry one extra token so the inputs are exactly one window."""
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model, stream: torch.LongTensor, window: int, n_windows: int = 32) -> float:
    """In-window NLL on evenly spaced held-out windows: the number to compare with ln(vocab)."""
    starts = torch.linspace(0, len(stream) - window - 1, n_windows).long().tolist()
    tokens = torch.stack([stream[s : s + window + 1] for s in starts])
    model.eval()
    return causal_lm_loss(model, tokens).item()


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
    train_stems, heldout_stems = split_plays(cfg)
    stream = tokenize_plays(tokenizer, train_stems)
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    # Norm gains and biases are not decayed: shrinking them only fights the normalisation.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": run["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=run["lr"],
        betas=tuple(run["betas"]),
    )
    schedule = get_cosine_schedule_with_warmup(optimizer, run["warmup_steps"], run["steps"])
    generator = torch.Generator().manual_seed(run["seed"])

    model.train()
    tokens_per_step = run["batch_size"] * window
    recent: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(run["steps"]), desc=f"pretrain tiny ({n_params / 1e6:.2f}M params)", unit="step")
    for step in bar:
        batch = sample_windows(stream, run["batch_size"], window + 1, generator)
        loss = causal_lm_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run["grad_clip"])
        optimizer.step()
        schedule.step()
        recent = (recent + [loss.item()])[-20:]
        elapsed = time.perf_counter() - start
        throughput = tokens_per_step * (step + 1) / elapsed
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", tok_s=f"{throughput:,.0f}")
    seconds = time.perf_counter() - start

    held = heldout_loss(model, tokenize_plays(tokenizer, heldout_stems), window)
    log = {
        "params": n_params,
        "steps": run["steps"],
        "tokens": tokens_per_step * run["steps"],
        "train_tokens_available": len(stream),
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens_per_step * run["steps"] / seconds),
        "final_loss": round(sum(recent) / len(recent), 4),  # mean of the last 20 steps
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


def ensure_tiny(
    config_path: str | os.PathLike | None = None, force: bool = False, out: str | os.PathLike | None = None
) -> Path:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--out", help="checkpoint directory (default: cache_dir()/tiny-<hash>)")
    parser.add_argument("--force", action="store_true", help="retrain even if the checkpoint exists")
    args = parser.parse_args(argv)
    path = ensure_tiny(args.config, force=args.force, out=args.out)
    print(path)


if __name__ == "__main__":
    main()
