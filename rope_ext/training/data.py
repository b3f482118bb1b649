"""The fine-tune's data: documents, their token cache, the packed training sequences and the
evaluation text."""

from __future__ import annotations

import hashlib

import torch
from datasets import Dataset
from datasets.fingerprint import Hasher

from rope_ext.defaults import cache_dir
from rope_ext.evals.data import Document, iter_texts

from .config import ConfigError


def load_documents(spec: dict, names_key: str, tokenizer, num_proc: int = 1) -> list:
    """Tokenized documents (rope_ext.evals.data.Document) of a `data` or `eval` section:
    `names_key` "exclude" drops the named documents, "include" keeps only them."""
    try:
        texts = list(iter_texts(spec["source"], spec["split"], spec["text_field"]))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    names = set(spec[names_key])
    unknown = sorted(names - {name for name, _ in texts})
    if unknown:
        raise ConfigError(f"{names_key}: no document named {unknown} in {spec['source']!r}; names: {sorted(n for n, _ in texts)}")
    if names_key == "exclude":
        texts = [(n, t) for n, t in texts if n not in names]
    elif names:
        texts = [(n, t) for n, t in texts if n in names]
    try:
        return tokenize_cached(texts, tokenizer, num_proc)
    except ValueError as err:
        raise ConfigError(f"{spec['source']!r}: {err}") from None


def _tokenize(batch: dict, tokenizer) -> dict:
    return {"input_ids": tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]}


def cache_key(texts: list[tuple[str, str]], tokenizer) -> str:
    """A hash of the texts and the tokenizer (its serialised form where it has one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest = hashlib.sha256((backend.to_str() if backend is not None else Hasher.hash(tokenizer)).encode())
    for name, text in texts:
        digest.update(f"{len(name)}:{name}:{len(text)}:".encode())
        digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:20]


def tokenize_cached(texts: list[tuple[str, str]], tokenizer, num_proc: int = 1) -> list:
    """Token streams (no special tokens) of the texts with at least 2 tokens, as
    rope_ext.evals.data.tokenize_documents gives them, through datasets' `map` over `num_proc`
    processes. The Arrow files it writes under cache_dir() are named by `cache_key`, so every
    rank of every run over the same corpus tokenizes it once; Arrow holds no pickle."""
    texts = [(n, t) for n, t in texts if t and t.strip()]
    if not texts:
        raise ValueError("the data source holds no documents")
    path = cache_dir() / "finetune-tokens" / f"{cache_key(texts, tokenizer)}.arrow"
    path.parent.mkdir(parents=True, exist_ok=True)
    table = Dataset.from_dict({"name": [n for n, _ in texts], "text": [t for _, t in texts]})
    tokenized = table.map(
        _tokenize,
        fn_kwargs={"tokenizer": tokenizer},
        batched=True,
        remove_columns=["text"],
        num_proc=min(num_proc, len(texts)) if num_proc > 1 else None,
        cache_file_name=str(path),
        load_from_cache_file=True,
        desc="tokenizing",
    )
    ids = tokenized.with_format("torch", columns=["input_ids"], dtype=torch.long)["input_ids"]
    documents = [Document(name, row) for name, row in zip(tokenized["name"], ids) if len(row) >= 2]
    if not documents:
        raise ValueError(f"none of the {len(texts)} documents has text with at least 2 tokens")
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
    share = limit // len(documents)
    return [Document(doc.name, doc.ids[:share]) for doc in documents]


def pack(stream: torch.LongTensor, seq_len: int) -> torch.LongTensor:
    """[n, seq_len + 1] blocks; consecutive blocks share one token, so every token is a target once."""
    n = (len(stream) - 1) // seq_len
    return (
        torch.stack([stream[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)]) if n else stream.new_zeros((0, seq_len + 1))
    )
