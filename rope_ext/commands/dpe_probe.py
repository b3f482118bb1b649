"""`rope-ext dpe-probe`: its arguments; rope_ext.tuning.dpe_probe runs it."""

from __future__ import annotations

import argparse

from rope_ext.commands.search import needle_prompt_arguments, target_arguments
from rope_ext.evals import output

HELP = "DPE's probe of each dimension group's effective distance: one group's scale moved at a time, needles answered"
RUNS = "rope_ext.tuning.dpe_probe"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target_arguments(parser, "the checkpoint to probe")
    parser.add_argument(
        "--groups", type=int, default=8, help="groups of frequency pairs, fastest first (default 8, the authors')"
    )
    parser.add_argument(
        "--base", type=int, help="the scale of the groups not being moved (default: 2 x length / trained window, the authors')"
    )
    parser.add_argument(
        "--candidates",
        metavar="S1,S2,...",
        help="the scales each group is tried at (default: the base x 1/16, 1/4, 1/2, 1, 2, 4, 16, whole numbers >= 1)",
    )
    parser.add_argument("--window", type=int, help="dpe's local window W (default: the trained window / 8)")
    parser.add_argument(
        "--inside-window",
        action="store_true",
        help="scale from position W on, inside the trained window too, as the authors' code (default: past the trained window)",
    )
    parser.add_argument("--samples", type=int, default=10, help="passkey prompts per setting (default 10)")
    needle_prompt_arguments(parser, seeds="the prompts' keys")
    output.output_arguments(parser)
