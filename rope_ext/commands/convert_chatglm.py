"""`rope-ext convert-chatglm SRC DST`: its arguments; rope_ext.patches.chatglm.convert runs it."""

from __future__ import annotations

import argparse

from rope_ext.loading import DTYPES

HELP = "write a remote-code ChatGLM2/3 or GLM-4 checkpoint as a native transformers GLM checkpoint"
RUNS = "rope_ext.patches.chatglm.convert"
# rope_ext.patches.chatglm.convert.MEANINGS, named here so that --help starts without torch (a test holds them equal)
ROPE_RATIO_MEANINGS = ("base", "positions")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="remote-code ChatGLM2/3 or GLM-4 checkpoint folder")
    parser.add_argument("dst", help="folder for the native transformers GLM checkpoint")
    parser.add_argument(
        "--rope-ratio-meaning",
        choices=ROPE_RATIO_MEANINGS,
        help="what rope_ratio does when the checkpoint's modeling file does not say: 'base' (ChatGLM3-6B-32K, "
        "GLM-4: base = 10000 * rope_ratio) or 'positions' (ChatGLM2-6B-32K: positions / rope_ratio)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of the written weights (default: the source's)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest weight file written (default 5GB)")
