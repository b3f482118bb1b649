"""`rope-ext compare`: its arguments; rope_ext.evals.compare runs it."""

from __future__ import annotations

import argparse

from rope_ext import loading
from rope_ext.evals import data, output

HELP = "methods x lengths on one model: perplexity, passkey and optionally RULER"
RUNS = "rope_ext.evals.compare"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--methods",
        nargs="+",
        metavar="SPEC",
        help="methods to compare: METHOD or METHOD:KEY=VALUE[,KEY=VALUE], 'plain' = unpatched "
        "(default: plain and every method `rope-ext methods` lists)",
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", metavar="N", help="evaluation lengths (default: window/2, window, 2 x window)"
    )
    parser.add_argument(
        "--factor", type=float, help="factor for every patched method (default: longest length / window, at least 2)"
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="METHOD:KEY=VALUE",
        help="a parameter for one method, repeatable (e.g. dynamic:granularity=512)",
    )
    parser.add_argument(
        "--stride", type=int, help="slide windows over whole documents with this stride (default: first L tokens only)"
    )
    parser.add_argument(
        "--bucket", type=int, help="width of the position buckets of the longest length (default: longest length / 8)"
    )
    parser.add_argument(
        "--bos", action=argparse.BooleanOptionalAction, help="BOS at the start of every window (default: as the tokenizer does)"
    )
    parser.add_argument(
        "--passkey-depths", type=float, nargs="+", default=[0.5], metavar="D", help="passkey key depths (default: 0.5)"
    )
    parser.add_argument(
        "--passkey-lengths", type=int, nargs="+", metavar="N", help="passkey prompt lengths (default: every --lengths)"
    )
    parser.add_argument("--passkey-trials", type=int, default=1, help="passkey trials per (length, depth) (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=10, help="passkey answer tokens (default: 10)")
    parser.add_argument("--no-passkey", action="store_true", help="perplexity only")
    parser.add_argument(
        "--ruler-samples",
        type=int,
        metavar="K",
        help="add a RULER column through lm-eval: K of the 500 samples RULER builds per length, for "
        "every method (default: no RULER; needs rope-ext[ruler])",
    )
    parser.add_argument(
        "--ruler-task", metavar="TASK", help="which RULER task (default: niah_single_1, whose filler needs no download)"
    )
    parser.add_argument(
        "--ruler-lengths",
        type=int,
        nargs="+",
        metavar="N",
        help="RULER lengths: prompt plus answer budget, as RULER counts them (default: every --lengths)",
    )
    loading.model_arguments(parser, method=False)
    data.data_arguments(parser)
    parser.set_defaults(data=data.GUTENBERG_JOINED, limit=1)
    output.output_arguments(parser)


def method_names(args: argparse.Namespace) -> list:
    return [spec.partition(":")[0] for spec in args.methods or []]
