"""Python side of the offline lm-eval tasks in evals/tasks (referenced from their YAML as
`!function rope_ext.evals.lm_eval_tasks.<name>`).

The tasks build their documents for the model they evaluate: its tokenizer and the max_length the
rope_ext model type runs with (the patch's). lm-eval gives a task no handle on the model, and the
metadata a task receives holds the model_args only when `simple_evaluate` makes the TaskManager
itself, so the rope_ext model type hands itself over when it is built (`evaluate_with`); lm-eval
builds a run's model before its tasks. The tasks hold it by a weak reference: once that model is
gone (its run is over), a later run of another model type, lm-eval's `hf` say, is refused rather
than given documents built for the earlier model. Options come through --metadata (or
TaskManager(metadata=)):

rope_ext_passkey   passkey_lengths (default: powers of two from max_length/8 up to max_length),
                   passkey_depths (default: `rope-ext eval passkey`'s 19, 0.05 to 0.95),
                   passkey_trials (1), passkey_seed (0)
rope_ext_longppl   longppl_path (a local text file or folder) or longppl_docs (embedded Gutenberg
                   play names; default: the four plays the tiny test model never trains on)
"""

from __future__ import annotations

import re
import weakref

import datasets

from . import data as data_mod
from . import passkey as passkey_mod

# Per-length accuracy needs one declared metric per length (lm-eval metric lists are static):
# the task accepts these lengths and reports acc_<length> for each one it ran.
LENGTH_LADDER = tuple(64 * 2**k for k in range(12))  # 64 ... 131072
ANSWER_TOKENS = 10  # = generation_kwargs.max_gen_toks in rope_ext_passkey.yaml
HELDOUT_PLAYS = ("macbeth_gut", "tempest_gut", "twelfth_night_gut", "julius_caesar_gut")

_evaluated = None  # a weak reference to the rope_ext model built last


class NoModel(ValueError):
    """A task built while no rope_ext model is alive: `rope-ext lm-eval` prints it as one line."""


def evaluate_with(model) -> None:
    """Build the tasks' documents for this rope_ext model, its tokenizer and max_length, while it
    lives (the rope_ext model type calls it once it is built)."""
    global _evaluated
    _evaluated = weakref.ref(model)


def evaluated_model(task: str) -> tuple:
    """(tokenizer, max_length) of the evaluated model; NoModel when no rope_ext model is alive."""
    model = None if _evaluated is None else _evaluated()
    if model is None:
        raise NoModel(
            f"{task}: the task builds its documents with the evaluated model's tokenizer and max_length, and no "
            "rope_ext model has been built in this process, or none is alive (the last one's run is over); evaluate it with model='rope_ext' "
            "(after `import rope_ext.evals.lm_eval_model`)"
        )
    return model.tokenizer, model.max_length


def passkey_lengths(metadata: dict, tokenizer, top: int) -> list[int]:
    """passkey_lengths from the metadata, or the ladder's lengths from max_length (`top`) / 8 to
    max_length that are long enough for the prompt."""
    lengths = metadata.get("passkey_lengths")
    if lengths is None:
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
    tokenizer, max_length = evaluated_model("rope_ext_passkey")
    depths = metadata.get("passkey_depths", passkey_mod.DEFAULT_DEPTHS)
    depths = [float(d) for d in (depths if isinstance(depths, (list, tuple)) else [depths])]
    trials, seed = int(metadata.get("passkey_trials", 1)), int(metadata.get("passkey_seed", 0))
    lengths = passkey_lengths(metadata, tokenizer, max_length)
    docs = []
    for length, depth, _, trial in passkey_mod.grid(lengths, depths, trials, seeds=(seed,)):
        key = passkey_mod.trial_key(seed, length, depth, trial)
        prompt = passkey_mod.build_prompt(tokenizer, length - ANSWER_TOKENS, depth, key)
        docs.append(
            {"prompt": prompt.text, "key": str(key), "length": length, "depth": depth, "trial": trial, "lengths": lengths}
        )
    return {"test": datasets.Dataset.from_list(docs)}


def passkey_results(doc: dict, results: list[str]) -> dict:
    """exact_match of the first integer of the answer (the regex filter's output) with the key,
    overall and as acc_<length>. Every document reports every length of the run, None for the
    others (lm-eval 0.4.13's RULER tasks do the same with -1): metrics scored on different numbers
    of documents make lm-eval warn on every run."""
    correct = float(results[0].strip() == doc["key"])
    return {"exact_match": correct, **{f"acc_{n}": correct if n == doc["length"] else None for n in doc["lengths"]}}


def scored_mean(items: list) -> float | None:
    """The mean over the documents of one length (the acc_<length> aggregation); None for a length
    none of the documents run has (lm-eval's --limit takes the first documents only)."""
    scored = [x for x in items if x is not None]
    return sum(scored) / len(scored) if scored else None


def longppl_dataset(**metadata) -> dict:
    """{"test": Dataset} of long documents, each with its token count under the run's tokenizer
    (so the task can report token-level perplexity next to lm-eval's word/byte ones)."""
    tokenizer, _ = evaluated_model("rope_ext_longppl")
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
    docs = [
        {"name": name, "text": text, "tokens": len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])}
        for name, text in texts
        if text.strip()
    ]
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
