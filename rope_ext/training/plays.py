"""The Gutenberg plays (rope_ext.defaults) as token streams for training from scratch."""

from __future__ import annotations

import torch

from rope_ext.defaults import gutenberg_documents


def split_plays(heldout: list[str]) -> tuple[list[str], list[str]]:
    """(training stems, held-out stems), validated against the installed corpus."""
    stems = list(gutenberg_documents())
    heldout = list(heldout)
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
