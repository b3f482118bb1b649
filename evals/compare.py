"""Methods x lengths on one model (`rope-ext compare`): perplexity and passkey retrieval for each
method at each length, as one table (markdown + JSON) and one plot (PPL vs length, one line per
method, the original window marked).

By default each document is cut to each length (one window per document, as YaRN's --truncate)
and one forward at the longest length serves every shorter one where that is exact (see
perplexity.py); --stride switches to sliding windows over whole documents.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import rope_ext

from . import data as data_mod
from . import loading, output, passkey, perplexity

BASE_METHODS = ("plain", "linear", "ntk", "dynamic", "yarn")


def default_methods() -> list[str]:
    extra = ["alibi_hybrid"] if "alibi_hybrid" in rope_ext.methods() else []
    return [*BASE_METHODS, *extra]


def parse_method_params(items: list[str], methods: list[str]) -> dict[str, dict]:
    """['dynamic:granularity=512'] -> {'dynamic': {'granularity': 512}}."""
    params: dict[str, dict] = {m: {} for m in methods}
    for item in items:
        method, sep, rest = item.partition(":")
        if not sep or method not in params:
            raise ValueError(f"--param expects METHOD:KEY=VALUE with METHOD one of {', '.join(methods)}, got {item!r}")
        params[method].update(loading.parse_params([rest]))
    return params


def original_window(model) -> int:
    described = loading.patched(model)
    if described is not None:
        return described["geometry"]["original_window"]
    return loading.capacity(model)[0]


def markdown(report: dict) -> str:
    setup, rows_in = report["setup"], report["methods"]
    lengths = setup["lengths"]
    pk = setup["passkey"] is not None
    header = ["method", "factor"] + [f"PPL @{n}" for n in lengths] + ([f"passkey @{n}" for n in lengths] if pk else [])
    rows = []
    for m in rows_in:
        row = [m["method"], "-" if m["factor"] is None else f"{m['factor']:g}"]
        row += [m["ppl"][str(n)]["ppl"] for n in lengths]
        if pk:
            row += [m["passkey"]["by_length"].get(n) for n in lengths]
        rows.append(row)
    text = (f"# rope-ext compare: {setup['model']}\n\n"
            f"Original window {setup['original_window']} tokens. PPL: token-weighted, data {setup['data']} "
            f"({setup['documents']} document(s)), " + ("first L tokens of each document" if setup["stride"] is None
                                                       else f"stride {setup['stride']}") + ".")
    if pk:
        text += (f" Passkey: accuracy over depths {setup['passkey']['depths']} x {setup['passkey']['trials']} trial(s), "
                 f"greedy {setup['passkey']['max_new_tokens']} tokens.")
    return text + "\n\n" + output.markdown_table(header, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                        help=f"methods to compare, 'plain' = unpatched (default: {' '.join(default_methods())})")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, metavar="N",
                        help="evaluation lengths (default: window/2, window, 2 x window)")
    parser.add_argument("--factor", type=float, default=None,
                        help="factor for every patched method (default: longest length / window, at least 2)")
    parser.add_argument("--param", action="append", default=[], metavar="METHOD:KEY=VALUE",
                        help="a parameter for one method, repeatable (e.g. dynamic:granularity=512)")
    parser.add_argument("--stride", type=int, default=None,
                        help="slide windows over whole documents with this stride (default: first L tokens only)")
    parser.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                        help="BOS at the start of every window (default: as the tokenizer does)")
    parser.add_argument("--passkey-depths", type=float, nargs="+", default=[0.5], metavar="D",
                        help="passkey key depths (default: 0.5)")
    parser.add_argument("--passkey-trials", type=int, default=1, help="passkey trials per (length, depth) (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=10, help="passkey answer tokens (default: 10)")
    parser.add_argument("--no-passkey", action="store_true", help="perplexity only")
    loading.add_model_arguments(parser, method=False)
    data_mod.add_data_arguments(parser)
    parser.set_defaults(data=data_mod.GUTENBERG_JOINED, limit=1)
    output.add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    methods = args.methods or default_methods()
    for m in methods:
        loading.check_method(m, 2.0)
    method_params = parse_method_params(args.param, methods)
    out = output.ResultFolder(args.output, "compare", ["compare.json", "compare.md", "compare.png"], args.overwrite).claim()
    model, tokenizer = loading.load_model(args.model, args.dtype, args.device, args.attn_implementation)
    loading.apply_method(model, loading.PLAIN)
    window = original_window(model)
    lengths = sorted(set(args.lengths or [window // 2, window, 2 * window]))
    factor = args.factor or max(2.0, float(math.ceil(lengths[-1] / window)))
    if args.stride is not None and args.stride > lengths[0]:
        raise ValueError(f"--stride {args.stride} is larger than the shortest length {lengths[0]}")
    documents = data_mod.documents_from_args(args, tokenizer)
    bos, bos_id = perplexity.bos_token(tokenizer, args.bos)
    if not args.no_passkey:
        shortest = passkey.minimum_length(tokenizer)
        if lengths[0] < shortest:
            raise ValueError(f"length {lengths[0]} is too small for the passkey prompt ({shortest} tokens); "
                             "raise --lengths or pass --no-passkey")

    report = {"setup": {
        "model": loading.model_label(model), "original_window": window, "lengths": lengths,
        "factor": factor, "params": method_params, "data": args.data, "documents": len(documents),
        "document_tokens": [len(d) for d in documents], "stride": args.stride, "bos": bos,
        "passkey": None if args.no_passkey else {"depths": args.passkey_depths, "trials": args.passkey_trials,
                                                 "seed": args.seed or 0, "max_new_tokens": args.max_new_tokens},
    }, "methods": []}
    for method in methods:
        print(f"rope-ext compare: {method}", file=sys.stderr)
        started = time.perf_counter()
        info = loading.apply_method(model, method, None if method == loading.PLAIN else factor, method_params[method])
        loading.warn_beyond_capacity(model, lengths[-1] + int(bos), f"{method} at length {lengths[-1]}")
        ppl = perplexity.evaluate(model, documents, lengths, stride=args.stride, bos=bos, bos_id=bos_id,
                                  truncate=args.stride is None, progress=not args.no_progress)
        result = {"method": method, "factor": None if info is None else info.factor,
                  "patch": None if info is None else info.to_dict(), "ppl": {str(n): r for n, r in ppl.items()}}
        if not args.no_passkey:
            answer = passkey.model_answerer(model, tokenizer, args.max_new_tokens)
            result["passkey"] = passkey.run_trials(answer, tokenizer, lengths, args.passkey_depths, args.passkey_trials,
                                                   args.seed or 0, progress=not args.no_progress)
        result["seconds"] = round(time.perf_counter() - started, 1)
        report["methods"].append(result)
        # written after every method, so a long run that is stopped keeps what finished
        partial = output.ResultFolder(out.folder, "compare", [], overwrite=True)
        partial.write_json("compare.partial.json", report)

    out.write_json("compare.json", report)
    text = markdown(report)
    out.write_text("compare.md", text)
    (out.folder / "compare.partial.json").unlink()
    from .plots import ppl_vs_length

    curves = {m["method"] + ("" if m["factor"] is None else f" x{m['factor']:g}"): {int(n): r["ppl"] for n, r in m["ppl"].items()}
              for m in report["methods"]}
    out.save_figure("compare.png", ppl_vs_length(curves, window, f"{report['setup']['model']}: perplexity vs length"))
    print(text)
    print(f"results in {out.folder}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rope-ext compare", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
