"""Passkey retrieval (`rope-ext eval passkey`): the landmark-attention prompt, a grid of prompt
lengths x key depths with seeded trials, greedy decoding, exact match of the key.

Each result carries, beside accuracy, its 95% Wilson interval per length and overall, and with
`--baseline` the retained retrieval: accuracy at each length divided by the unpatched model's on
the same depths, trials and seed at its trained window (evals/retrieval.py).

The prompt (docs/references.md, "Eval protocols"): a task line, filler sentences, the key line at
the chosen depth of the filler, more filler, and the question; the model must continue "The pass
key is" with the key. A prompt's length is its token count (special tokens the tokenizer adds
included); it is the longest such prompt that fits in the requested length, so it falls short by
less than one filler sentence. The key of each trial is drawn from 1..50000 by a generator seeded
with (seed, length, depth, trial), so a cell's keys do not depend on the rest of the grid.

The default grid is dense: 19 depths, 0.05 to 0.95, and two seeds. The key's depth is what a
retrieval result depends on (the filler is fixed; a seed changes the key's digits only), and a grid
of a few depths can step over a band of depths a method cannot read from; a claim speaks of the
depths measured.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rope_ext import loading
from rope_ext import method as registry
from rope_ext.chunked import chunked_forward, chunked_generate, copy_prefix, new_cache
from rope_ext.defaults import resolve_checkpoint
from rope_ext.method.base import Method
from rope_ext.record import FINETUNE_FILE, read_finetune

from . import measured, output, retrieval
from .retrieval import DEFAULT_DEPTHS, DEFAULT_SEEDS

TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
KEY_RANGE = (1, 50000)
PARTIAL = "passkey.partial.json"  # the trials answered so far, while a run goes on
# what --resume reads of each kept trial; `predicted` and `correct` are derived again from these
KEPT_FIELDS = {"length": int, "depth": (int, float), "seed": int, "trial": int, "key": int, "answer": str}


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list  # token ids as the model receives them
    key: int
    length: int  # the requested length; len(ids) <= length
    depth: float
    filler_sentences: int


def prompt_text(key: int, sentences: int, depth: float) -> str:
    before = round(depth * sentences)
    filler = [FILLER[i % len(FILLER)] for i in range(sentences)]
    parts = [TASK, " ".join(filler[:before]), KEY_LINE.format(key=key), " ".join(filler[before:]), QUESTION]
    return "\n".join(p for p in parts if p)


def build_prompt(tokenizer, length: int, depth: float, key: int) -> Prompt:
    """The longest prompt with at most `length` tokens; ValueError when not even the prompt
    without filler fits."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")

    def encode(sentences: int) -> list:
        return tokenizer(prompt_text(key, sentences, depth), verbose=False)["input_ids"]

    bare = len(encode(0))
    if bare > length:
        raise ValueError(f"passkey length {length} is too small: the prompt without any filler already has {bare} tokens")
    low, high = 0, length  # every filler sentence has at least one token
    while low < high:  # largest sentence count that still fits
        mid = (low + high + 1) // 2
        if len(encode(mid)) <= length:
            low = mid
        else:
            high = mid - 1
    return Prompt(prompt_text(key, low, depth), encode(low), key, length, depth, low)


def minimum_length(tokenizer) -> int:
    """Tokens of the prompt without filler (with the widest key): the shortest possible length."""
    return len(tokenizer(prompt_text(KEY_RANGE[1], 0, 0.0), verbose=False)["input_ids"])


def trial_key(seed: int, length: int, depth: float, trial: int) -> int:
    return random.Random(f"{seed}:{length}:{depth}:{trial}").randint(*KEY_RANGE)


def shared_prefix(a: list, b: list) -> int:
    """How many leading tokens a and b have in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def first_integer(text: str) -> int | None:
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def prefill(model, head: list, start: tuple | None = None, chunk_size: int | None = None):
    """The KV cache of the tokens `head`: from a copy of `start`, an (ids, cache) kept from another
    prompt, cut to where the two agree, and the rest through the model `chunk_size` tokens at a time
    (default: at once)."""
    shared, cache = 0, new_cache(model)
    if start is not None:
        shared = shared_prefix(start[0], head)
        cache = copy_prefix(model, start[1], shared)
    if shared < len(head):
        rest = torch.tensor([head[shared:]], device=model.get_output_embeddings().weight.device)
        chunked_forward(model, rest, chunk_size or rest.shape[1], cache=cache, keep_hidden=False)
    return cache


def model_answerer(model, tokenizer, max_new_tokens: int = 10, chunk_size: int | None = None, share_prefix: bool = False):
    """answer(prompt) -> the model's greedy continuation, decoded. With `chunk_size` the prompt is
    prefilled through the KV cache that many tokens at a time (rope_ext.chunked_generate).

    With `share_prefix`, the first prompt of each length is prefilled whole and its cache kept;
    every later prompt of that length starts from a copy of it cut to the tokens they share (the
    task line and the filler before the shallower key: run_trials asks the deepest key first) and
    prefills only the rest, a chunked prefill with a chunk boundary there (rope_ext.copy_prefix)."""
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id
    )
    device = model.get_output_embeddings().weight.device
    kept = {}  # share_prefix: {requested length: (ids[:-1] of its first prompt, their cache)}
    if share_prefix:
        copy_prefix(model, new_cache(model), 0)  # a cache that cannot be shared is refused before any prompt runs

    @torch.inference_mode()
    def answer(prompt: Prompt) -> str:
        ids = torch.tensor([prompt.ids], device=device)
        mask = torch.ones_like(ids)
        if share_prefix:
            head = prompt.ids[:-1]
            if prompt.length not in kept:
                kept.clear()  # one length at a time: run_trials asks them in order
                kept[prompt.length] = (head, prefill(model, head, chunk_size=chunk_size))
            cache = prefill(model, head, kept[prompt.length], chunk_size)
            out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, generation_config=config)
        elif chunk_size is None:
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        else:
            out = chunked_generate(model, ids, chunk_size, attention_mask=mask, generation_config=config)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return answer


def grid(lengths, depths, trials: int, limit: int | None = None, seeds=(0,)) -> list[tuple[int, float, int, int]]:
    """(length, depth, seed, trial) cells, length varying fastest, then depth, so a --limit still
    covers every length and the depths of the first seed."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if not seeds:
        raise ValueError("give at least one seed")
    cells = [(n, d, s, t) for t in range(trials) for s in seeds for d in depths for n in lengths]
    return cells if limit is None else cells[:limit]


def run_trials(
    answer,
    tokenizer,
    lengths,
    depths=DEFAULT_DEPTHS,
    trials: int = 1,
    seeds=DEFAULT_SEEDS,
    limit: int | None = None,
    progress: bool = True,
    on_trial=None,
    answered=(),
) -> dict:
    """Run the grid; returns {"trials": [...], "accuracy": {length: {depth: acc}},
    "by_length": {length: acc}, "accuracy_overall": acc}. `on_trial(result)`, if given, receives
    the same summary of the trials answered so far after each one. `answered`: trial records of an
    earlier run with the same setup (a stopped run's "trials"); those of this grid are kept, not asked."""
    lengths, depths = sorted(set(lengths)), sorted(set(depths))
    if not lengths or not depths:
        raise ValueError("give at least one length and one depth")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depths must be in [0, 1], got {d}")
    for n in lengths:  # a length too small for the prompt fails here, before any trial runs
        build_prompt(tokenizer, n, 0.0, KEY_RANGE[1])
    seeds = sorted(set(seeds))
    cells = grid(lengths, depths, trials, limit, seeds)
    records = kept_trials(answered, cells)
    # asked by length, deepest key first: the prompts of a length then share their filler with the
    # first one asked (model_answerer's share_prefix); the records keep the grid's order
    asked = sorted((cell for cell in cells if cell not in records), key=lambda cell: (cell[0], -cell[1], cell[2], cell[3]))
    for length, depth, seed, trial in tqdm(asked, desc="passkey", unit="trial", disable=not progress, file=sys.stderr):
        prompt = build_prompt(tokenizer, length, depth, trial_key(seed, length, depth, trial))
        text = answer(prompt)
        predicted = first_integer(text)
        records[length, depth, seed, trial] = {
            "length": length,
            "depth": depth,
            "seed": seed,
            "trial": trial,
            "key": prompt.key,
            "prompt_tokens": len(prompt.ids),
            "answer": text,
            "predicted": predicted,
            "correct": predicted == prompt.key,
        }
        if on_trial is not None:
            on_trial(summarize([records[cell] for cell in cells if cell in records]))
    return summarize([records[cell] for cell in cells])


def kept_trials(answered, cells: list) -> dict:
    """{cell: record} of the earlier trials that belong to this grid, each scored again from its
    stored answer and key (a record's own `correct` is not trusted: the file may have been edited);
    ValueError when one holds a key its seed would not draw (it came from another grid)."""
    wanted, kept = set(cells), {}
    for r in answered:
        cell = (r["length"], r["depth"], r["seed"], r["trial"])
        if cell not in wanted:
            continue
        drawn = trial_key(r["seed"], r["length"], r["depth"], r["trial"])
        if r["key"] != drawn:
            raise ValueError(f"the kept trial {cell} has key {r['key']}, not seed {r['seed']}'s {drawn}")
        predicted = first_integer(r["answer"])
        kept[cell] = {**r, "predicted": predicted, "correct": predicted == r["key"]}
    return kept


def summarize(records: list[dict]) -> dict:
    cells, rows = {}, {}
    for r in records:
        cells.setdefault(r["length"], {}).setdefault(r["depth"], []).append(r["correct"])
        rows.setdefault(r["length"], []).append(r["correct"])
    accuracy = {n: {d: sum(v) / len(v) for d, v in sorted(by_depth.items())} for n, by_depth in sorted(cells.items())}
    return {
        "trials": records,
        "accuracy": accuracy,
        "by_length": {n: sum(v) / len(v) for n, v in sorted(rows.items())},
        "accuracy_overall": sum(r["correct"] for r in records) / len(records) if records else None,
        "counts": {n: retrieval.counts([r for r in records if r["length"] == n]) for n in sorted(rows)},
        "counts_overall": retrieval.counts(records) if records else None,
    }


def markdown(result: dict, setup: dict) -> str:
    depths = sorted({d for row in result["accuracy"].values() for d in row})
    base = result.get("baseline")

    def summary(n) -> list:
        c = result["counts"][n]
        cells = [f"{c['correct']}/{c['total']}", "{:.2f}-{:.2f}".format(*c["interval"])]
        return cells + ([result["retained"][n]] if base else [])

    rows = [
        [n] + [result["accuracy"][n].get(d) for d in depths] + [result["by_length"][n]] + summary(n) for n in result["accuracy"]
    ]
    head = (
        f"# Passkey retrieval: {setup['model']} ({setup['method']}"
        + (f" x{setup['factor']:g}" if setup.get("factor") else "")
        + ")\n\n"
        f"Greedy, {setup['max_new_tokens']} new tokens, {setup['trials']} trial(s) per cell and seed, "
        f"{retrieval.seeds_text(setup['seeds'])}; "
        f"model capacity {setup['capacity']} positions ({setup['capacity_note']}). Cells: accuracy; "
        "95% Wilson interval of each length's accuracy."
    )
    if base:
        head += (
            f" Retained: accuracy / the unpatched model's {base['correct']}/{base['total']} (95% "
            + "{:.2f}-{:.2f}".format(*base["interval"])
            + f") at its {base['length']}-token window ({base['path']}"
            + (f", trials 0-{base['trials'] - 1} of each depth" if "trials" in base else "")
            + ")."
        )
    columns = ["length \\ depth"] + [f"{d:g}" for d in depths] + ["all depths", "correct", "95% interval"]
    return head + "\n\n" + output.markdown_table(columns + (["retained"] if base else []), rows) + misses(result["trials"])


def misses(trials: list[dict]) -> str:
    """The missed keys and what the model answered instead (its first line): a phrase, a near
    number or nothing tell different failures apart."""
    missed = sorted((t for t in trials if not t["correct"]), key=lambda t: (t["length"], t["depth"], t["seed"], t["trial"]))
    if not missed:
        return ""

    def first_line(answer: str) -> str:
        line = answer.strip().split("\n")[0].replace("`", "'").replace("|", "\\|")  # a pipe would split the cell
        return f"`{line}`" if line else "(nothing)"

    rows = [[t["length"], f"{t['depth']:g}", t["seed"], t["trial"], t["key"], first_line(t["answer"])] for t in missed]
    table = output.markdown_table(["length", "depth", "seed", "trial", "key", "answer"], rows)
    return f"\nMissed keys ({len(missed)}), the answer's first line:\n\n{table}"


def default_lengths(model, tokenizer) -> list[int]:
    """capacity/4, capacity/2 and capacity, leaving out those too short for the prompt."""
    limit, _ = measured.capacity(model)
    shortest = minimum_length(tokenizer)
    return sorted({n for n in (limit // 4, limit // 2, limit) if n >= shortest} or {limit})


def check_grid(lengths: list[int] | None, depths: list[float], trials: int, max_new_tokens: int) -> None:
    """--lengths, --depths, --trials and --max-new-tokens, before anything loads."""
    if lengths is not None and any(n < 1 for n in lengths):
        raise ValueError(f"--lengths must be >= 1 token, got {lengths}")
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths must be between 0 (start) and 1 (end), got {depths}")
    if trials < 1:
        raise ValueError(f"--trials must be >= 1, got {trials}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")


def check_shareable(method: Method, params: dict) -> None:
    """--share-prefix with `method` and its `params` (given, or those a checkpoint was saved with):
    the refusals of rope_ext.copy_prefix that the method alone decides, before anything loads
    (model_answerer checks the loaded model once more, before any prompt)."""
    name = method.name
    if type(method).kv_cache is not Method.kv_cache:
        raise ValueError(
            f"--share-prefix: {name} lets keys go from its KV cache, so no prompt's cache holds the prefix "
            "another shares; run without --share-prefix"
        )
    if method.dynamic and params.get("causal", True) is False:
        raise ValueError(
            f"--share-prefix: {name} with causal=False scales every query for the whole prompt's length, so a "
            "prefix is not computed as inside another prompt; run without --share-prefix or with causal=True"
        )


def check(args: argparse.Namespace):
    """(method parameters, result folder): every argument checked before the model loads."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    check_grid(args.lengths, args.depths, args.trials, args.max_new_tokens)
    params = loading.check_model_args(args)
    if args.share_prefix:
        saved = loading.saved_patch(args.model) if args.method is None else None
        if saved is not None:
            check_shareable(registry.get(saved.method, saved.params), saved.params)
        elif args.method not in (None, loading.PLAIN):
            method, _, checked = registry.check(args.method, args.factor, params)
            check_shareable(method, checked)
    baseline = None
    if args.baseline is not None:
        baseline = retrieval.read_baseline(args.baseline)
        retrieval.check_baseline(baseline, args.depths, args.trials, args.seeds, args.max_new_tokens)
    out = output.ResultFolder(args.output, "passkey", ["passkey.json", "passkey.md", "passkey.png"], args.overwrite).claim()
    return params, out, stopped_run(args, out), baseline


def stopped_run(args: argparse.Namespace, out: output.ResultFolder) -> dict | None:
    """--resume: the PARTIAL file of --output, read before the model loads."""
    if not args.resume:
        return None
    if args.output is None:
        raise ValueError("--resume needs --output, the folder of the stopped run")
    path = out.path(PARTIAL)
    if not path.is_file():
        raise FileNotFoundError(f"--resume: {path} does not exist (a finished run removes it)")
    return read_partial(path)


def read_partial(path) -> dict:
    """A stopped run's PARTIAL file, checked as far as --resume reads it; ValueError naming the
    file and what is wrong with it."""
    text = path.read_text(encoding="utf-8")
    again = "; run without --resume to start over"
    try:
        stopped = json.loads(text)
    except json.JSONDecodeError as err:
        what = "is empty" if not text.strip() else f"is not valid JSON, cut short or edited ({err})"
        raise ValueError(f"--resume: {path} {what}{again}") from None
    if not isinstance(stopped, dict) or not isinstance(stopped.get("setup"), dict) or not isinstance(stopped.get("trials"), list):
        raise ValueError(f"--resume: {path} holds no 'setup' object and 'trials' list: not a passkey partial file{again}")
    stopped = retrieval.with_seeds(stopped)
    seconds = stopped["setup"].get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"--resume: {path}: its setup records no 'seconds' (a number){again}")
    for index, trial in enumerate(stopped["trials"]):
        fields = trial if isinstance(trial, dict) else {}
        bad = [k for k, kind in KEPT_FIELDS.items() if isinstance(fields.get(k), bool) or not isinstance(fields.get(k), kind)]
        if bad:
            raise ValueError(f"--resume: {path}: trial {index} has no valid {', '.join(bad)}{again}")
    return stopped


def same_setup(stopped: dict, setup: dict) -> None:
    """ValueError naming what differs between a stopped run's setup and this one's."""
    theirs = {k: v for k, v in stopped["setup"].items() if k != "seconds"}
    ours = output.clean_json(setup)
    differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if differ:
        what = " (another checkpoint: its weights or config)" if "checkpoint_sha256" in differ else ""
        raise ValueError(
            f"--resume: the stopped run had another setup ({', '.join(differ)} differ{what}); "
            "run it with the same model, method, parameters and grid options"
        )


def base_name(args: argparse.Namespace, model) -> str | None:
    """The name of the unpatched model a run extends, as its baseline run's setup records it: a
    fine-tune's base (its record names it), else the model's own (the embedded model's name hashes
    its GGUF bytes); None for a checkpoint saved patched, whose config does not name its base."""
    folder = None if args.model is None else Path(args.model).expanduser()
    if folder is not None and (folder / FINETUNE_FILE).is_file():
        return measured.name_label(resolve_checkpoint(read_finetune(folder)[0]))
    if args.method is None and loading.patched(model) is not None:
        return None
    return measured.model_label(model)


def run(args: argparse.Namespace, plan) -> int:
    params, out, stopped, baseline = plan
    model, tokenizer, info = loading.model_from_args(args, params)
    if baseline is not None:
        patch = loading.patched(model)
        window = patch.original_window if patch else measured.capacity(model)[0]
        baseline = retrieval.baseline_summary(baseline, window, base_name(args, model), args.trials)
    lengths = args.lengths or default_lengths(model, tokenizer)
    for n in sorted(lengths):
        measured.warn_beyond_capacity(
            model, n + args.max_new_tokens, f"passkey length {n} (+{args.max_new_tokens} answer tokens)"
        )
    record = output.provenance(model, args.model)
    setup = {
        **measured.describe_setup(model, info, args.method, params, args.chunk_size),
        "trials": args.trials,
        "seeds": sorted(set(args.seeds)),
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "share_prefix": args.share_prefix,
        # the weights and config measured: a folder's name alone does not tell two checkpoints apart
        "checkpoint_sha256": measured.checkpoint_digest(model),
    }
    earlier = 0.0
    if stopped is not None:
        same_setup(stopped, setup)
        earlier = stopped["setup"]["seconds"]
    started = time.perf_counter() - earlier
    # rewritten after every trial, so a long run that is stopped keeps the answers it has
    partial = output.ResultFolder(out.folder, "passkey", [], overwrite=True)

    def keep(so_far: dict) -> None:
        seconds = round(time.perf_counter() - started, 2)
        partial.write_json(PARTIAL, {"setup": {**setup, "seconds": seconds}, **so_far, "provenance": record})

    result = run_trials(
        model_answerer(model, tokenizer, args.max_new_tokens, args.chunk_size, args.share_prefix),
        tokenizer,
        lengths,
        args.depths,
        args.trials,
        args.seeds,
        args.limit,
        progress=not args.no_progress,
        on_trial=keep,
        answered=stopped["trials"] if stopped else (),
    )
    setup["seconds"] = round(time.perf_counter() - started, 2)
    if baseline is not None:
        result = {**result, "baseline": baseline, "retained": retrieval.retained(result["by_length"], baseline)}
    out.write_json("passkey.json", {"setup": setup, **result, "provenance": record})
    partial.path(PARTIAL).unlink()
    text = markdown(result, setup) + "\n" + output.provenance_line(record)
    out.write_text("passkey.md", text)
    from .plots import passkey_heatmap

    label = setup["method"] + (f" x{setup['factor']:g}" if setup["factor"] else "")
    out.save_figure("passkey.png", passkey_heatmap(result["accuracy"], setup["model"], label))
    print(text)
    print(f"results in {out.folder}")
    return 0
