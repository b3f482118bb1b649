"""`rope-ext patch MODEL OUT`: its arguments; rope_ext.export.checkpoint writes a checkpoint
folder, rope_ext.export.gguf_patch a GGUF file."""

from __future__ import annotations

import argparse

from rope_ext.defaults import SMOLLM2 as DEFAULT_MODEL
from rope_ext.loading import METHOD_HELP, method_arguments

HELP = "write a patched checkpoint from its config alone (weights linked) and the commands that serve it"
RUNS = "rope_ext.export.checkpoint"
GGUF_RUNS = "rope_ext.export.gguf_patch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help=f"local checkpoint folder, hub id, {DEFAULT_MODEL} (the embedded SmolLM2), or a .gguf file (written for llama.cpp)",
    )
    parser.add_argument(
        "out",
        metavar="OUT",
        help="new (or empty) folder for the patched checkpoint (weights linked, not copied); a new .gguf file for a .gguf MODEL",
    )
    method_arguments(
        parser,
        method=METHOD_HELP,
        factor="scale relative to the window the patch extends",
        param="method parameter, repeatable (e.g. --param beta_fast=16; a list as --param long_factor=[1.0,1.5])",
        window=", from its shipped scaling and the context it serves",
        required=True,
    )
    parser.add_argument(
        "--allow-shrink", action="store_true", help="accept a patch meant for fewer tokens than the checkpoint serves"
    )
    parser.add_argument(
        "--copy-weights", action="store_true", help="copy the weight files into OUT (default: hard links, else symbolic)"
    )
    parser.add_argument("--json", action="store_true", help="print everything as one JSON object")


def method_names(args: argparse.Namespace) -> list:
    return [args.method]


def runs(args: argparse.Namespace) -> str:
    """The module that writes what MODEL is: a GGUF file, or a checkpoint folder."""
    return GGUF_RUNS if args.model.lower().endswith(".gguf") else RUNS
