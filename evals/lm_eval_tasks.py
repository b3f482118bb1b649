"""Python side of the offline lm-eval tasks in evals/tasks (referenced from their YAML as
`!function rope_ext.evals.lm_eval_tasks.<name>`).

lm-eval calls a task's `custom_dataset` with the run's model_args merged with --metadata, so the
datasets here read `pretrained` (or `tokenizer`), `method` and `factor` from there, plus their own
keys:

rope_ext_passkey   passkey_lengths (default: powers of two from max_length/8 up to max_length),
                   passkey_depths (default 0.1 0.3 0.5 0.7 0.9), passkey_trials (5), passkey_seed (0)
rope_ext_longppl   longppl_path (a local text file or folder) or longppl_docs (embedded Gutenberg
                   play names; default: the four plays the tiny test model never trains on)
"""

from __future__ import annotations

import math
import re

import datasets

from rope_ext import record as patch_record
from rope_ext.defaults import resolve_checkpoint

from . import data as data_mod
from . import loading
from . import passkey as passkey_mod

# Per-length accuracy needs one declared metric per length (lm-eval metric lists are static):
# the task accepts these lengths and reports acc_<length> for each one it ran.
LENGTH_LADDER = tuple(64 * 2**k for k in range(12))  # 64 ... 131072
ANSWER_TOKENS = 10  # = generation_kwargs.max_gen_toks in rope_ext_passkey.yaml
HELDOUT_PLAYS = ("macbeth_gut", "tempest_gut", "twelfth_night_gut", "julius_caesar_gut")


def _tokenizer(metadata: dict):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(metadata.get("tokenizer") or resolve_checkpoint(metadata.get("pretrained")))


def task_max_length(metadata: dict) -> int:
    """The max_length the rope_ext model type will run with, from the model's config and the
    method/factor in model_args (or an explicit max_length)."""
    if metadata.get("max_length"):
        return int(metadata["max_length"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_checkpoint(metadata.get("pretrained")))
    saved = patch_record.read(config)
    window = saved.original_window if saved else config.max_position_embeddings
    method, factor = metadata.get("method"), metadata.get("factor")
    if method and method != "plain":
        return math.ceil(window * float(factor))
    if saved and not method:
        return math.ceil(window * saved.factor)
    return window


def passkey_lengths(metadata: dict, tokenizer) -> list[int]:
    """passkey_lengths from the metadata, or the ladder's lengths from max_length/8 to max_length
    that are long enough for the prompt."""
    lengths = metadata.get("passkey_lengths")
    if lengths is None:
        top = task_max_length(metadata)
        shortest = passkey_mod.minimum_length(tokenizer) + ANSWER_TOKENS
        lengths = [n for n in LENGTH_LADDER if max(top // 8, shortest) <= n <= top]
        if not lengths:
            raise ValueError(f"rope_ext_passkey: max_length {top} leaves no room for the {shortest}-token prompt")
    lengths = [int(n) for n in (lengths if isinstance(lengths, (list, tuple)) else [lengths])]
    odd = [n for n in lengths if n not in LENGTH_LADDER]
    if odd:
        raise ValueError(
            f"rope_ext_passkey: lengths {odd} are not among {list(LENGTH_LADDER)} (the task declares one metric "
            "per length); `rope-ext eval passkey` takes any length"
        )
    return sorted(set(lengths))


def passkey_dataset(**metadata) -> dict:
    """{"test": Dataset} of passkey prompts: each prompt plus its ANSWER_TOKENS-token answer
    budget fits in its length, so lm-eval never left-truncates a prompt of length max_length."""
    tokenizer = _tokenizer(metadata)
    depths = metadata.get("passkey_depths", passkey_mod.DEFAULT_DEPTHS)
    depths = [float(d) for d in (depths if isinstance(depths, (list, tuple)) else [depths])]
    trials, seed = int(metadata.get("passkey_trials", 5)), int(metadata.get("passkey_seed", 0))
    docs = []
    for length, depth, trial in passkey_mod.grid(passkey_lengths(metadata, tokenizer), depths, trials):
        key = passkey_mod.trial_key(seed, length, depth, trial)
        prompt = passkey_mod.build_prompt(tokenizer, length - ANSWER_TOKENS, depth, key)
        docs.append({"prompt": prompt.text, "key": str(key), "length": length, "depth": depth, "trial": trial})
    return {"test": datasets.Dataset.from_list(docs)}


def passkey_results(doc: dict, results: list[str]) -> dict:
    """exact_match of the first integer of the answer (the regex filter's output) with the key,
    overall and as acc_<length>."""
    correct = float(results[0].strip() == doc["key"])
    return {"exact_match": correct, f"acc_{doc['length']}": correct}


def longppl_dataset(**metadata) -> dict:
    """{"test": Dataset} of long documents, each with its token count under the run's tokenizer
    (so the task can report token-level perplexity next to lm-eval's word/byte ones)."""
    tokenizer = _tokenizer(metadata)
    if metadata.get("longppl_path"):
        texts = list(data_mod.iter_texts(str(metadata["longppl_path"])))
    else:
        from rope_ext.defaults import gutenberg_documents

        wanted = metadata.get("longppl_docs", HELDOUT_PLAYS)
        wanted = [wanted] if isinstance(wanted, str) else list(wanted)
        plays = gutenberg_documents()
        unknown = [w for w in wanted if w not in plays]
        if unknown:
            raise ValueError(f"rope_ext_longppl: unknown Gutenberg play(s) {unknown}; choose from {', '.join(plays)}")
        texts = [(w, plays[w]) for w in wanted]
    docs = [{"name": name, "text": text, "tokens": len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])}
            for name, text in texts if text.strip()]
    if not docs:
        raise ValueError("rope_ext_longppl: the data holds no non-empty document")
    return {"test": datasets.Dataset.from_list(docs)}


def longppl_results(doc: dict, results: list) -> dict:
    (loglikelihood,) = results
    text = doc["text"]
    return {
        "token_perplexity": (loglikelihood, doc["tokens"]),
        "word_perplexity": (loglikelihood, len(re.split(r"\s+", text))),
        "byte_perplexity": (loglikelihood, len(text.encode("utf-8"))),
        "bits_per_byte": (loglikelihood, len(text.encode("utf-8"))),
    }
