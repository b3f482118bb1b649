"""`rope-ext methods`: the registered methods and their parameters, read from rope_ext/catalog.json
without torch."""

from __future__ import annotations

import argparse
import json

from rope_ext import catalog

HELP = "list the scaling methods and their parameters (--json)"
RUNS = __name__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="the listing as JSON (name -> summary, formula, params, dynamic)")


def check(args: argparse.Namespace) -> None:
    """Nothing to check."""


def run(args: argparse.Namespace, plan: None = None) -> int:
    listing = catalog.read()
    print(json.dumps(listing, indent=1) if args.json else catalog.text(listing))
    return 0
