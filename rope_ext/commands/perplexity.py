"""`rope-ext eval ppl`: its arguments; rope_ext.evals.perplexity runs it."""

from __future__ import annotations

import argparse

from rope_ext import loading
from rope_ext.evals import data, output

HELP = "sliding-window perplexity of long documents"
RUNS = "rope_ext.evals.perplexity"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths", type=int, nargs="+", required=True, metavar="N", help="window lengths in tokens (e.g. 4096 8192 16384)"
    )
    parser.add_argument(
        "--stride", type=int, help="tokens between window starts (default: the length, non-overlapping; YaRN used 256)"
    )
    parser.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        help="feed BOS at the start of every window (default: as the tokenizer does)",
    )
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="cut each document to its first LENGTH tokens: one window per document (YaRN's --truncate)",
    )
    parser.add_argument("--bucket", type=int, help="width of the position buckets (default: max length / 8)")
    loading.model_arguments(parser)
    data.data_arguments(parser)
    output.output_arguments(parser)


def method_names(args: argparse.Namespace) -> list:
    return [] if args.method is None else [args.method]
