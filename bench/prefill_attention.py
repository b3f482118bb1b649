"""Causal prefill attention in bf16 on the CPU at SmolLM2-135M's attention shape (batch 1, 9 query
heads on 3 key/value heads, head_dim 64): torch's kernel against a blockwise attention written in
torch ops, side by side in one run, to decide whether the blockwise one should replace it.

Candidates, each on the same random bf16 queries, keys and values:
- `sdpa`: torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True), what
  transformers' sdpa backend calls for a causal prefill without a mask (torch's CPU flash kernel).
- `blockwise QxK`: query blocks of Q rows against key blocks of K keys (`blockwise_attention`
  below): q @ k^T and p @ v as bf16 batched matmuls (oneDNN, AMX where the CPU has it), the
  online-softmax state (row max, row sum, output) in fp32, blocks above the diagonal skipped and
  the diagonal block masked, GQA by viewing the 3 query heads of a key head as rows of one matmul.

1. Matmul rate: a 2048 x 2048 x 2048 bf16 matmul, the ceiling of the matmul work, fastest of
   --repeats, in CPU seconds and wall seconds, per thread count.
2. For each --threads and --lengths: each candidate once per repeat, the candidates interleaved,
   so that machine noise hits all of them; the fastest repeat is the estimate (load only ever adds
   time). CPU time is `time.process_time` (all threads of this process), the figure that holds on
   a shared machine; wall time is printed beside it. The effective FLOP rate counts the causal
   attention FLOPs as bench/long_forward.py does: 4 x heads x head_dim x L(L+1)/2 (q @ k^T and
   p @ v over the keys at or before each query), whatever a candidate actually computes. At 2
   threads the CPU rate is per CPU second (two busy threads for one wall second count twice).
3. Where the time goes, at 1 thread: CPU ns per attention score (one query-key pair) of each
   torch op of the blockwise loop on one off-diagonal block pair of each --blocks shape, their
   sum, and the floor of any composition of torch ops (a matmul writes the scores, one pass
   exponentiates them, a matmul reads them), against sdpa's whole kernel per score (table 2).
4. Error against fp64 at --check-length: the output of each candidate against the exact softmax
   attention of the same bf16 inputs computed in fp64, on scores of two spreads (`unit`: q and k
   from N(0, 1), scaled scores of standard deviation ~1; `peaked`: queries x4, scaled scores of
   standard deviation ~4, as in heads that concentrate on a few keys). Tolerance (bf16 rounding):
   max |out - exact| <= 2^-7 x max |exact|, one bf16 epsilon at the output's scale.

What it found on a 2-core Xeon with AVX512-BF16 and AMX, shared with other jobs (torch 2.13,
docs/results/smollm2-prefill-attention-*.json), CPU time at 1 thread: sdpa takes 0.81-0.88 ns per
score at 4k-32k (292-316 GFLOP/s, against 656-842 GFLOP/s for the 2048^3 matmul in the same runs);
the blockwise attention takes 2.3-2.8 ns per score (0.31-0.35x of sdpa's speed) in 256x256 and
128x512 blocks.
The floor of any torch-op composition, q @ k^T (0.38-0.46 ns/score, 280-340 GFLOP/s: its inner
dimension is only head_dim 64), one exp pass (0.65-0.69) and p @ v (0.23-0.28), is already 1.26-1.43
ns/score, above sdpa's whole kernel, which keeps each block of scores in cache and takes its max, exp and
sum in one fused pass. At 2 threads the blockwise loop falls to 0.02x of sdpa: each of its
thousands of small ops is an OpenMP parallel region, on a machine whose other jobs hold the cores. Its scores also leave the bf16
matmul rounded to bf16 (torch 2.13 has no CPU kernel for a bf16 matmul with fp32 output), so on
peaked scores its error is 7x sdpa's and outside the tolerance, where sdpa's is at most 1.4x the
bf16 rounding of the exact output. torch's kernel stays.

    python bench/prefill_attention.py --lengths 4096 16384 --repeats 3             # ~30 s of CPU
    python bench/prefill_attention.py --lengths 32768 --repeats 2 --no-anatomy     # ~40 s of CPU
    python bench/prefill_attention.py --threads 1 2 --output rope-ext-results/prefill.json
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import rope_ext
from rope_ext.evals.output import checkout_state, markdown_table, source_root, write_measurement

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
MATMUL_SIZE = 2048
CHECK_SPREADS = {"unit": 1.0, "peaked": 4.0}
TOLERANCE = 2.0**-7  # bf16 epsilon, relative to the largest |output|
QK, EXP, PV = "q @ k^T (bmm)", "exp (exp_)", "p @ [v, 1] (bmm)"
COPY = "copy (clone; taken out of sub_ and exp_)"
FUSED = "softmax, fused (not in the loop)"
LOOP = "the loop: its ops summed"
FLOOR = "floor of any torch-op composition: q @ k^T, exp, p @ v"


def sdpa(query, key, value):
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


def blockwise_attention(query, key, value, block_q: int, block_k: int):
    """Causal attention of [B, H, L, D] queries on [B, KV, L, D] keys and values (H a multiple of
    KV), in query blocks of `block_q` rows against key blocks of up to `block_k` keys.

    The queries are scaled before the product; with head_dim 64 the scale 1/8 is exact in bf16.
    Each query block meets the keys before it in blocks of `block_k`, then its own diagonal
    block of `block_q` keys under a causal mask; nothing above the diagonal is computed. The row
    max is a max of bf16 scores, so it is exact in bf16 and `scores - max` runs on one dtype (a
    bf16 tensor minus an fp32 one takes torch's mixed-dtype path, ten times slower). A column of
    ones after the values makes p @ v also give the row sum, so no pass sums p."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scaled = query * dim**-0.5
    out = torch.empty_like(query)
    above = torch.ones(block_q, block_q, dtype=torch.bool).triu(1)
    width = -(-(dim + 1) // 16) * 16  # oneDNN's bf16 kernels work on multiples of 16 columns
    for b in range(batch):
        queries = scaled[b].view(kv_heads, group, length, dim)
        keys_t = key[b].transpose(1, 2)
        values = torch.zeros(kv_heads, length, width, dtype=value.dtype)
        values[..., :dim] = value[b]
        values[..., dim] = 1
        target = out[b].view(kv_heads, group, length, dim)
        for q0 in range(0, length, block_q):
            q1 = min(q0 + block_q, length)
            n = q1 - q0
            rows = queries[:, :, q0:q1].reshape(kv_heads, group * n, dim)
            row_max = torch.full((kv_heads, group * n, 1), -math.inf)
            acc = torch.zeros(kv_heads, group * n, width)
            spans = [(k0, min(k0 + block_k, q0)) for k0 in range(0, q0, block_k)] + [(q0, q1)]
            for k0, k1 in spans:
                scores = torch.bmm(rows, keys_t[:, :, k0:k1])
                if k0 == q0:
                    scores.view(kv_heads, group, n, n).masked_fill_(above[:n, :n], -math.inf)
                new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True).float())
                scores.sub_(new_max.to(scores.dtype)).exp_()
                acc.mul_(torch.exp(row_max - new_max)).add_(torch.bmm(scores, values[:, k0:k1]))
                row_max = new_max
            target[:, :, q0:q1] = (acc[..., :dim] / acc[..., dim : dim + 1]).view(kv_heads, group, n, dim)
    return out


def parse_block(text: str) -> tuple[int, int]:
    q, _, k = text.partition("x")
    if not (q.isdigit() and k.isdigit() and int(q) > 0 and int(k) > 0):
        raise argparse.ArgumentTypeError(f"a block is QxK in positive integers, e.g. 256x512, not {text!r}")
    return int(q), int(k)


def candidates(blocks: list[tuple[int, int]]) -> dict:
    found = {"sdpa": sdpa}
    for q, k in blocks:
        found[f"blockwise {q}x{k}"] = lambda query, key, value, q=q, k=k: blockwise_attention(query, key, value, q, k)
    return found


def inputs(length: int, spread: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, length, HEAD_DIM, generator=g) * spread
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=g)
    v = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def attention_flops(length: int) -> float:
    return 4 * HEADS * HEAD_DIM * length * (length + 1) / 2


def timed(function, *args) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    function(*args)
    return time.process_time() - cpu, time.perf_counter() - wall


def matmul_rate(repeats: int) -> dict:
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).bfloat16()
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE).bfloat16()
    a @ b
    runs = [timed(lambda: [a @ b for _ in range(5)]) for _ in range(repeats + 2)]
    flops = 5 * 2 * MATMUL_SIZE**3
    return {
        "cpu_gflops_per_s": flops / min(c for c, _ in runs) / 1e9,
        "wall_gflops_per_s": flops / min(w for _, w in runs) / 1e9,
    }


@torch.inference_mode()
def race(functions: dict, length: int, repeats: int) -> dict:
    """{candidate: {cpu_s, wall_s}} lists over `repeats` interleaved rounds."""
    q, k, v = inputs(length)
    warm = inputs(1024)
    for function in functions.values():
        function(*warm)  # oneDNN builds its kernels for each shape on the first call
    runs = {name: {"cpu_s": [], "wall_s": []} for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            cpu, wall = timed(function, q, k, v)
            runs[name]["cpu_s"].append(cpu)
            runs[name]["wall_s"].append(wall)
    return runs


@torch.inference_mode()
def anatomy(block: tuple[int, int], calls: int = 20) -> dict:
    """CPU ns per score of each op of one off-diagonal block pair of the blockwise loop (the
    per-row rescaling left out)."""
    block_q, block_k = block
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(KV_HEADS, HEADS // KV_HEADS * block_q, HEAD_DIM, generator=g).bfloat16()
    keys_t = torch.randn(KV_HEADS, block_k, HEAD_DIM, generator=g).bfloat16().transpose(1, 2)
    values = torch.randn(KV_HEADS, block_k, 80, generator=g).bfloat16()
    scores = torch.bmm(rows, keys_t)
    row_max = scores.amax(-1, keepdim=True)
    ops = {
        QK: lambda: torch.bmm(rows, keys_t),
        "row max (amax)": lambda: scores.amax(-1, keepdim=True),
        "s - max (sub_)": lambda: scores.clone().sub_(row_max),
        EXP: lambda: scores.clone().exp_(),
        PV: lambda: torch.bmm(scores, values),
        COPY: lambda: scores.clone(),
        FUSED: lambda: torch.softmax(scores, -1),
    }
    ns = {}
    for name, op in ops.items():
        op()
        best = min(timed(lambda op=op: [op() for _ in range(calls)])[0] for _ in range(5))
        ns[name] = best / calls / scores.numel() * 1e9
    ns["s - max (sub_)"] -= ns[COPY]
    ns[EXP] -= ns[COPY]
    ns[LOOP] = sum(v for name, v in ns.items() if name not in (COPY, FUSED))
    ns[FLOOR] = ns[QK] + ns[EXP] + ns[PV]
    return ns


def exact_attention(query, key, value) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v in fp64, one key head at a time."""
    q, k, v = query.double(), key.double(), value.double()
    length, group = q.shape[2], q.shape[1] // k.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    out = torch.empty_like(q)
    for h in range(k.shape[1]):
        heads = slice(h * group, (h + 1) * group)
        scores = q[:, heads] @ k[:, h : h + 1].transpose(-1, -2) / math.sqrt(q.shape[-1])
        out[:, heads] = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v[:, h : h + 1]
    return out


@torch.inference_mode()
def errors(functions: dict, length: int) -> dict:
    found = {}
    for spread_name, spread in CHECK_SPREADS.items():
        q, k, v = inputs(length, spread, seed=2)
        exact = exact_attention(q, k, v)
        scale = exact.abs().max().item()
        rounding = (exact.bfloat16().double() - exact).abs().max().item()
        found[spread_name] = {"max_abs_exact": scale, "bf16_rounding_of_exact": rounding, "tolerance": TOLERANCE * scale}
        for name, function in functions.items():
            error = (function(q, k, v).double() - exact).abs()
            found[spread_name][name] = {
                "max_abs": error.max().item(),
                "mean_abs": error.mean().item(),
                "max_abs_relative_to_max_exact": error.max().item() / scale,
                "within_tolerance": error.max().item() <= TOLERANCE * scale,
            }
    return found


def summarize(runs: dict, length: int, threads: int, matmul: dict) -> list[list]:
    flops = attention_flops(length)
    base = runs["sdpa"]
    rows = []
    for name, r in runs.items():
        cpu, wall = min(r["cpu_s"]), min(r["wall_s"])
        rows.append(
            [
                length,
                threads,
                name,
                f"{cpu:.3f}",
                f"{wall:.3f}",
                f"{min(base['cpu_s']) / cpu:.2f}",
                f"{min(base['wall_s']) / wall:.2f}",
                f"{flops / cpu / 1e9:.0f} ({flops / cpu / 1e9 / matmul['cpu_gflops_per_s']:.0%})",
                f"{flops / wall / 1e9 / threads:.0f}",
                f"{cpu / (HEADS * length * (length + 1) / 2) * 1e9:.3f}",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--blocks", type=parse_block, nargs="+", default=[(128, 512), (256, 256)], help="blockwise block shapes QxK"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-length", type=int, default=2048, help="length of the fp64 error check (0: skip it)")
    parser.add_argument("--no-anatomy", action="store_true", help="skip the per-op timing")
    parser.add_argument(
        "--output", type=Path, default=Path(f"rope-ext-results/bench-prefill-attention-{time.strftime('%Y%m%d-%H%M%S')}.json")
    )
    args = parser.parse_args()
    if args.output.exists():
        parser.error(f"{args.output} exists; choose another --output")
    if min(args.lengths + args.threads) < 1 or args.repeats < 1 or args.check_length < 0:
        parser.error("lengths, threads and repeats must be positive, --check-length not negative")

    functions = candidates(args.blocks)
    results = {
        "shape": {"batch": 1, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "provenance": {
            "rope_ext": rope_ext.__version__,
            **checkout_state(source_root()),
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "processor": platform.processor() or platform.machine(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        "repeats": args.repeats,
        "flops_counted": "4 x heads x head_dim x L(L+1)/2",
        "matmul": {},
        "timings": {},
    }
    table = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        matmul = results["matmul"][threads] = matmul_rate(args.repeats)
        print(
            f"{threads} thread(s): bf16 {MATMUL_SIZE}^3 matmul {matmul['cpu_gflops_per_s']:.0f} GFLOP/s per CPU second, "
            f"{matmul['wall_gflops_per_s']:.0f} GFLOP/s wall",
            flush=True,
        )
        for length in args.lengths:
            runs = race(functions, length, args.repeats)
            results["timings"].setdefault(threads, {})[length] = runs
            rows = summarize(runs, length, threads, matmul)
            table += rows
            for row in rows:
                print(f"  L={length} {row[2]}: CPU {row[3]} s, wall {row[4]} s, sdpa/this (CPU) {row[5]}", flush=True)
    header = [
        "L",
        "threads",
        "candidate",
        "CPU s",
        "wall s",
        "speed-up over sdpa (CPU)",
        "speed-up (wall)",
        "GFLOP/s per CPU s (of matmul)",
        "GFLOP/s per thread (wall)",
        "CPU ns/score",
    ]
    print(f"\nCausal attention, bf16, {HEADS} heads on {KV_HEADS} kv heads, head_dim {HEAD_DIM}; fastest of {args.repeats}")
    print(markdown_table(header, table))

    if not args.no_anatomy:
        torch.set_num_threads(1)
        results["anatomy_ns_per_score"] = {f"{q}x{k}": anatomy((q, k)) for q, k in args.blocks}
        shapes = results["anatomy_ns_per_score"]
        print("\nCPU ns per score at 1 thread: the blockwise ops on one off-diagonal block pair QxK")
        print(
            markdown_table(
                ["op", *shapes], [[op, *(f"{shapes[s][op]:.3f}" for s in shapes)] for op in next(iter(shapes.values()))]
            )
        )
        print("(sdpa's whole kernel: its CPU ns/score in the table above)")

    if args.check_length:
        torch.set_num_threads(args.threads[0])
        results["error_vs_fp64"] = {"length": args.check_length, **errors(functions, args.check_length)}
        print(f"\nError against fp64 at L={args.check_length}; tolerance max |err| <= 2^-7 x max |exact|")
        rows = []
        for spread in CHECK_SPREADS:
            found = results["error_vs_fp64"][spread]
            for name in functions:
                e = found[name]
                rows.append(
                    [
                        spread,
                        name,
                        f"{e['max_abs']:.2e}",
                        f"{e['mean_abs']:.2e}",
                        f"{e['max_abs_relative_to_max_exact']:.2e}",
                        f"{found['tolerance']:.2e}",
                        f"{found['bf16_rounding_of_exact']:.2e}",
                        "yes" if e["within_tolerance"] else "NO",
                    ]
                )
        print(
            markdown_table(
                [
                    "scores",
                    "candidate",
                    "max abs err",
                    "mean abs err",
                    "max / max |exact|",
                    "tolerance",
                    "bf16 rounding of exact",
                    "within",
                ],
                rows,
            )
        )
    write_measurement(args.output, results)


if __name__ == "__main__":
    main()
