"""`rope-ext demo`: the embedded SmolLM2 (trained window 8192) reads Gutenberg text past its
window, unpatched and patched, and perplexity by position shows where plain RoPE breaks.

The protocol is that of docs/references.md, "Reference measurements on SmolLM2-135M": the first six
Gutenberg plays joined, one forward over the first --length tokens, token-level NLL, no BOS."""

from __future__ import annotations

import argparse

from rope_ext.defaults import gutenberg_text
from rope_ext.evals import output

HELP = "SmolLM2 past its window: plain vs patched perplexity (offline)"
RUNS = __name__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=int, default=16384, help="tokens read in one forward (default 16384 = 2x the window)")
    parser.add_argument("--methods", default="plain,ntk,yarn", help="comma-separated; plain = unpatched")
    parser.add_argument("--factor", type=float, default=4.0, help="scale for every patched method (default 4)")
    parser.add_argument("--bucket", type=int, default=2048, help="width of the position buckets in the table")
    output.output_arguments(parser)


def method_names(args: argparse.Namespace) -> list:
    return [m.strip() for m in args.methods.split(",") if m.strip()]


def check(args: argparse.Namespace):
    """(method specs as (label, method, factor), result folder): every argument checked before the
    model loads."""
    from rope_ext import loading

    if args.length < 2 or args.bucket < 1:
        raise ValueError(f"--length must be >= 2 and --bucket >= 1, got --length {args.length} --bucket {args.bucket}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError(f"--methods names no method, got {args.methods!r}")
    runs = []
    for method in methods:
        factor = None if method == loading.PLAIN else args.factor
        loading.check_method(method, factor)
        runs.append((method if factor is None else f"{method} x{args.factor:g}", method, factor))
    return runs, output.ResultFolder(args.output, "demo", ["demo.json", "demo.md", "demo.png"], args.overwrite).claim()


def run(args: argparse.Namespace, plan) -> int:
    import torch

    from rope_ext import loading
    from rope_ext.defaults import load_smollm2
    from rope_ext.evals.data import Document
    from rope_ext.evals.perplexity import evaluate

    runs, folder = plan
    model, tokenizer = load_smollm2()
    window = model.config.max_position_embeddings
    ids = tokenizer(gutenberg_text(), return_tensors="pt").input_ids[0, : args.length]
    if len(ids) < args.length:
        raise ValueError(f"the demo text has only {len(ids)} tokens; use --length <= {len(ids)}")
    document = Document("gutenberg-joined", ids)
    print(
        f"SmolLM2-135M, trained window {window}; {args.length} tokens of Gutenberg text; torch threads {torch.get_num_threads()}"
    )

    record = output.provenance(model, None)
    results = {}
    for label, method, factor in runs:
        loading.apply_method(model, method, factor)
        print(f"-> {label}")
        results[label] = evaluate(
            model, [document], [args.length], truncate=True, bucket=args.bucket, progress=not args.no_progress
        )[args.length]

    first = next(iter(results.values()))
    spans = [(b["start"], b["end"]) for b in first["buckets"]]
    header = ["method", "all", *[f"{s // 1024}-{min(e, args.length) // 1024}k" for s, e in spans]]
    rows = [[label, r["ppl"], *[b["ppl"] for b in r["buckets"]]] for label, r in results.items()]
    table = output.markdown_table(header, rows)
    note = f"Perplexity by position (tokens), window {window}: buckets past {window // 1024}k are beyond what the model was trained on."
    print("\n" + note + "\n" + table)
    folder.write_json(
        "demo.json", {"length": args.length, "window": window, "factor": args.factor, "results": results, "provenance": record}
    )
    folder.write_text("demo.md", note + "\n\n" + table + "\n" + output.provenance_line(record))
    from rope_ext.evals.plots import ppl_by_position

    folder.save_figure(
        "demo.png",
        ppl_by_position(
            {label: r["buckets"] for label, r in results.items()},
            window,
            f"SmolLM2-135M: perplexity by position, {args.length} tokens",
        ),
    )
    print(f"\nwrote {folder.folder}/demo.json, demo.md and demo.png")
    return 0
