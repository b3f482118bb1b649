"""The fine-tune's data: documents, their token cache, the packed training sequences and the
evaluation text."""

from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rope_ext.defaults import cache_dir
from rope_ext.evals.data import Document, iter_texts, tokenize_documents

from .config import ConfigError

def load_documents(spec: dict, names_key: str, tokenizer) -> list:
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
        return tokenize_cached(texts, tokenizer)
    except ValueError as err:
        raise ConfigError(f"{spec['source']!r}: {err}") from None


def tokenize_cached(texts: list[tuple[str, str]], tokenizer) -> list:
    """rope_ext.evals.data.tokenize_documents, kept on disk under cache_dir() by a hash of the
    texts and the tokenizer: every rank of every run over the same corpus tokenizes it once."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer has no serialised form to key the cache on
        return tokenize_documents(tokenizer, texts)
    digest = hashlib.sha256(backend.to_str().encode())
    for name, text in texts:
        digest.update(f"{len(name)}:{name}:{len(text)}:".encode())
        digest.update(text.encode("utf-8", "surrogatepass"))
    # safetensors, not pickle: reading the cache runs no code whatever the torch version
    path = cache_dir() / "finetune-tokens" / f"{digest.hexdigest()[:20]}.safetensors"
    if path.is_file():
        with safe_open(str(path), framework="pt") as saved:
            names = json.loads(saved.metadata()["names"])
            parts = saved.get_tensor("ids").split(saved.get_tensor("lengths").tolist())
        return [Document(name, ids) for name, ids in zip(names, parts)]
    documents = tokenize_documents(tokenizer, texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    save_file({"ids": torch.cat([d.ids for d in documents]), "lengths": torch.tensor([len(d) for d in documents])}, tmp,
              metadata={"names": json.dumps([d.name for d in documents])})
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
    share = limit // len(documents)
    return [Document(doc.name, doc.ids[:share]) for doc in documents]


def pack(stream: torch.LongTensor, seq_len: int) -> torch.LongTensor:
    """[n, seq_len + 1] blocks; consecutive blocks share one token, so every token is a target once."""
    n = (len(stream) - 1) // seq_len
    return torch.stack([stream[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)]) if n else stream.new_zeros((0, seq_len + 1))
