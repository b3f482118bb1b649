"""One long forward of the embedded SmolLM2 in fp32 and in bf16, side by side in one run: seconds,
perplexity, passkey answers, and the FLOP rate the forward reaches against this machine's
measured matmul rate in the same dtype.

1. Matmul rate: the model's largest GEMM (hidden -> MLP intermediate, 4096 rows), fastest of
   several runs, per dtype. That is the rate the linear layers could reach here at best.
2. For each --lengths: the first N tokens of `gutenberg-joined` through the decoder of the patched
   model (--method, --factor; yarn x4 by default, which reads 32k), once per dtype: seconds, PPL
   overall and per 4k bucket, and the FLOP rate of the forward. FLOPs are counted, not sampled:
   2 x tokens x (parameters of the decoder's linear layers) + 4 x layers x heads x head_dim x
   T(T+1)/2 for causal attention (QK^T and AV).
3. Passkey at --passkey-length for each --depths, greedy, per dtype: the answers and whether the
   two dtypes give the same one.

Rotary angles are computed in fp32 in either dtype (rope_ext.rotation). One forward per cell: at
32k a repeat costs minutes, so timings carry the machine's noise; compare the ratios of this run.

    python bench/long_forward.py                                  # 16k and 32k, ~30 min on 2 cores
    python bench/long_forward.py --lengths 4096 --passkey-length 4096 --depths 0.5   # a quick look
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

import rope_ext
from rope_ext.chunked import token_nll
from rope_ext.defaults import gutenberg_text, load_smollm2
from rope_ext.evals import passkey
from rope_ext.evals.output import markdown_table, provenance, write_measurement

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GEMM_ROWS = 4096
BUCKET = 4096


def matmul_rate(model, dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of the model's largest linear layer shape on GEMM_ROWS rows, fastest of `repeats`."""
    shape = max(
        (m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head),
        key=lambda s: s[0] * s[1],
    )
    a = torch.randn(GEMM_ROWS, shape[1], dtype=dtype)
    w = torch.randn(shape[1], shape[0], dtype=dtype)
    best = math.inf
    for _ in range(repeats + 1):  # the first run warms the kernels up
        start = time.perf_counter()
        for _ in range(10):
            a @ w
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * GEMM_ROWS * shape[0] * shape[1] / best / 1e9


def forward_flops(model, tokens: int) -> float:
    """FLOPs of one causal forward of the decoder over `tokens` tokens (the LM head not included)."""
    config = model.config
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * tokens * (tokens + 1) / 2
    return 2 * tokens * linear + attention


@torch.inference_mode()
def measure(model, ids: torch.Tensor) -> dict:
    start = time.perf_counter()
    hidden = model.model(ids[None]).last_hidden_state[0]
    seconds = time.perf_counter() - start
    nll = token_nll(model, hidden[:-1], ids[1:])
    buckets = {
        f"{lo // 1024}-{(lo + BUCKET) // 1024}k": math.exp(nll[max(0, lo - 1) : lo + BUCKET - 1].mean().item())
        for lo in range(0, len(ids), BUCKET)
    }
    flops = forward_flops(model, len(ids))
    return {
        "seconds": seconds,
        "ppl": math.exp(nll.mean().item()),
        "ppl_by_bucket": buckets,
        "gflops_per_s": flops / seconds / 1e9,
        "flops": flops,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--method", default="yarn")
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--passkey-length", type=int, default=16384)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument(
        "--out", type=Path, default=Path(f"rope-ext-results/bench-long-forward-{time.strftime('%Y%m%d-%H%M%S')}.json")
    )
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose another --out")

    models, tokenizer = {}, None
    for name, dtype in DTYPES.items():
        models[name], tokenizer = load_smollm2(dtype=dtype)
        rope_ext.patch(models[name], args.method, factor=args.factor)
    ids = tokenizer(gutenberg_text(), return_tensors="pt").input_ids[0]
    results = {
        "method": args.method,
        "factor": args.factor,
        "threads": torch.get_num_threads(),
        "provenance": provenance(models["float32"], None),
        "matmul_gflops_per_s": {},
        "forward": {},
        "passkey": {},
    }
    for name, model in models.items():
        results["matmul_gflops_per_s"][name] = matmul_rate(model, DTYPES[name])
    for length in tqdm(args.lengths, desc="forward"):
        results["forward"][length] = {name: measure(model, ids[:length]) for name, model in models.items()}
    answerers = {name: passkey.model_answerer(model, tokenizer) for name, model in models.items()}
    for depth in tqdm(args.depths, desc="passkey"):
        prompt = passkey.build_prompt(tokenizer, args.passkey_length, depth, passkey.trial_key(0, args.passkey_length, depth, 0))
        answers = {name: answer(prompt) for name, answer in answerers.items()}
        results["passkey"][depth] = {
            "key": prompt.key,
            "answers": answers,
            "correct": {name: passkey.first_integer(a) == prompt.key for name, a in answers.items()},
            "same_answer": len(set(answers.values())) == 1,
        }

    rate = results["matmul_gflops_per_s"]
    print(
        f"\nSmolLM2-135M, {args.method} x{args.factor:g}, sdpa, {results['threads']} threads; "
        f"matmul rate: fp32 {rate['float32']:.0f}, bf16 {rate['bfloat16']:.0f} GFLOP/s"
    )
    rows = []
    for length, by_dtype in results["forward"].items():
        fp32, bf16 = by_dtype["float32"], by_dtype["bfloat16"]
        rows.append(
            [
                length,
                f"{fp32['seconds']:.1f}",
                f"{bf16['seconds']:.1f}",
                f"{fp32['seconds'] / bf16['seconds']:.2f}",
                f"{fp32['ppl']:.3f}",
                f"{bf16['ppl']:.3f}",
                f"{bf16['ppl'] / fp32['ppl'] - 1:+.2%}",
                f"{fp32['gflops_per_s']:.0f} ({fp32['gflops_per_s'] / rate['float32']:.0%})",
                f"{bf16['gflops_per_s']:.0f} ({bf16['gflops_per_s'] / rate['bfloat16']:.0%})",
            ]
        )
    print(
        markdown_table(
            [
                "tokens",
                "fp32 s",
                "bf16 s",
                "speed-up",
                "fp32 PPL",
                "bf16 PPL",
                "PPL change",
                "fp32 GFLOP/s (of matmul)",
                "bf16 GFLOP/s (of matmul)",
            ],
            rows,
        )
    )
    print(
        markdown_table(
            ["depth", "key", "fp32 answer", "bf16 answer", "same"],
            [
                [d, r["key"], repr(r["answers"]["float32"]), repr(r["answers"]["bfloat16"]), r["same_answer"]]
                for d, r in results["passkey"].items()
            ],
        )
    )
    write_measurement(args.out, results)


if __name__ == "__main__":
    main()
