"""`rope-ext eval passkey`: its arguments; rope_ext.evals.passkey runs it."""

from __future__ import annotations

import argparse

from rope_ext import loading
from rope_ext.evals import output
from rope_ext.evals.retrieval import DEFAULT_DEPTHS, DEFAULT_SEEDS

HELP = "passkey retrieval over lengths x depths"
RUNS = "rope_ext.evals.passkey"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths", type=int, nargs="+", metavar="N", help="prompt lengths in tokens (default: capacity/4, capacity/2, capacity)"
    )
    parser.add_argument(
        "--depths",
        type=float,
        nargs="+",
        default=list(DEFAULT_DEPTHS),
        metavar="D",
        help="where the key sits in the filler, 0 = start, 1 = end (default: 19 depths, 0.05 0.1 ... 0.95)",
    )
    parser.add_argument(
        "--seeds",
        "--seed",
        type=int,
        nargs="+",
        default=list(DEFAULT_SEEDS),
        metavar="S",
        help="seeds of the keys: each (length, depth) cell is asked once per seed and trial (default: 0 1)",
    )
    parser.add_argument("--trials", type=int, default=1, help="trials per (length, depth, seed) cell (default: 1)")
    parser.add_argument("--limit", type=int, help="run at most this many trials in all (every length first)")
    parser.add_argument("--max-new-tokens", type=int, default=10, help="greedy tokens generated per answer (default: 10)")
    parser.add_argument(
        "--share-prefix",
        action="store_true",
        help="prompts of one length start from the cache of the first one, cut to the tokens they share, and "
        "prefill only the rest (a chunked prefill: the same answers, up to rounding; not with sink_window)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the trials in --output's passkey.partial.json (a stopped run with the same setup) and ask only the rest",
    )
    parser.add_argument(
        "--baseline",
        metavar="PATH",
        help="passkey.json (or its folder) of the unpatched model at its trained window with the same depths, "
        "trials and seeds: adds the retained retrieval, accuracy / the baseline's",
    )
    loading.model_arguments(parser)
    output.output_arguments(parser)


def method_names(args: argparse.Namespace) -> list:
    return [] if args.method is None else [args.method]
