"""Memory and time of alibi_hybrid against plain sdpa, and against a naive full-bias version, on
the embedded SmolLM2 at --length tokens (default 16k = 2x its 8192-token window).

Each variant runs in a fresh subprocess (so one variant's peak cannot hide another's): load the
model, patch it, reset the kernel's peak-RSS counter (/proc/self/clear_refs), run one forward
over the first --length tokens of the Gutenberg plays (the text of docs/references.md, "Reference
measurements on SmolLM2-135M") and read the peak RSS of that forward (VmHWM) and its wall time. The
forward keeps only the last 1025 positions' logits, so the LM head (49k vocabulary) does not
dominate memory, and the same logits give the perplexity of the last 1024 tokens. The results
file's provenance is that of the first variant that finished (the variants differ only in date).

Variants:
  sdpa            the unpatched model (plain RoPE), transformers' sdpa: the baseline
  alibi_hybrid    rope_ext.patch(model, "alibi_hybrid", factor, rope="ntk"), w = the window
  naive           the same math with the whole [1, H, L, L] bias built in every layer and handed
                  to transformers' sdpa as its mask: the reference to beat
  ntk, yarn       rope_ext.patch(model, method, factor): perplexity references
  alibi_plain     alibi_hybrid with rope=None (plain RoPE positions plus the bias)

    python bench/alibi_memory.py                      # all variants, ~25-60 min on 2 CPU cores
    python bench/alibi_memory.py --length 2048 --w 512 --variants sdpa,alibi_hybrid,naive
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rope_ext.evals.output import provenance, provenance_line

LAST = 1024
VARIANTS = ("sdpa", "alibi_hybrid", "ntk", "yarn", "alibi_plain", "naive")
NAIVE = "rope_ext_bench_naive_alibi"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _register_naive(w: int) -> None:
    """An attention function that builds the full bias, as a straightforward implementation would."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask, **kwargs):
        q_len, kv_len = query.shape[-2], key.shape[-2]
        i = torch.arange(kv_len - q_len, kv_len, dtype=torch.float32)[:, None]
        j = torch.arange(kv_len, dtype=torch.float32)[None, :]
        bias = -module.naive_slopes[:, None, None] * (i - j - w).clamp(min=0)  # [H, L, L]
        bias.masked_fill_(j > i, torch.finfo(bias.dtype).min)
        if attention_mask is not None:
            bias = torch.where(attention_mask, bias, torch.finfo(bias.dtype).min)
        return sdpa_attention_forward(
            module, query, key, value, bias.to(query.dtype).expand(query.shape[0], -1, -1, -1), **kwargs
        )

    ALL_ATTENTION_FUNCTIONS.register(NAIVE, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAIVE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _prepare(model, variant: str, factor: float, w: int | None) -> None:
    import rope_ext
    from rope_ext.method.alibi_hybrid import alibi_slopes

    window = model.config.max_position_embeddings
    if variant == "alibi_hybrid":
        rope_ext.patch(model, "alibi_hybrid", factor=factor, rope="ntk", w=w)
    elif variant == "alibi_plain":
        rope_ext.patch(model, "alibi_hybrid", factor=factor, rope=None, w=w)
    elif variant in ("ntk", "yarn"):
        rope_ext.patch(model, variant, factor=factor)
    elif variant == "naive":
        rope_ext.patch(model, "ntk", factor=factor)
        _register_naive(window if w is None else w)
        slopes = alibi_slopes(model.config.num_attention_heads)
        for layer in model.model.layers:
            layer.self_attn.naive_slopes = slopes
        model.config._attn_implementation = NAIVE
    elif variant != "sdpa":
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


def run_child(args) -> dict:
    from rope_ext.defaults import gutenberg_text, load_smollm2

    model, tokenizer = load_smollm2()
    ids = tokenizer(gutenberg_text(), return_tensors="pt").input_ids[:, : args.length]
    if ids.shape[1] < args.length:
        raise SystemExit(f"the text has only {ids.shape[1]} tokens, fewer than --length {args.length}")
    record = provenance(model, None)
    _prepare(model, args.child, args.factor, args.w)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) now restarts from the current RSS
    before = _status_kib("VmRSS")
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=LAST + 1).logits[0, :-1].float()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _status_kib("VmHWM")
    nll = F.cross_entropy(logits, ids[0, -LAST:]).item()
    return {
        "variant": args.child,
        "length": args.length,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
        "rss_before_mib": round(before / 1024, 1),
        "peak_rss_mib": round(peak / 1024, 1),
        "forward_added_mib": round((peak - before) / 1024, 1),
        "ppl_last_1k": round(math.exp(nll), 3),
        "torch_threads": torch.get_num_threads(),
        "provenance": record,
    }


def naive_fits(length: int, heads: int = 9) -> tuple[bool, str]:
    """The naive variant holds a [H, L, L] fp32 bias plus [L, L] temporaries: skip it (and say so)
    where this machine has not that much memory available."""
    need = (heads * 4 + 5) * length * length + (2 << 30)
    available = _status_meminfo("MemAvailable") * 1024
    note = f"needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"
    return available > need, note


def _status_meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/meminfo")


def markdown(results: list[dict], args) -> str:
    base = next((r for r in results if r["variant"] == "sdpa" and "seconds" in r), None)
    lines = [
        f"SmolLM2-135M fp32, {args.length} tokens, factor {args.factor}, w = {args.w or 'window'}, "
        f"one forward per variant in its own process ({results[0].get('torch_threads', '?')} threads)",
        "",
        "| variant | peak RSS (MiB) | added by forward (MiB) | CPU time (s) | wall time (s) | peak RSS vs sdpa | CPU time vs sdpa | wall time vs sdpa | PPL last 1k |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "seconds" not in r:
            lines.append(f"| {r['variant']} | {r['error']} | | | | | | | |")
            continue
        ratios = [""] * 3 if base is None else [f"{r[k] / base[k]:.2f}x" for k in ("peak_rss_mib", "cpu_seconds", "seconds")]
        lines.append(
            f"| {r['variant']} | {r['peak_rss_mib']:.0f} | {r['forward_added_mib']:.0f} | {r['cpu_seconds']:.0f} | "
            f"{r['seconds']:.0f} | {' | '.join(ratios)} | {r['ppl_last_1k']:.2f} |"
        )
    lines.append("")
    lines.append(
        "targets for alibi_hybrid: <= 1.15x peak RSS, <= 1.3x time of sdpa. CPU time (all threads of the "
        "process) is the steadier time on a shared machine; wall time also counts waiting for cores."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument(
        "--factor",
        type=float,
        default=4.0,
        help='rotary factor (default 4, as in docs/references.md, "Reference measurements on SmolLM2-135M")',
    )
    parser.add_argument("--w", type=int, default=None, help="bias-free distance (default: the model's window)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per variant")
    parser.add_argument("--out", type=Path, default=Path("results/alibi_memory.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.child_out.write_text(json.dumps(run_child(args)))
        return

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    results = []
    for variant in tqdm(variants, desc="variants"):
        if variant == "naive":
            fits, note = naive_fits(args.length)
            if not fits:
                results.append({"variant": variant, "error": f"skipped: {note}"})
                continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            command = [
                sys.executable,
                __file__,
                "--child",
                variant,
                "--child-out",
                str(out),
                "--length",
                str(args.length),
                "--factor",
                str(args.factor),
            ]
            if args.w is not None:
                command += ["--w", str(args.w)]
            try:
                done = subprocess.run(command, timeout=args.timeout, capture_output=True, text=True, env=os.environ)
                if done.returncode == 0:
                    results.append(json.loads(out.read_text()))
                else:
                    error = "killed (out of memory?)" if done.returncode < 0 else done.stderr.strip().splitlines()[-1][:200]
                    results.append({"variant": variant, "error": f"failed: {error}"})
            except subprocess.TimeoutExpired:
                results.append({"variant": variant, "error": f"timed out after {args.timeout} s"})
        tqdm.write(json.dumps(results[-1]))
    records = [r.pop("provenance") for r in results if "provenance" in r]
    record = records[0] if records else None
    table = markdown(results, args)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results, "provenance": record}, indent=2)
    )
    args.out.with_suffix(".md").write_text(table + "\n" + ("" if record is None else "\n" + provenance_line(record)))


if __name__ == "__main__":
    main()
