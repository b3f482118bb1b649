"""Documents to measure perplexity on: the embedded Gutenberg plays, local text, or a `datasets`
dataset when a hub is reachable. Every source yields (name, text) pairs; `tokenize_documents`
turns them into token streams, filtered by length. `data_arguments` is the argument group that
chooses them; the commands' parsers read it before torch loads, so torch is imported where a
document is made."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rope_ext.extras import require

if TYPE_CHECKING:
    import torch

GUTENBERG = "gutenberg"  # each play one document
# the first six plays joined: the long document of docs/references.md, "Reference measurements on SmolLM2-135M"
GUTENBERG_JOINED = "gutenberg-joined"

TEXT_SUFFIXES = (".txt", ".md", ".text")
BINARY_PROBE = 8192  # bytes of a file searched for a NUL byte


@dataclass(frozen=True)
class Document:
    name: str
    ids: torch.Tensor  # 1-D LongTensor, no special tokens

    def __len__(self) -> int:
        return self.ids.numel()


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if b"\0" in raw[:BINARY_PROBE]:  # git's test: text files hold no NUL byte
        raise ValueError(f"--data: {path} is a binary file, not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # the Gutenberg editions and many old e-texts are latin-1
        return raw.decode("latin-1")


def _text_of(record, field: str, where: str) -> str:
    """record[field] as text; ValueError naming `where` when the record holds none."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with a {field!r} field, got {type(record).__name__}")
    if field not in record:
        raise ValueError(f"{where}: no field {field!r} (fields: {', '.join(record)})")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} must be a string, got {type(text).__name__} {text!r:.40}")
    return text


def _jsonl_texts(path: Path, field: str) -> list[tuple[str, str]]:
    texts = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
        texts.append((f"{path.stem}:{number}", _text_of(record, field, f"{path}:{number}")))
    return texts


def _local_texts(path: Path, field: str) -> list[tuple[str, str]]:
    """Every document of a local file or folder, read at once so that a bad file is found
    before any model loads."""
    if path.is_file():
        return _jsonl_texts(path, field) if path.suffix == ".jsonl" else [(path.stem, _read_text(path))]
    files = sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.suffix == ".jsonl"))
    if not files:
        raise ValueError(f"folder {path} holds no {', '.join(TEXT_SUFFIXES)} or .jsonl files")
    texts = []
    for file in files:
        if file.suffix == ".jsonl":
            texts += _jsonl_texts(file, field)
        else:
            texts.append((str(file.relative_to(path).with_suffix("")), _read_text(file)))
    return texts


def _dataset_texts(name: str, split: str, field: str) -> Iterator[tuple[str, str]]:
    """The records of a `datasets` dataset, loaded now (a missing one fails here), read lazily."""
    require("eval", f"--data {name!r} (a `datasets` dataset)", ("datasets",))
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
    return ((f"{name}:{index}", _text_of(record, field, f"dataset {name!r} record {index}")) for index, record in enumerate(data))


def _looks_like_path(source: str) -> bool:
    """A hub id is `name` or `owner/name`; anything else path-shaped is a missing local path."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or Path(source).suffix in (*TEXT_SUFFIXES, ".jsonl")


def iter_texts(source: str = GUTENBERG, split: str = "test", field: str = "text") -> Iterator[tuple[str, str]]:
    """(name, text) for every document of `source` (see data_arguments). The source is
    opened and checked by this call, before the first document is asked for."""
    from rope_ext.defaults import gutenberg_documents, gutenberg_text

    if source == GUTENBERG:
        return iter(gutenberg_documents().items())
    if source == GUTENBERG_JOINED:
        return iter([(GUTENBERG_JOINED, gutenberg_text(6))])
    if Path(source).expanduser().exists():
        return iter(_local_texts(Path(source).expanduser(), field))
    if _looks_like_path(source):
        raise FileNotFoundError(f"--data {source}: no such file or folder")
    return _dataset_texts(source, split, field)


def check_selection(min_tokens, limit, seed) -> None:
    """--min-tokens, --limit and --seed: ValueError naming what each accepts."""
    for flag, value, minimum in (("--min-tokens", min_tokens, 0), ("--limit", limit, 1), ("--seed", seed, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ValueError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def tokenize_documents(
    tokenizer, texts, *, min_tokens: int = 0, limit: int | None = None, seed: int | None = None, progress: bool = False
) -> list[Document]:
    """Token streams (no special tokens) of the texts with at least `min_tokens` tokens; at most
    `limit` of them, the first ones or, with `seed`, a seeded random choice. Raises ValueError
    when nothing is left."""
    import torch
    from tqdm import tqdm

    check_selection(min_tokens, limit, seed)
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


def data_arguments(parser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        default=GUTENBERG,
        metavar="SOURCE",
        help=f"'{GUTENBERG}' (each embedded Gutenberg play is a document), '{GUTENBERG_JOINED}' (the first six "
        "plays as one document), a local text file, a folder of text/JSONL files, or a `datasets` id such as "
        "emozilla/pg19-test (needs a reachable hub) (default: gutenberg)",
    )
    group.add_argument("--data-split", default="test", help="split of a `datasets` source (default: test)")
    group.add_argument("--data-field", default="text", help="text field of a `datasets` or JSONL source (default: text)")
    group.add_argument("--min-tokens", type=int, default=0, help="skip documents shorter than this many tokens")
    group.add_argument("--limit", type=int, help="use at most this many documents (after --min-tokens)")
    group.add_argument(
        "--seed", type=int, help="with --limit: pick the documents at random with this seed instead of the first ones"
    )


def texts_from_args(args) -> Iterator[tuple[str, str]]:
    """The data arguments checked and the source opened: call it before loading a model."""
    check_selection(args.min_tokens, args.limit, args.seed)
    return iter_texts(args.data, args.data_split, args.data_field)


def documents_from_args(args, texts, tokenizer) -> list[Document]:
    """The documents of `texts` (texts_from_args) as the data arguments select them."""
    return tokenize_documents(
        tokenizer,
        texts,
        min_tokens=args.min_tokens,
        limit=args.limit,
        seed=args.seed,
        progress=not getattr(args, "no_progress", False),
    )
