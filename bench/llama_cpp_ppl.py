"""The embedded SmolLM2 GGUF (Q4_1) read by llama.cpp past its window, unpatched and patched by a
GGUF that `rope-ext patch` writes, beside rope-ext's transformers model of the same patch (fp32, the
GGUF's weights dequantized once by transformers, rope_ext.defaults.smollm2_path): perplexity by
position over the demo's text (rope-ext demo: the first six Gutenberg plays joined, the first
--length tokens as one sequence, no BOS, buckets of --bucket tokens, evals/perplexity.py's
bucketing for both sides).

llama.cpp runs through llama-cpp-python (the `llama-cpp` extra, docs/serving.md for the build on a
CPU without AVX-512) with its defaults but for the context: n_ctx = --length, logits for every row,
no flash attention, an f16 KV cache. Its NLL is computed from those logits in fp32. Each patched
GGUF is written from metadata alone (rope_ext.export.gguf_patch); one more row runs llama.cpp's own YaRN
x4 set through its constructor on the unpatched file, beside rope-ext's yarn x4.

    python bench/llama_cpp_ppl.py --output results.json            # every run, in one process
    python bench/llama_cpp_ppl.py --runs plain --output plain.json  # one run; then, the runs as one file:
    python bench/llama_cpp_ppl.py --combine plain.json ... --output docs/results/smollm2-llama-cpp-16k.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rope_ext import defaults, loading
from rope_ext.export import gguf_patch, gguf_rope
from rope_ext.evals.data import Document
from rope_ext.evals.output import markdown_table, provenance, write_measurement
from rope_ext.evals.perplexity import LengthStats, evaluate
from rope_ext.extras import missing

FACTOR = 4.0
SEARCHED = Path(__file__).resolve().parents[1] / "docs/results/smollm2-search-x4-best.json"
# label -> (rope-ext method, its params, llama.cpp constructor arguments on the unpatched file)
RUNS = {
    "plain": ("plain", {}, None),
    "linear x4": ("linear", {}, None),
    "ntk x4": ("ntk", {}, None),
    "yarn x4": ("yarn", {}, None),
    "ntk_by_parts x4": ("ntk_by_parts", {}, None),
    "llama3 x4": ("llama3", {}, None),
    "longrope x4 (searched set)": ("longrope", "searched", None),
    # LLAMA_ROPE_SCALING_TYPE_YARN = 2 (llama.cpp include/llama.h)
    "yarn x4 (llama.cpp constructor)": (
        "yarn",
        {},
        {"rope_scaling_type": 2, "rope_freq_scale": 1 / FACTOR, "yarn_orig_ctx": defaults.SMOLLM2_WINDOW},
    ),
}


def params_of(spec) -> dict:
    """A run's method parameters; "searched": `rope-ext search`'s long factors for SmolLM2 x4
    (docs/results/smollm2-search-x4-best.json) as both sets, the one set llama.cpp can serve."""
    if spec != "searched":
        return spec
    factors = json.loads(SEARCHED.read_text())["long_factor"]
    return {"long_factor": factors, "short_factor": factors}


def llama_cpp_nll(
    path: Path, ids: torch.Tensor, threads: int, batch: int, constructor: dict | None
) -> tuple[torch.Tensor, float]:
    """(NLL of ids[1:] given the prefix, seconds) from llama.cpp's logits over `ids` in one context."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=len(ids),
        n_batch=batch,
        n_ubatch=batch,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
        **(constructor or {}),
    )
    start = time.perf_counter()
    llm.eval(ids.tolist())
    seconds = time.perf_counter() - start
    logits = torch.from_numpy(llm.scores[: len(ids) - 1])
    nll = torch.nn.functional.cross_entropy(logits.float(), ids[1:], reduction="none")
    llm.close()
    return nll, seconds


def buckets(nll: torch.Tensor, length: int, bucket: int) -> dict:
    """evals/perplexity.py's summary of one sequence scored from position 1."""
    stats = LengthStats(length, bucket)
    stats.add("gutenberg-joined", nll, positions=torch.arange(1, length), window_positions=length)
    return stats.summary()


def measure(args) -> dict:
    """The results file of the runs `args.runs`: per run, both sides' perplexity by bucket, their
    difference, the written metadata, the seconds; the provenance of the run."""
    import llama_cpp

    source = defaults.smollm2_gguf()
    model, tokenizer = defaults.load_smollm2()
    ids = tokenizer(defaults.gutenberg_text(), return_tensors="pt").input_ids[0, : args.length]
    record = {
        **provenance(model, None),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp": gguf_rope.LLAMA_CPP,
        "gguf": f"{source.name} (sha1 {defaults.smollm2_key()})",
        "llama_cpp_threads": args.threads,
        "llama_cpp_batch": args.batch,
    }
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for label in args.runs:
            method, spec, constructor = RUNS[label]
            params = params_of(spec)
            path, metadata = source, None
            if method != "plain" and constructor is None:
                plan = gguf_patch.plan(source, method, FACTOR, params, None, False)
                path = Path(folder) / f"{method}.gguf"
                gguf_patch.write(source, path, plan)
                metadata = {**plan.metadata, "rope_freqs": None if plan.freqs is None else plan.freqs.tolist()}
            print(f"-> {label}: llama.cpp", flush=True)
            nll, cpp_seconds = llama_cpp_nll(path, ids, args.threads, args.batch, constructor)
            cpp = buckets(nll, args.length, args.bucket)
            print(f"-> {label}: transformers", flush=True)
            loading.apply_method(model, method, None if method == "plain" else FACTOR, params)
            start = time.perf_counter()
            hf = evaluate(
                model, [Document("gutenberg-joined", ids)], [args.length], truncate=True, bucket=args.bucket, progress=False
            )
            hf = hf[args.length]
            differences = [100 * (c["ppl"] / h["ppl"] - 1) for c, h in zip(cpp["buckets"], hf["buckets"])]
            results[label] = {
                "method": method,
                "params": params,
                "llama_cpp_constructor": constructor,
                "metadata": metadata,
                "llama_cpp": cpp,
                "transformers": hf,
                "difference_percent": {"all": 100 * (cpp["ppl"] / hf["ppl"] - 1), "buckets": differences},
                "seconds": {"llama_cpp": cpp_seconds, "transformers": time.perf_counter() - start},
                "provenance": record,
            }
            print(
                f"   all: llama.cpp {cpp['ppl']:.2f}, transformers {hf['ppl']:.2f}; buckets differ by "
                + " ".join(f"{d:+.2f}%" for d in differences),
                flush=True,
            )
    return {"length": args.length, "bucket": args.bucket, "factor": FACTOR, "results": results}


def combined(paths: list[Path]) -> dict:
    """Results files of separate runs (the same length and buckets) as one, each run with its provenance."""
    parts = [json.loads(path.read_text()) for path in paths]
    settings = {(p["length"], p["bucket"], p["factor"]) for p in parts}
    if len(settings) != 1:
        raise SystemExit(f"the files measure different settings (length, bucket, factor): {sorted(settings)}")
    return {
        **{k: parts[0][k] for k in ("length", "bucket", "factor")},
        "results": {k: v for p in parts for k, v in p["results"].items()},
    }


def table(measurement: dict) -> str:
    """llama.cpp's and transformers' perplexity per bucket, and llama.cpp's difference in %, per run."""
    results = measurement["results"]
    spans = [f"{b['start'] // 1024}-{b['end'] // 1024}k" for b in next(iter(results.values()))["transformers"]["buckets"]]
    rows = []
    for label, r in results.items():
        rows.append(
            [f"{label}: llama.cpp", round(r["llama_cpp"]["ppl"], 2), *[round(b["ppl"], 2) for b in r["llama_cpp"]["buckets"]]]
        )
        rows.append(
            [
                f"{label}: transformers",
                round(r["transformers"]["ppl"], 2),
                *[round(b["ppl"], 2) for b in r["transformers"]["buckets"]],
            ]
        )
        differences = (r["difference_percent"]["all"], *r["difference_percent"]["buckets"])
        rows.append([f"{label}: difference %", *[f"{d:+.2f}" for d in differences]])
    return markdown_table(["run", "all", *spans], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="the results JSON (a .md beside it); must not exist")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--bucket", type=int, default=2048)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2048, help="llama.cpp's n_batch and n_ubatch")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON", help="no measurement: these results files as one")
    args = parser.parse_args()
    if args.output.exists():
        parser.error(f"{args.output} exists; a measurement is never replaced")
    if args.combine:
        measurement = combined(args.combine)
    elif missing(("llama_cpp",)):
        parser.error('llama.cpp runs through llama-cpp-python: pip install "rope-ext[llama-cpp]" (its build: docs/serving.md)')
    else:
        measurement = measure(args)
    text = table(measurement)
    write_measurement(args.output, measurement)
    args.output.with_suffix(".md").write_text(
        "Perplexity by position of the embedded SmolLM2 GGUF (Q4_1) in llama.cpp and of rope-ext's transformers model "
        f"of the same patch (fp32, dequantized weights), the demo's first {measurement['length']} tokens "
        "(bench/llama_cpp_ppl.py); difference: llama.cpp / transformers - 1.\n\n"
        + text
        + "\n\nProvenance of each run: its `provenance` in the JSON beside this file.\n"
    )
    print(text)


if __name__ == "__main__":
    main()
