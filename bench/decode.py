"""Prefill and decode cost of every method against plain RoPE, side by side in one run, through
`model.generate` (greedy), as a user runs it.

For each --lengths N: a prompt of N tokens (past the trained window) goes through `generate` with
--new-tokens new tokens, once per variant per repeat, the variants interleaved so that machine
noise hits all of them. A streamer stamps the prompt's arrival, the first new token (the prefill)
and the last one: prefill = first - prompt, decode = (last - first) / (new tokens - 1), each in CPU
time of this process (`time.process_time`, all threads) and in wall time. The fastest repeat is the
estimate (load only ever adds time); each method is reported as its ratio to plain RoPE: prefill
seconds over plain's, decode tokens/s over plain's. Every method runs at --factor with its default
parameters (the dynamic ones with their causal schedule); a method that cannot be patched on the
model is listed with the reason.

    python bench/decode.py --lengths 512 1024 --threads 1       # the tiny trained model, minutes
    python bench/decode.py --model smollm2 --dtype bfloat16     # 4k, 12k and 32k: hours on 2 cores
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import rope_ext
from rope_ext.defaults import gutenberg_text, resolve_checkpoint
from rope_ext.evals.compare import parse_specs
from rope_ext.evals.output import markdown_table, provenance, write_measurement
from rope_ext.training import tiny

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PLAIN = "plain"


class Stamps:
    """A `generate` streamer that records (CPU seconds, wall seconds) at each call: the prompt,
    then every new token."""

    def __init__(self):
        self.times: list[tuple[float, float]] = []

    def put(self, value) -> None:
        self.times.append((time.process_time(), time.perf_counter()))

    def end(self) -> None:
        pass


@torch.inference_mode()
def timed_generate(model, ids: torch.Tensor, new_tokens: int) -> dict:
    """{prefill_cpu, prefill_wall, decode_cpu, decode_wall}: seconds of the prefill, and per
    decoded token after it."""
    stamps = Stamps()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=stamps)
    (cpu0, wall0), (cpu1, wall1), (cpu2, wall2) = stamps.times[0], stamps.times[1], stamps.times[-1]
    steps = len(stamps.times) - 2
    return {
        "prefill_cpu": cpu1 - cpu0,
        "prefill_wall": wall1 - wall0,
        "decode_cpu": (cpu2 - cpu1) / steps,
        "decode_wall": (wall2 - wall1) / steps,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help='"tiny" (the tiny trained model), "smollm2", or a checkpoint path')
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 12288, 32768])
    parser.add_argument("--new-tokens", type=int, default=9, help="tokens generated after each prompt (at least 2)")
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
    parser.add_argument("--out", type=Path, default=Path(f"rope-ext-results/bench-decode-{time.strftime('%Y%m%d-%H%M%S')}.json"))
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: decode is timed between the first new token and the last")
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
    stream = tokenizer(gutenberg_text(), return_tensors="pt").input_ids
    stream = stream.repeat(1, -(-max(args.lengths) // stream.shape[1]))  # the text again if it is short
    models, skipped = variants(model, args.factor, specs)
    results: dict = {
        "model": args.model,
        "window": model.config.max_position_embeddings,
        "factor": args.factor,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "skipped": skipped,
        "lengths": {},
        "provenance": provenance(model, None if args.model == "smollm2" else given),
    }
    for length in args.lengths:
        ids = stream[:, :length]
        runs = {name: [] for name in models}
        for _ in tqdm(range(args.repeats), desc=f"{length} tokens"):
            for name, variant in models.items():
                runs[name].append(timed_generate(variant, ids, args.new_tokens))
        best = {name: {k: min(run[k] for run in r) for k in r[0]} for name, r in runs.items()}
        plain = best[PLAIN]
        results["lengths"][length] = {
            name: {
                "runs": runs[name],
                **{f"prefill_ratio_{clock}": b[f"prefill_{clock}"] / plain[f"prefill_{clock}"] for clock in ("cpu", "wall")},
                **{f"decode_ratio_{clock}": plain[f"decode_{clock}"] / b[f"decode_{clock}"] for clock in ("cpu", "wall")},
                "prefill_cpu_s": b["prefill_cpu"],
                "decode_tokens_per_cpu_s": 1 / b["decode_cpu"],
            }
            for name, b in best.items()
        }

    print(
        f"\n{args.model}, window {results['window']}, factor {args.factor:g}, {args.dtype}, {args.new_tokens} new tokens, "
        f"fastest of {args.repeats} (torch threads: {torch.get_num_threads()}). Prefill: seconds over plain's; "
        "decode: tokens/s over plain's (below 1: slower)."
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
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    write_measurement(args.out, results)


if __name__ == "__main__":
    main()
