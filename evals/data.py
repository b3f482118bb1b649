"""Documents to measure perplexity on: the embedded Gutenberg plays, local text, or a `datasets`
dataset when a hub is reachable. Every source yields (name, text) pairs; `tokenize_documents`
turns them into token streams, filtered by length."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

GUTENBERG = "gutenberg"  # each play one document
# the first six plays joined: the long document of docs/references.md, "Reference measurements on SmolLM2-135M"
GUTENBERG_JOINED = "gutenberg-joined"
TEXT_SUFFIXES = (".txt", ".md", ".text")


@dataclass(frozen=True)
class Document:
    name: str
    ids: torch.Tensor  # 1-D LongTensor, no special tokens

    def __len__(self) -> int:
        return self.ids.numel()


def add_data_arguments(parser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data", default=GUTENBERG, metavar="SOURCE",
        help=f"'{GUTENBERG}' (each embedded Gutenberg play is a document), '{GUTENBERG_JOINED}' (the first six "
             "plays as one document), a local text file, a folder of text/JSONL files, or a `datasets` id such as "
             "emozilla/pg19-test (needs a reachable hub) (default: gutenberg)",
    )
    group.add_argument("--data-split", default="test", help="split of a `datasets` source (default: test)")
    group.add_argument("--data-field", default="text", help="text field of a `datasets` or JSONL source (default: text)")
    group.add_argument("--min-tokens", type=int, default=0, help="skip documents shorter than this many tokens")
    group.add_argument("--limit", type=int, default=None, help="use at most this many documents (after --min-tokens)")
    group.add_argument("--seed", type=int, default=None,
                       help="with --limit: pick the documents at random with this seed instead of the first ones")


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # the Gutenberg editions and many old e-texts are latin-1
        return raw.decode("latin-1")


def _jsonl_texts(path: Path, field: str) -> Iterator[tuple[str, str]]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if field not in record:
            raise ValueError(f"{path}:{number}: no field {field!r} (fields: {', '.join(record)})")
        yield f"{path.stem}:{number}", record[field]


def _local_texts(path: Path, field: str) -> Iterator[tuple[str, str]]:
    if path.is_file():
        if path.suffix == ".jsonl":
            yield from _jsonl_texts(path, field)
        else:
            yield path.stem, _read_text(path)
        return
    files = sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.suffix == ".jsonl"))
    if not files:
        raise ValueError(f"folder {path} holds no {', '.join(TEXT_SUFFIXES)} or .jsonl files")
    for file in files:
        if file.suffix == ".jsonl":
            yield from _jsonl_texts(file, field)
        else:
            yield str(file.relative_to(path).with_suffix("")), _read_text(file)


def _dataset_texts(name: str, split: str, field: str) -> Iterator[tuple[str, str]]:
    import datasets

    try:
        data = datasets.load_dataset(name, split=split)
    except Exception as err:  # datasets raises many types for "not found" / "offline"
        raise ValueError(
            f"--data {name!r} is neither '{GUTENBERG}', '{GUTENBERG_JOINED}', a local file or folder, "
            f"nor a loadable `datasets` dataset ({type(err).__name__}: {err})"
        ) from None
    if field not in data.column_names:
        raise ValueError(f"dataset {name!r} has no field {field!r}; fields: {', '.join(data.column_names)}")
    for index, record in enumerate(data):
        yield f"{name}:{index}", record[field]


def _looks_like_path(source: str) -> bool:
    """A hub id is `name` or `owner/name`; anything else path-shaped is a missing local path."""
    return (source.startswith(("/", ".", "~")) or source.count("/") > 1
            or Path(source).suffix in (*TEXT_SUFFIXES, ".jsonl"))


def iter_texts(source: str = GUTENBERG, split: str = "test", field: str = "text") -> Iterator[tuple[str, str]]:
    """(name, text) for every document of `source` (see add_data_arguments)."""
    from rope_ext.defaults import gutenberg_documents, gutenberg_text

    if source == GUTENBERG:
        yield from gutenberg_documents().items()
    elif source == GUTENBERG_JOINED:
        yield GUTENBERG_JOINED, gutenberg_text(6)
    elif Path(source).expanduser().exists():
        yield from _local_texts(Path(source).expanduser(), field)
    elif _looks_like_path(source):
        raise FileNotFoundError(f"--data {source}: no such file or folder")
    else:
        yield from _dataset_texts(source, split, field)


def tokenize_documents(tokenizer, texts, *, min_tokens: int = 0, limit: int | None = None,
                       seed: int | None = None, progress: bool = False) -> list[Document]:
    """Token streams (no special tokens) of the texts with at least `min_tokens` tokens; at most
    `limit` of them, the first ones or, with `seed`, a seeded random choice. Raises ValueError
    when nothing is left."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if min_tokens < 0:
        raise ValueError(f"--min-tokens must be >= 0, got {min_tokens}")
    pairs = texts
    if seed is not None:  # a random choice needs the whole list; the first N can stream
        pairs = list(texts)
        random.Random(seed).shuffle(pairs)
    documents, seen, shortest = [], 0, None
    for name, text in tqdm(pairs, desc="tokenizing", unit="doc", disable=not progress, file=sys.stderr):
        seen += 1
        if not text or not text.strip():
            continue
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < max(min_tokens, 2):
            shortest = len(ids) if shortest is None else max(shortest, len(ids))
            continue
        documents.append(Document(name, torch.tensor(ids, dtype=torch.long)))
        if limit is not None and len(documents) == limit:
            break
    if not documents:
        if seen == 0:
            raise ValueError("the data source holds no documents")
        raise ValueError(
            f"none of the {seen} documents has text with at least {max(min_tokens, 2)} tokens"
            + (f" (the longest skipped one has {shortest})" if shortest is not None else "")
        )
    return documents


def documents_from_args(args, tokenizer) -> list[Document]:
    return tokenize_documents(
        tokenizer, iter_texts(args.data, args.data_split, args.data_field),
        min_tokens=args.min_tokens, limit=args.limit, seed=args.seed, progress=not getattr(args, "no_progress", False),
    )
