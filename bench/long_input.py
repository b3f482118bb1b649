"""Long inputs in bounded memory: sink_window through its bounded KV cache at 32k, 64k and 128k
tokens, beside plain RoPE and self_extend at 32k, side by side in one run on the embedded SmolLM2.

Every case scores the first N tokens of `gutenberg-joined` (six Gutenberg plays, 241k tokens)
with `rope_ext.chunked_nll` (4096-token chunks through the KV cache), each in its own process,
so its peak resident memory (ru_maxrss) is its own. Printed: seconds, peak RSS, PPL per 8k
bucket, and the two ratios the design promises: time(128k) / time(32k) (linear: 4) and peak
RSS(128k) / peak RSS(32k) (bounded: 1).

sink_window keeps s = 4 sinks (StreamingLLM's choice) and a window of w = L - s = 8188 keys: the
most context whose every distance was trained. Plain RoPE and self_extend keep every key in the
cache; at 32k that is 0.3 GB here, which is why they run at 32k only.

    python bench/long_input.py                    # ~1 h on 2 CPU cores in fp32
    python bench/long_input.py --lengths 8192 16384 --others-at 8192     # a quick look
    python bench/long_input.py --lengths 32768 131072 --others-at 0      # the ratios alone
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 4096
BUCKET = 8192
FACTOR = 4.0  # self_extend's target at 32k; sink_window's factor only names the length it is meant for


def run_case(method: str, length: int, dtype: str) -> dict:
    """One case in this process: load, patch, score, measure."""
    import torch

    import rope_ext
    from rope_ext.defaults import gutenberg_text, load_smollm2
    from rope_ext.evals.output import provenance

    model, tokenizer = load_smollm2(dtype=getattr(torch, dtype))
    if method != "plain":
        rope_ext.patch(model, method, factor=max(FACTOR, length / model.config.max_position_embeddings))
    ids = tokenizer(gutenberg_text(), return_tensors="pt").input_ids[0, :length]
    if len(ids) < length:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {length}")
    start = time.perf_counter()
    nll = rope_ext.chunked_nll(model, ids, chunk_size=CHUNK)
    seconds = time.perf_counter() - start
    buckets = {
        f"{lo // 1024}-{(lo + BUCKET) // 1024}k": math.exp(nll[max(0, lo - 1) : lo + BUCKET - 1].mean().item())
        for lo in range(0, length, BUCKET)
    }
    return {
        "method": method,
        "length": length,
        "dtype": dtype,
        "seconds": seconds,
        "ppl": math.exp(nll.mean().item()),
        "ppl_by_bucket": buckets,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
        "patch": rope_ext.describe(model),
        "provenance": provenance(model, None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072], help="sink_window's lengths")
    parser.add_argument("--others-at", type=int, default=32768, help="the length of the plain and self_extend runs (0: none)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--case", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)  # one case, in a child
    parser.add_argument(
        "--out", type=Path, default=Path(f"rope-ext-results/bench-long-input-{time.strftime('%Y%m%d-%H%M%S')}.json")
    )
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.dtype)))
        return
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose another --out")

    cases = [("sink_window", n) for n in sorted(args.lengths)]
    if args.others_at:
        cases += [("plain", args.others_at), ("self_extend", args.others_at)]
    results = []
    for method, length in cases:
        print(f"{method} at {length} tokens ...", file=sys.stderr, flush=True)
        child = subprocess.run(
            [sys.executable, __file__, "--case", method, str(length), "--dtype", args.dtype],
            check=True,
            capture_output=True,
            text=True,
        )
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(f"  {results[-1]['seconds']:.0f} s, peak RSS {results[-1]['peak_rss_mib']:.0f} MiB", file=sys.stderr, flush=True)

    from rope_ext.evals.output import markdown_table, write_measurement

    local = {r["length"]: r for r in results if r["method"] == "sink_window"}
    shortest, longest = local[min(local)], local[max(local)]
    report = {
        "chunk_size": CHUNK,
        "dtype": args.dtype,
        "cases": results,
        "time_ratio": longest["seconds"] / shortest["seconds"],
        "rss_ratio": longest["peak_rss_mib"] / shortest["peak_rss_mib"],
        "lengths_ratio": longest["length"] / shortest["length"],
    }
    buckets = list(longest["ppl_by_bucket"])
    print(
        f"\nSmolLM2-135M, gutenberg-joined, chunked_nll with {CHUNK}-token chunks, {args.dtype}, {results[0]['threads']} threads"
    )
    print(
        markdown_table(
            ["method", "tokens", "s", "peak RSS MiB", "PPL", *buckets],
            [
                [
                    r["method"],
                    r["length"],
                    r["seconds"],
                    r["peak_rss_mib"],
                    r["ppl"],
                    *[r["ppl_by_bucket"].get(b) for b in buckets],
                ]
                for r in results
            ],
        )
    )
    print(
        f"sink_window {longest['length']} vs {shortest['length']} tokens ({report['lengths_ratio']:g}x): "
        f"time x{report['time_ratio']:.2f}, peak RSS x{report['rss_ratio']:.3f}"
    )
    write_measurement(args.out, report)


if __name__ == "__main__":
    main()
