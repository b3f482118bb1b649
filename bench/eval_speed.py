"""Perplexity eval speed, side by side in one run: rope-ext's sliding-window eval against the
YaRN-repository protocol (a full forward with labels for every window), same model, same windows.

    python bench/eval_speed.py                       # SmolLM2, W=512, S=128, 1536 tokens, 2 threads
    python bench/eval_speed.py --length 1024 --stride 256 --tokens 4096 --multi 256 512 1024

Two measurements, each checked to give the same perplexity both ways:
1. one length W: the saving is the LM head and loss on the scored tokens only (S of W rows);
2. several lengths with the same stride (--multi), as `rope-ext eval ppl --lengths ...` runs them:
   the re-forward protocol runs once per length, rope-ext runs one forward per window start and
   scores every length from it (exact for causal models; see rope_ext/evals/perplexity.py).
Tokens/s counts scored tokens, from the fastest of --rounds alternating rounds; the CPU-time
ratio (process time) is printed too. On a shared machine timings move with the load: compare
ratios from the same run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rope_ext import loading
from rope_ext.evals import measured, output, perplexity
from rope_ext.evals.data import GUTENBERG_JOINED, Document, iter_texts


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def compare(model, docs, lengths, stride, bos, bos_id, rounds: int) -> dict:
    """Both protocols `rounds` times, alternating which goes first; the fastest round of each
    counts, so a burst of load from other processes does not decide the ratio."""

    def reference():
        return {
            n: perplexity.reforward_perplexity(model, docs, n, stride, bos=bos, bos_id=bos_id, progress=False) for n in lengths
        }

    def ours():
        return perplexity.evaluate(model, docs, lengths, stride=stride, bos=bos, bos_id=bos_id, progress=False)

    times = {"reforward": [], "rope_ext": []}
    for r in range(rounds):
        for name, fn in (("reforward", reference), ("rope_ext", ours))[:: 1 if r % 2 == 0 else -1]:
            result, wall, cpu = timed(fn)
            times[name].append((wall, cpu))
            if name == "reforward":
                ref = result
            else:
                mine = result
    worst = max(abs(mine[n]["ppl"] / ref[n]["ppl"] - 1) for n in lengths)
    if worst > 1e-4:
        raise AssertionError(f"the two protocols disagree: relative PPL difference {worst:.2e}")
    tokens = sum(mine[n]["tokens"] for n in lengths)
    best = {name: min(t[0] for t in runs) for name, runs in times.items()}
    best_cpu = {name: min(t[1] for t in runs) for name, runs in times.items()}
    return {
        "lengths": lengths,
        "stride": stride,
        "scored_tokens": tokens,
        "rounds": rounds,
        "wall_seconds": {k: [round(t[0], 2) for t in v] for k, v in times.items()},
        "cpu_seconds": {k: [round(t[1], 2) for t in v] for k, v in times.items()},
        "reforward_tokens_per_s": round(tokens / best["reforward"], 1),
        "rope_ext_tokens_per_s": round(tokens / best["rope_ext"], 1),
        "ratio": round(best["reforward"] / best["rope_ext"], 2),
        "cpu_ratio": round(best_cpu["reforward"] / best_cpu["rope_ext"], 2),
        "max_rel_ppl_difference": worst,
        "ppl": {n: mine[n]["ppl"] for n in lengths},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M)")
    parser.add_argument("--method", default="plain")
    parser.add_argument("--factor", type=float, default=None)
    parser.add_argument("--length", type=int, default=512, help="window W of the single-length measurement")
    parser.add_argument("--stride", type=int, default=128, help="stride S (both measurements)")
    parser.add_argument(
        "--multi", type=int, nargs="*", default=[128, 256, 512], help="lengths of the multi-length measurement (none: skip it)"
    )
    parser.add_argument("--tokens", type=int, default=1536, help="tokens of the Gutenberg text to evaluate")
    parser.add_argument("--bos", action="store_true", help="BOS per window, as YaRN's script does")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds per measurement; the fastest counts (default: 2)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, tokenizer = loading.load_model(args.model, "float32")
    info = loading.apply_method(model, args.method, args.factor)
    ids = tokenizer(next(iter_texts(GUTENBERG_JOINED))[1], add_special_tokens=False)["input_ids"][: args.tokens]
    docs = [Document(GUTENBERG_JOINED, torch.tensor(ids))]
    bos_id = tokenizer.bos_token_id
    # one untimed forward, so lazy initialisation lands on neither side
    perplexity.evaluate(model, [Document("warm-up", docs[0].ids[:64])], [64], progress=False)

    report = {
        "model": measured.model_label(model),
        "method": args.method,
        "factor": None if info is None else info.factor,
        "threads": args.threads,
        "tokens": len(ids),
        "bos": args.bos,
        "provenance": output.provenance(model, args.model),
        "single": compare(model, docs, [args.length], args.stride, args.bos, bos_id, args.rounds),
    }
    if args.multi:
        report["multi"] = compare(model, docs, sorted(set(args.multi)), args.stride, args.bos, bos_id, args.rounds)

    print(f"{report['model']} ({args.method}), {len(ids)} tokens, stride {args.stride}, {args.threads} threads")
    print(
        f"{'measurement':28} {'re-forward tok/s':>17} {'rope-ext tok/s':>15} {'ratio':>6} {'CPU-time ratio':>15}  "
        "max rel. PPL diff"
    )
    for key in ("single", "multi"):
        if key in report:
            r = report[key]
            name = f"{key}: L={','.join(map(str, r['lengths']))}"
            print(
                f"{name:28} {r['reforward_tokens_per_s']:17.1f} {r['rope_ext_tokens_per_s']:15.1f} {r['ratio']:6.2f} "
                f"{r['cpu_ratio']:15.2f}  {r['max_rel_ppl_difference']:.1e}"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
