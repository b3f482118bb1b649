"""The study's data: the training windows of the Gutenberg plays, in the same order for every
encoding, and the held-out tokens it is scored on."""

from __future__ import annotations

import torch
from datasets import Dataset

from rope_ext.training.plays import split_plays, tokenize_plays


def split_corpus(cfg: dict, tokenizer) -> tuple[torch.LongTensor, torch.LongTensor]:
    """(training stream, evaluation tokens): the held-out plays are never trained on, and the
    evaluation takes exactly eval_windows * longest length + 1 tokens from them."""
    train_stems, heldout = split_plays(cfg["data"]["heldout"])
    train = tokenize_plays(tokenizer, train_stems)
    held = tokenize_plays(tokenizer, heldout)
    need = cfg["data"]["eval_windows"] * cfg["train"]["window"] * cfg["eval"]["multiples"][-1] + 1
    if len(held) < need:
        raise ValueError(f"held-out plays give {len(held)} tokens, the evaluation needs {need}: add plays or lower eval_windows")
    return train, held[:need]


def training_windows(stream: torch.LongTensor, window: int) -> Dataset:
    """Non-overlapping training sequences of window + 1 tokens (inputs plus the next token)."""
    return Dataset.from_dict({"input_ids": stream.unfold(0, window + 1, window).tolist()}).with_format("torch")


def batches(windows: Dataset, batch_size: int, seed: int):
    """Batches of shuffled windows, reshuffled every epoch, identical for every encoding."""
    epoch = 0
    while True:
        for batch in windows.shuffle(seed=seed + epoch).iter(batch_size=batch_size, drop_last_batch=True):
            yield batch["input_ids"]
        epoch += 1
