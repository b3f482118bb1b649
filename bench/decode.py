"""Prefill and decode cost of every method against plain RoPE, side by side in one run, as
`model.generate` (greedy) runs them: one forward over the prompt with a fresh DynamicCache, then
one forward per new token on that cache.

For each --lengths N, a prompt of N tokens (past the trained window) is prefilled --repeats times
per variant, the variants interleaved, and the fastest repeat is the prefill estimate (load only
ever adds time). The last prefill's cache is then decoded for --new-tokens greedy steps with the
variants in turn at every step (the order rotating from step to step), so that noise on this
machine, which comes and goes over seconds, reaches every variant alike. Decode is the sum of a
variant's step times; its ratio to plain is plain's sum over its own (tokens/s over plain's), which
keeps the steps that cost more (a dynamic method's re-rotation when its scaling moves). Times are
CPU time of this process (`time.process_time`, all threads) and wall time. Every method runs at
--factor with its default parameters (the dynamic ones with their causal schedule) unless
--methods gives settings; a method that cannot be patched on the model is listed with the reason.
Every variant's cache is held through the decode, so memory grows with the variants: SmolLM2's
keys and values at 32k in bf16 are 0.75 GB, and a method that rotates inside attention keeps one
or two rotated copies of the keys beside them (pick a few --methods at 32k on 24 GB).

With --compile, every variant's decode steps run through torch.compile (rope_ext.evals.compiled:
the forward compiled whole, cache length dynamic, graph breaks allowed; the prefill stays eager),
so that the decode ratio says what a method costs once Python and op dispatch leave the step.
Each variant is warmed up first, at the first length, with WARM_STEPS compiled steps beside as
many eager ones on a second prefill: the compile seconds, the graph breaks and graphs dynamo made
for it (those new to the process: plain compiles first, and what a method shares with it is not
counted again) and the compiled logits' largest gap to the eager ones are reported apart, not in
the ratio, with the frames dynamo traced in the last warm-up step and while the steps were timed
(0 when no step compiled again). A variant that fails to compile is listed with the error.

    python bench/decode.py --lengths 512 1024 --threads 1       # the tiny trained model, minutes
    python bench/decode.py --model smollm2 --dtype bfloat16     # 4k, 12k and 32k: hours on 2 cores
    python bench/decode.py --layers 2 --lengths 2048 --new-tokens 64 --threads 1 --methods self_extend sink_window yarn
    python bench/decode.py --layers 2 --lengths 2048 --new-tokens 64 --threads 1 --methods self_extend sink_window yarn --compile
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import rope_ext
from rope_ext.defaults import gutenberg_text, resolve_checkpoint
from rope_ext.evals.compare import parse_specs
from rope_ext.evals.compiled import WARM_STEPS, compile_step, compiled_frames, warm_up
from rope_ext.evals.output import markdown_table, provenance, write_measurement
from rope_ext.training import tiny

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PLAIN = "plain"
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def timed(forward) -> tuple[dict, object]:
    """({cpu, wall}: seconds `forward()` took, what it returned)."""
    begin = {clock: read() for clock, read in CLOCKS.items()}
    out = forward()
    return {clock: read() - begin[clock] for clock, read in CLOCKS.items()}, out


@torch.inference_mode()
def prefill(model, ids: torch.Tensor) -> tuple[dict, tuple]:
    """(seconds, (cache, next token)): the prompt through the model with a fresh DynamicCache."""
    cache = DynamicCache(config=model.config)
    seconds, out = timed(lambda: model(ids, cache=cache, use_cache=True, logits_to_keep=1))
    return seconds, (cache, out.logits[:, -1:].argmax(-1))


@torch.inference_mode()
def step(forward, state: tuple) -> tuple[dict, tuple]:
    """(seconds, the next state): one greedy decode step of `forward` (a model, or its compiled
    forward) on the state's cache."""
    cache, token = state
    seconds, out = timed(lambda: forward(token, cache=cache, use_cache=True, logits_to_keep=1))
    return seconds, (cache, out.logits[:, -1:].argmax(-1))


def measure(
    models: dict, ids: torch.Tensor, repeats: int, new_tokens: int, desc: str, steps: dict, untimed: int
) -> tuple[dict, int]:
    """({name: {"prefill": [seconds of each repeat], "decode": [seconds of each step]}}, the frames
    dynamo traced while the steps were timed), the variants interleaved in every repeat and every
    step; each decode step through `steps[name]`, the first `untimed` of them not timed."""
    runs = {name: {"prefill": [], "decode": []} for name in models}
    states = {}
    for _ in tqdm(range(repeats), desc=f"{desc}: prefill"):
        for name, model in models.items():
            seconds, states[name] = prefill(model, ids)
            runs[name]["prefill"].append(seconds)
    names = list(models)
    for name in names:
        for _ in range(untimed):
            states[name] = step(steps[name], states[name])[1]
    frames = compiled_frames()
    for index in tqdm(range(new_tokens), desc=f"{desc}: decode"):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, states[name] = step(steps[name], states[name])
            runs[name]["decode"].append(seconds)
    return runs, compiled_frames() - frames


def summary(runs: dict) -> dict:
    """Each variant's runs with the prefill ratio (fastest repeat over plain's fastest) and the decode
    ratio (plain's summed step time over the variant's), per clock."""
    fastest = {name: {clock: min(r[clock] for r in run["prefill"]) for clock in CLOCKS} for name, run in runs.items()}
    total = {name: {clock: sum(r[clock] for r in run["decode"]) for clock in CLOCKS} for name, run in runs.items()}
    return {
        name: {
            **runs[name],
            **{f"prefill_ratio_{clock}": fastest[name][clock] / fastest[PLAIN][clock] for clock in CLOCKS},
            **{f"decode_ratio_{clock}": total[PLAIN][clock] / total[name][clock] for clock in CLOCKS},
            "prefill_cpu_s": fastest[name]["cpu"],
            "decode_tokens_per_cpu_s": len(runs[name]["decode"]) / total[name]["cpu"],
        }
        for name in runs
    }


def load(name: str, dtype: torch.dtype):
    """(model, tokenizer, what provenance names): the tiny trained model for "tiny", else a
    checkpoint rope_ext.defaults resolves ("smollm2": the embedded SmolLM2)."""
    path = tiny.ensure_tiny() if name == "tiny" else resolve_checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(path), str(path) if name == "tiny" else name


def variants(model, factor: float, specs: list[tuple[str, str, dict]]) -> tuple[dict, dict]:
    """({label: model}: plain and each (label, method, params) patched on a copy, {label: why it
    was skipped})."""
    built, skipped = {PLAIN: model}, {}
    for label, method, params in specs:
        patched = copy.deepcopy(model)
        try:
            rope_ext.patch(patched, method, factor=factor, **params)
        except ValueError as error:
            skipped[label] = str(error)
            continue
        built[label] = patched
    return built, skipped


def compiled_steps(models: dict, ids: torch.Tensor, skipped: dict) -> tuple[dict, dict]:
    """({label: compiled forward}, {label: its warm-up (rope_ext.evals.compiled.warm_up)}), plain
    first; a variant that fails to compile is dropped from `models` into `skipped` with the error."""
    steps, warm = {}, {}
    for name in tqdm(list(models), desc="compile"):
        forward = compile_step(models[name])
        warm[name] = warm_up(models[name], forward, ids, lambda model: DynamicCache(config=model.config), WARM_STEPS)
        if "error" in warm[name]:
            skipped[name] = f"torch.compile: {warm[name]['error']}"
            del models[name]
        else:
            steps[name] = forward
    return steps, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help='"tiny" (the tiny trained model), "smollm2", or a checkpoint path')
    parser.add_argument(
        "--layers",
        type=int,
        help="keep the model's first N decoder layers: a shallow model shows what a method adds per step and layer",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 12288, 32768])
    parser.add_argument("--new-tokens", type=int, default=9, help="greedy decode steps after the prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--methods",
        nargs="+",
        help="the methods to compare with plain, each METHOD or METHOD:KEY=VALUE[,KEY=VALUE] as in rope-ext compare "
        "(default: every method with its defaults)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's); on a shared machine 1 keeps spinning threads out of CPU time",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode through torch.compile (each variant warmed up first, its compile time reported apart)",
    )
    parser.add_argument("--out", type=Path, default=Path(f"rope-ext-results/bench-decode-{time.strftime('%Y%m%d-%H%M%S')}.json"))
    args = parser.parse_args()
    if args.new_tokens < 1 or args.repeats < 1 or (args.layers is not None and args.layers < 1):
        parser.error("--new-tokens, --repeats and --layers must be at least 1")
    try:
        specs = parse_specs(args.methods or list(rope_ext.methods()), [])
    except ValueError as error:
        parser.error(str(error))
    unknown = sorted({method for _, method, _ in specs} - set(rope_ext.methods()))
    if unknown:
        parser.error(f"unknown methods: {', '.join(unknown)} (known: {', '.join(rope_ext.methods())})")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer, given = load(args.model, DTYPES[args.dtype])
    if args.layers:
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = len(model.model.layers)
    stream = tokenizer(gutenberg_text(), return_tensors="pt").input_ids
    stream = stream.repeat(1, -(-max(args.lengths) // stream.shape[1]))  # the text again if it is short
    models, skipped = variants(model, args.factor, specs)
    steps, warm = compiled_steps(models, stream[:, : args.lengths[0]], skipped) if args.compile else (dict(models), {})
    if PLAIN not in models:
        raise SystemExit(f"plain: {skipped[PLAIN]}")
    results: dict = {
        "model": args.model,
        "window": model.config.max_position_embeddings,
        "layers": model.config.num_hidden_layers,
        "factor": args.factor,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "skipped": skipped,
        "compiled": warm,
        "lengths": {},
        "frames_compiled_while_timed": {},
        "provenance": provenance(model, None if args.model == "smollm2" else given),
    }
    for length in args.lengths:
        untimed = WARM_STEPS if args.compile else 0
        runs, frames = measure(models, stream[:, :length], args.repeats, args.new_tokens, f"{length} tokens", steps, untimed)
        results["frames_compiled_while_timed"][length] = frames
        results["lengths"][length] = summary(runs)

    print(
        f"\n{args.model}, window {results['window']}, factor {args.factor:g}, {args.dtype}, torch threads "
        f"{torch.get_num_threads()}. Prefill: fastest of {args.repeats}, seconds over plain's; decode: {args.new_tokens} "
        "steps with the variants in turn, tokens/s over plain's (below 1: slower)."
    )
    header = ["method"]
    for length in args.lengths:
        header += [f"{length} prefill cpu", f"{length} decode cpu", f"{length} prefill wall", f"{length} decode wall"]
    rows = []
    for name in models:
        row = [name]
        for length in args.lengths:
            r = results["lengths"][length][name]
            row += [r["prefill_ratio_cpu"], r["decode_ratio_cpu"], r["prefill_ratio_wall"], r["decode_ratio_wall"]]
        rows.append(row)
    print(markdown_table(header, rows))
    if warm:
        print(
            f"\ntorch.compile, {WARM_STEPS} warm-up steps at {args.lengths[0]} tokens (not timed above); frames traced "
            f"while the steps were timed: {results['frames_compiled_while_timed']}"
        )
        keys = ("compile_s", "graph_breaks", "graphs", "frames_last_step", "same_tokens")
        rows = [[name, *(w[k] for k in keys), f"{w['max_rel_gap']:.1e}"] for name, w in warm.items() if "error" not in w]
        print(markdown_table(["method", *keys, "max_rel_gap"], rows))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    write_measurement(args.out, results)


if __name__ == "__main__":
    main()
