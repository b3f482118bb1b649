"""Perplexity eval speed, side by side in one run: rope-ext's sliding-window eval against the
YaRN-repository protocol (a full forward with labels for every window), same model, same windows.

    python bench/eval_speed.py                       # SmolLM2, W=512, S=128, 2048 tokens, 2 threads
    python bench/eval_speed.py --length 1024 --stride 256 --tokens 4096 --multi 256 512 1024

Two measurements, each checked to give the same perplexity both ways:
1. one length W: the saving is the LM head and loss on the scored tokens only (S of W rows);
2. several lengths with the same stride (--multi), as `rope-ext eval ppl --lengths ...` runs them:
   the re-forward protocol runs once per length, rope-ext runs one forward per window start and
   scores every length from it (exact for causal models; see rope_ext/evals/perplexity.py).
Tokens/s counts scored tokens. On a shared machine, timings move with the load: compare ratios
from the same run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rope_ext.evals import loading, perplexity
from rope_ext.evals.data import GUTENBERG_JOINED, Document, iter_texts


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def compare(model, docs, lengths, stride, bos, bos_id) -> dict:
    reference, ref_seconds, ref_tokens = {}, 0.0, 0
    for n in lengths:
        r, seconds = timed(lambda n=n: perplexity.reforward_perplexity(model, docs, n, stride, bos=bos, bos_id=bos_id, progress=False))
        reference[n] = r
        ref_seconds += seconds
        ref_tokens += r["tokens"]
    ours, seconds = timed(lambda: perplexity.evaluate(model, docs, lengths, stride=stride, bos=bos, bos_id=bos_id, progress=False))
    worst = max(abs(ours[n]["ppl"] / reference[n]["ppl"] - 1) for n in lengths)
    if worst > 1e-4:
        raise AssertionError(f"the two protocols disagree: relative PPL difference {worst:.2e}")
    tokens = sum(ours[n]["tokens"] for n in lengths)
    return {
        "lengths": lengths, "stride": stride, "scored_tokens": tokens,
        "reforward_seconds": round(ref_seconds, 2), "rope_ext_seconds": round(seconds, 2),
        "reforward_tokens_per_s": round(ref_tokens / ref_seconds, 1), "rope_ext_tokens_per_s": round(tokens / seconds, 1),
        "ratio": round(ref_seconds / seconds, 2), "max_rel_ppl_difference": worst,
        "ppl": {n: ours[n]["ppl"] for n in lengths},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M)")
    parser.add_argument("--method", default="plain")
    parser.add_argument("--factor", type=float, default=None)
    parser.add_argument("--length", type=int, default=512, help="window W of the single-length measurement")
    parser.add_argument("--stride", type=int, default=128, help="stride S (both measurements)")
    parser.add_argument("--multi", type=int, nargs="*", default=[128, 256, 512],
                        help="lengths of the multi-length measurement (none: skip it)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the Gutenberg text to evaluate")
    parser.add_argument("--bos", action="store_true", help="BOS per window, as YaRN's script does")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, tokenizer = loading.load_model(args.model)
    info = loading.apply_method(model, args.method, args.factor)
    ids = tokenizer(next(iter_texts(GUTENBERG_JOINED))[1], add_special_tokens=False)["input_ids"][: args.tokens]
    docs = [Document(GUTENBERG_JOINED, torch.tensor(ids))]
    bos_id = tokenizer.bos_token_id
    # one untimed forward, so lazy initialisation lands on neither side
    perplexity.evaluate(model, [Document("warm-up", docs[0].ids[:64])], [64], progress=False)

    report = {"model": loading.model_label(model), "method": args.method, "factor": None if info is None else info.factor,
              "threads": args.threads, "tokens": len(ids), "bos": args.bos,
              "single": compare(model, docs, [args.length], args.stride, args.bos, bos_id)}
    if args.multi:
        report["multi"] = compare(model, docs, sorted(set(args.multi)), args.stride, args.bos, bos_id)

    print(f"{report['model']} ({args.method}), {len(ids)} tokens, stride {args.stride}, {args.threads} threads")
    print(f"{'measurement':28} {'re-forward tok/s':>17} {'rope-ext tok/s':>15} {'ratio':>6}  max rel. PPL diff")
    for key in ("single", "multi"):
        if key in report:
            r = report[key]
            name = f"{key}: L={','.join(map(str, r['lengths']))}"
            print(f"{name:28} {r['reforward_tokens_per_s']:17.1f} {r['rope_ext_tokens_per_s']:15.1f} {r['ratio']:6.2f}  "
                  f"{r['max_rel_ppl_difference']:.1e}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
