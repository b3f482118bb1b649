"""`rope-ext search`: one evolutionary search over position maps (docs/search.md), scaled down for
a CPU, with LongRoPE2's needle-driven score.

A candidate is a point of a search space (rope_ext.tuning.search_space): a method and the values of its
declared dimensions, such as longrope's per-pair `long_factor` (LongRoPE's space, the default),
dpe's group `scales`, string's `shift`, and Llama 4's query temperature for a method that takes
it. Its score is the mean cross-entropy of the answer tokens of passkey prompts at the target
length (the key the prompt hid, after "The pass key is"), with the model patched by the space's
method at the candidate's parameters. The first generation is the space's seeds and mutations of
one of them; each later one mutates and crosses the best `population` found so far. Every
evaluation is a line of search.jsonl, from which `--resume` rebuilds the state: generation g's
children follow from the population before g and a generator seeded with (seed, g), so a resumed
search evaluates what an uninterrupted one would have.

The result is the base checkpoint patched with the best candidate, saved with `save_pretrained`.
For longrope config.json carries transformers' own `longrope` rope_parameters, so transformers and
vLLM serve it from config.json alone, and rope_ext.from_pretrained restores the causal schedule
(docs/longrope.md); the other spaces' methods have no native form, and their checkpoint is a
rope-ext one (config.rope_ext) that rope_ext.from_pretrained restores."""

from __future__ import annotations

import argparse
import json
import math
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import rope_ext
from rope_ext import loading
from rope_ext.chunked import copy_prefix, new_cache
from rope_ext.evals import output
from rope_ext.evals.passkey import KEY_RANGE, build_prompt, shared_prefix, trial_key
from rope_ext.geometry import RotaryGeometry
from rope_ext.method.base import as_size, check_factor
from rope_ext.tuning.search_space import DPE_GROUPS, Space, build, check_temperature, names

LOG = "search.jsonl"
RECORD_KEYS = ("evaluation", "generation", "origin", "loss")
# what a log written before spaces searched (longrope) or before its needles spread over the
# prompt (DEPTHS in turn): its setup line without these
BEFORE_SPACES = {"space": "longrope", "temperature": False, "groups": None, "depths": "cycled"}
BEST = "best.json"
FIGURE = "search.png"
CHECKPOINT = "checkpoint"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # dpe-probe's needles, in turn
NEEDLES = ("digits", "words")
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TRIES = 4  # draws for a child that was not evaluated before
RELOAD_TOKENS = 64  # the reload check's probe runs this many tokens past the window
RELOAD_TOLERANCE = 1e-5  # fp32 logits


@dataclass(frozen=True)
class Needle:
    """One passkey prompt followed by its answer: `ids` [1, T], the last `answer` tokens the key,
    placed at `depth` of the filler."""

    ids: torch.LongTensor
    answer: int
    depth: float


def spell(key: int, needle: str) -> str:
    """The key as the prompt states it: its digits, or with `needle` "words" each digit's English
    name (for a model whose training text holds few digits, such as the tiny model's plays)."""
    return str(key) if needle == "digits" else " ".join(DIGIT_WORDS[int(d)] for d in str(key))


def spread(samples: int) -> list[float]:
    """`samples` depths spread evenly over the whole prompt, the middle of each of `samples` equal
    slices: a position map that cannot read from some band of the prompt is scored on it once the
    slices are narrower than the band."""
    return [(sample + 0.5) / samples for sample in range(samples)]


def needles(tokenizer, length: int, samples: int, seed: int, needle: str = "digits", depths=None) -> list[Needle]:
    """`samples` passkey prompts of at most `length` tokens with their answers, keys drawn from
    `seed` (passkey.trial_key) and spelled as `needle` says, at `depths` (default: spread over
    the prompt), in turn."""
    depths = spread(samples) if depths is None else depths
    widest = (spell(int(str(d) * len(str(KEY_RANGE[1]))), needle) for d in range(1, 10))
    room = max(len(tokenizer(f" {text}", verbose=False)["input_ids"]) for text in widest) + 1
    found = []
    for sample in range(samples):
        depth = depths[sample % len(depths)]
        key = spell(trial_key(seed, length, depth, sample), needle)
        prompt = build_prompt(tokenizer, length - room, depth, key)
        full = tokenizer(f"{prompt.text} {key}", verbose=False)["input_ids"]
        found.append(Needle(torch.tensor([full]), len(full) - shared_prefix(full, prompt.ids), depth))
    return found


def shares_prefixes(model) -> bool:
    """Whether a prompt's cache, cut to a prefix, serves another prompt under the model's patch
    (rope_ext.copy_prefix refuses caches that let keys go, and dynamic patches with causal=False)."""
    try:
        copy_prefix(model, new_cache(model), 0)
    except ValueError:
        return False
    return True


@torch.no_grad()
def answer_loss(model, prompts: list[Needle]) -> float:
    """Mean over the prompts of the mean cross-entropy of their answer tokens; the LM head runs
    on the answer rows only. Where the patch allows it, the prompts after the first start from
    the first one's cache cut to the tokens they share (the filler before the shallower key), a
    chunked prefill; the deepest key's prompt runs first, so each later one runs from its own key
    on."""
    device = next(model.parameters()).device
    kept = None  # (ids, cache) of the first prompt, when prompts share prefixes
    share = len(prompts) > 1 and shares_prefixes(model)
    losses = {}
    for index in sorted(range(len(prompts)), key=lambda i: -prompts[i].depth):
        needle = prompts[index]
        ids, start, cache = needle.ids.to(device), 0, None
        if kept is not None:
            start = min(shared_prefix(kept[0], needle.ids[0].tolist()), ids.shape[1] - needle.answer - 1)
            cache = copy_prefix(model, kept[1], start)
        elif share:
            cache = new_cache(model)
        out = model(ids[:, start:], cache=cache, use_cache=cache is not None, logits_to_keep=needle.answer + 1)
        if share and kept is None:
            kept = (needle.ids[0].tolist(), cache)
        losses[index] = F.cross_entropy(out.logits[0, :-1].float(), ids[0, -needle.answer :]).item()
    return sum(losses.values()) / len(losses)


class Search:
    """The search's state, rebuilt from its log: every evaluated candidate of `space` and its loss."""

    def __init__(self, score: Callable[[dict], float], space: Space, population: int, seed: int):
        self.score, self.space, self.population, self.seed = score, space, population, seed
        self.records: list[dict] = []

    def best(self, before: int | None = None) -> list[dict]:
        """The `population` lowest-loss records (of generations before `before`), best first."""
        chosen = [r for r in self.records if before is None or r["generation"] < before]
        return sorted(chosen, key=lambda r: (r["loss"], r["evaluation"]))[: self.population]

    def children(self, generation: int) -> list[tuple[str, dict]]:
        """Generation `generation`'s candidates, from the population before it and a generator
        seeded with (seed, generation)."""
        space, rng = self.space, random.Random(f"{self.seed}:{generation}")
        if generation == 0:
            found = list(space.seeds.items())
            while len(found) < self.population:
                found.append(("mutation", space.mutate(next(iter(space.seeds.values())), rng)))
            return found
        parents = [space.candidate(r) for r in self.best(generation)]
        elite = parents[: max(2, len(parents) // 2)]
        seen = {space.key(space.candidate(r)) for r in self.records if r["generation"] < generation}
        found = []
        for _ in range(self.population):
            for _ in range(TRIES):
                if rng.random() < 0.5 or len(elite) < 2:
                    origin, child = "mutation", space.mutate(rng.choice(elite), rng)
                else:
                    a, b = rng.sample(elite, 2)
                    origin, child = "crossover", space.crossover(a, b, rng)
                if space.key(child) not in seen:
                    break
            seen.add(space.key(child))
            found.append((origin, child))
        return found

    def run(self, budget_s: float, log, max_generations: int | None = None, progress: bool = True) -> None:
        """Evaluate generation after generation until `budget_s` seconds have passed (checked
        before each evaluation but the first, so that every run evaluates at least once) or
        `max_generations` generations are complete; each evaluation is appended to `log` (a text
        file open for appending) as it ends."""
        space = self.space
        began, evaluated = time.monotonic(), 0
        generation = max((r["generation"] for r in self.records), default=0)
        done = {(r["generation"], space.key(space.candidate(r))) for r in self.records}
        bar = tqdm(total=round(budget_s), unit="s", desc="search", disable=not progress)
        while max_generations is None or generation < max_generations:
            for origin, candidate in self.children(generation):
                if (generation, space.key(candidate)) in done:
                    continue
                if evaluated and time.monotonic() - began >= budget_s:
                    bar.close()
                    return
                evaluated += 1
                t0 = time.monotonic()
                loss = self.score(candidate)
                record = {
                    "evaluation": len(self.records),
                    "generation": generation,
                    "origin": origin,
                    **candidate,
                    "loss": loss,
                    "seconds": round(time.monotonic() - t0, 3),
                }
                self.records.append(record)
                done.add((generation, space.key(candidate)))
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.n = min(bar.total, round(time.monotonic() - began))
                bar.set_postfix(best=f"{self.best()[0]['loss']:.4f}", evaluations=len(self.records), generation=generation)
            generation += 1
        bar.close()


@torch.no_grad()
def reload_delta(model, served, ids: torch.LongTensor, patch: Callable[[], None]) -> float:
    """max |logit difference| in fp32 between `served` (the checkpoint as loaded) and `model` (the
    weights saved there) patched by `patch`, on `ids`."""
    model.float()
    patch()
    return (served.to(ids.device)(ids).logits - model(ids).logits).abs().max().item()


def setup_of(args: argparse.Namespace) -> dict:
    """What a resumed search must share with the one it continues."""
    keys = ("model", "factor", "length", "samples", "needle", "seed", "population", "dtype", "original_window")
    groups = (args.groups or DPE_GROUPS) if args.space == "dpe" else None  # the only space they shape
    fixed = {"space": args.space, "temperature": args.temperature, "groups": groups, "depths": "spread"}
    return {key: getattr(args, key) for key in keys} | fixed


def read_log(path: Path) -> tuple[dict, list[dict]]:
    """(setup, evaluations) of a search log. A last line cut mid-write (a kill, a full disk) is left
    out, with a warning: the search resumes from the complete evaluations. Any other line that is not
    a complete record is a ValueError naming the file, the line and what is wrong."""
    text = [line for line in path.read_text().splitlines() if line.strip()]
    lines = []
    for number, line in enumerate(text, 1):
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(text) and number > 1:
                warnings.warn(
                    f"the last line of {path} was cut mid-write; resuming from the {number - 2} complete evaluations before it",
                    stacklevel=2,
                )
                break
            raise ValueError(f"{path}: line {number} is not JSON ({err}); the log is damaged, start another --output") from None
    if not lines or not isinstance(lines[0], dict) or not isinstance(lines[0].get("setup"), dict):
        raise ValueError(f"{path} does not start with a search's setup line")
    setup = BEFORE_SPACES | lines[0]["setup"]
    keys = RECORD_KEYS + names(setup["space"], setup["temperature"])
    for number, record in enumerate(lines[1:], 2):
        missing = [key for key in keys if not isinstance(record, dict) or key not in record]
        if missing:
            raise ValueError(f"{path}: line {number} is not an evaluation (no {', '.join(missing)}); the log is damaged")
    return setup, lines[1:]


def check(args: argparse.Namespace) -> Path:
    """The output folder, after every argument is checked before the model loads."""
    check_factor(args.factor)
    if not (isinstance(args.budget_minutes, float) and math.isfinite(args.budget_minutes) and args.budget_minutes > 0):
        raise ValueError(f"--budget-minutes must be a positive number, got {args.budget_minutes!r}")
    as_size(args.population, "--population", minimum=2)
    as_size(args.samples, "--samples")
    if args.generations is not None:
        as_size(args.generations, "--generations")
    if args.length is not None:
        as_size(args.length, "--length", minimum=2)
    if args.original_window is not None:
        as_size(args.original_window, "--original-window")
    if args.groups is not None:
        if args.space != "dpe":
            raise ValueError(f"--groups applies to --space dpe (its scales, one per group), not {args.space}")
        as_size(args.groups, "--groups")
    if args.temperature:
        check_temperature(args.space)
    loading.check_model(args.model, args.device)
    folder = Path(args.output or Path(output.DEFAULT_ROOT) / f"search-{time.strftime('%Y%m%d-%H%M%S')}")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output {folder} is a file, not a folder")
    log = folder / LOG
    if (folder / CHECKPOINT).exists() and not (folder / CHECKPOINT).is_dir():
        raise ValueError(f"--output: {folder / CHECKPOINT} is a file, where the search writes its checkpoint folder")
    earlier = [name for name in (BEST, FIGURE, CHECKPOINT) if (folder / name).exists()]
    if earlier and not log.exists():
        raise FileExistsError(
            f"{folder} holds {', '.join(earlier)} of an earlier search but no {LOG} to resume; choose another --output"
        )
    if args.resume:
        if not log.is_file():
            raise ValueError(f"--resume: {log} does not exist; start the search without --resume")
        setup, _ = read_log(log)
        if setup["space"] != args.space:
            raise ValueError(
                f"--resume: {log} is a search of the {setup['space']} space, not {args.space}; give --space {setup['space']} "
                "or another --output"
            )
        if setup != setup_of(args):
            changed = sorted(k for k in setup_of(args) if setup.get(k) != setup_of(args)[k])
            raise ValueError(f"--resume: {log} was written with other settings ({', '.join(changed)}); give the same ones")
    elif log.exists():
        raise FileExistsError(f"{log} exists; pass --resume to continue that search, or choose another --output")
    return folder


def run(args: argparse.Namespace, folder: Path) -> int:
    model, tokenizer = loading.load_model(args.model, args.dtype, args.device)
    record = output.provenance(model, args.model)
    probe = rope_ext.patch(model, "linear", factor=args.factor, original_window=args.original_window)
    geometry = RotaryGeometry(probe.rotary_dim, probe.base, probe.original_window, probe.layout, probe.head_dim)
    target = math.ceil(geometry.original_window * args.factor)
    length = args.length or target
    if length <= geometry.original_window:
        # every space's maps act past the window (longrope's long factors, dpe's and self_extend's
        # scales) or there sets what the patch is for (string's shift): inside it the search
        # would score the unpatched model, or a map meant for other lengths
        raise ValueError(
            f"--length {length} is inside the model's {geometry.original_window}-token window, where longrope uses its "
            "short factors and dpe the trained positions: the search scores maps past the window; give a length past it"
        )
    space = build(args.space, geometry, args.factor, target, args.temperature, args.groups or DPE_GROUPS)
    prompts = needles(tokenizer, length, args.samples, args.seed, args.needle)

    def patch(candidate: dict, **params) -> None:
        rope_ext.patch(
            model,
            space.method,
            factor=args.factor,
            original_window=geometry.original_window,
            **space.params(candidate),
            **params,
        )

    def score(candidate: dict) -> float:
        patch(candidate, **space.scoring)
        return answer_loss(model, prompts)

    search = Search(score, space, args.population, args.seed)
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / LOG
    if args.resume:
        setup, search.records = read_log(log_path)
        # written anew from the complete records, so that appending never follows a cut line
        log_path.write_text("".join(json.dumps(line) + "\n" for line in [{"setup": setup}, *search.records]))
    else:
        log_path.write_text(json.dumps({"setup": setup_of(args)}) + "\n")
    print(
        f"search: {len(prompts)} passkey prompts ({args.needle}) of {length} tokens, window {geometry.original_window} x{args.factor:g}, "
        f"space {space.name} ({', '.join(d.name for d in space.dimensions)}), population {args.population}, "
        f"budget {args.budget_minutes:g} min" + (f", resuming after {len(search.records)} evaluations" if search.records else "")
    )
    with open(log_path, "a", encoding="utf-8") as log:
        search.run(args.budget_minutes * 60, log, args.generations, progress=not args.no_progress)
    best = search.best()[0]
    found = space.candidate(best)
    starts = {r["origin"]: r["loss"] for r in search.records if r["generation"] == 0 and r["origin"] in space.seeds}
    patch(found)
    model.save_pretrained(folder / CHECKPOINT)
    tokenizer.save_pretrained(folder / CHECKPOINT)
    probe = prompts[0].ids[:, : geometry.original_window + RELOAD_TOKENS].to(next(model.parameters()).device)
    if space.native:
        # plain transformers' rope_parameters alone: past the window the long factors for every row,
        # as the one-set-per-forward patch gives them
        served = AutoModelForCausalLM.from_pretrained(folder / CHECKPOINT, dtype=torch.float32).eval()
        loader, scoring = "plain transformers' load", space.scoring
    else:
        served = rope_ext.from_pretrained(folder / CHECKPOINT, dtype=torch.float32).eval()
        loader, scoring = "rope_ext.from_pretrained", {}
    delta = reload_delta(model, served, probe, lambda: patch(found, **scoring))
    if delta > RELOAD_TOLERANCE:
        consequence = "an engine serving it from config.json" if space.native else "the restored checkpoint"
        warnings.warn(
            f"{loader} of {folder / CHECKPOINT} differs from rope-ext's {space.method} patch by {delta:.3g} "
            f"(fp32 logits, {probe.shape[1]} tokens; tolerance {RELOAD_TOLERANCE:g}): {consequence} does not compute "
            "what the search scored",
            stacklevel=2,
        )
    result = {
        "space": space.name,
        "method": space.method,
        **found,
        "params": space.params(found),
        "loss": best["loss"],
        "evaluation": best["evaluation"],
        "seed_losses": starts,
        "evaluations": len(search.records),
        "length": length,
        "factor": args.factor,
        "original_window": geometry.original_window,
        "checkpoint": str(folder / CHECKPOINT),
        "reload": {"loader": loader, "tokens": probe.shape[1], "max_abs_delta": delta},
        "provenance": record,
    }
    results = output.ResultFolder(folder, "search", [BEST, FIGURE], overwrite=True)  # a resumed search rewrites both
    results.write_json(BEST, result)
    from rope_ext.evals.plots import search_figure

    first = space.dimensions[0].name
    seeds = {name: seed[first] for name, seed in space.seeds.items()}
    results.save_figure(FIGURE, search_figure(search.records, space.name, first, found[first], seeds, record["model"]))
    start = next(iter(space.seeds))
    print(
        f"best answer loss {best['loss']:.4f} (seed {start}: {starts.get(start, float('nan')):.4f}); checkpoint "
        f"{folder / CHECKPOINT}; {loader} restores it within {delta:.3g} of the patch (fp32 logits, {probe.shape[1]} tokens)"
    )
    return 0
