"""`rope-ext search`: its arguments, and the needle prompts it shares with `rope-ext dpe-probe`;
rope_ext.tuning.search runs it."""

from __future__ import annotations

import argparse

from rope_ext.defaults import SMOLLM2 as DEFAULT_MODEL
from rope_ext.evals.output import DEFAULT_ROOT
from rope_ext.loading import AUTO, DTYPES

HELP = (
    "evolutionary search of a position map (longrope factors, dpe scales, string shift, temperature); "
    "writes the best as a checkpoint"
)
RUNS = "rope_ext.tuning.search"
# rope_ext.tuning.search_space.SPACES, named here so that --help starts without torch (a test holds them equal)
SEARCH_SPACES = ("longrope", "dpe", "string", "self_extend")


def needle_prompt_arguments(parser: argparse.ArgumentParser, seeds: str) -> None:
    """The passkey prompts a command scores its settings on (search, dpe-probe), and the model's
    window, dtype and device; `seeds`: what --seed seeds."""
    parser.add_argument(
        "--needle",
        choices=("digits", "words"),
        default="digits",
        help="how the prompts spell the key: digits, or each digit's English name for a model that saw few digits (default: digits)",
    )
    parser.add_argument("--length", type=int, help="prompt length in tokens (default: the trained window x --factor)")
    parser.add_argument("--seed", type=int, default=0, help=f"seed of {seeds} (default 0)")
    parser.add_argument(
        "--original-window", type=int, help="the pretraining window, for checkpoints whose config does not record it"
    )
    parser.add_argument("--dtype", default=AUTO, choices=(AUTO, *DTYPES), help="weights and activations dtype (default: auto)")
    parser.add_argument("--device", help="cpu, cuda, ... (default: cuda when available, else cpu)")


def target_arguments(parser: argparse.ArgumentParser, checkpoint: str) -> None:
    """--model (`checkpoint` says what it is to the command) and --factor, which search and dpe-probe ask first."""
    parser.add_argument(
        "--model", metavar="PATH_OR_ID", help=f"{checkpoint} (default: {DEFAULT_MODEL}, the embedded SmolLM2-135M)"
    )
    parser.add_argument("--factor", type=float, required=True, help="target length over the trained window (> 1)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target_arguments(parser, "the base checkpoint")
    parser.add_argument(
        "--budget-minutes", type=float, required=True, help="minutes of evaluations in this run (a --resume adds its own)"
    )
    parser.add_argument(
        "--space",
        choices=SEARCH_SPACES,
        default="longrope",
        help="what is searched (docs/search.md): longrope's per-pair long_factor, written as transformers' own longrope "
        "config; dpe's per-group scales (powers of two); string's shift; self_extend's group; the last three written "
        "as rope-ext checkpoints for rope_ext.from_pretrained (default: longrope)",
    )
    parser.add_argument(
        "--temperature",
        action="store_true",
        help="also search Llama 4's query temperature attn_scale in [0, 0.5], for a space whose method takes it (self_extend)",
    )
    parser.add_argument(
        "--groups", type=int, help="--space dpe: groups of frequency pairs, one scale each (default 8, the authors')"
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        help=f"folder for the log, best.json and the checkpoint (default: {DEFAULT_ROOT}/search-<time>)",
    )
    parser.add_argument("--resume", action="store_true", help="continue the search logged in --output/search.jsonl")
    parser.add_argument("--population", type=int, default=16, help="candidates kept per generation (default 16)")
    parser.add_argument("--samples", type=int, default=4, help="passkey prompts each candidate is scored on (default 4)")
    parser.add_argument("--generations", type=int, help="stop after this many generations (default: the budget)")
    needle_prompt_arguments(parser, seeds="the prompts' keys and of the search")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
