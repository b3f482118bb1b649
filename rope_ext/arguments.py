"""The command-line arguments of every `rope-ext` command. Nothing here imports more than the
standard library, so `rope-ext <command> --help` answers without loading torch, transformers or
lm-eval; the commands' modules (rope_ext.cli routes to them) import those when they run.

The choices the commands check against live here too, where the help shows them."""

from __future__ import annotations

import argparse
import json

from rope_ext import names
from rope_ext.defaults import SMOLLM2 as DEFAULT_MODEL  # the embedded checkpoint, where a name is expected

PLAIN = "plain"  # the unpatched model
DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"  # bfloat16 where the device computes it natively, else float32 (rope_ext.evals.loading.resolve_dtype)
GUTENBERG = "gutenberg"  # each play one document
# the first six plays joined: the long document of docs/references.md, "Reference measurements on SmolLM2-135M"
GUTENBERG_JOINED = "gutenberg-joined"
DEFAULT_ROOT = "rope-ext-results"
# a dense sweep: five depths can step over a band of depths a method does not read from
DEFAULT_DEPTHS = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 0.05, 0.1, ... 0.95
DEFAULT_SEEDS = (0, 1)
ROPE_RATIO_MEANINGS = ("base", "positions")
METHOD_HELP = "a method that `rope-ext methods` lists"
# The method names, known without torch (rope_ext.names): a misspelt method is answered before
# torch, transformers or lm-eval load.
METHOD_NAMES, RETIRED = names.METHOD_NAMES, names.RETIRED


def unknown_method(methods: list) -> str | None:
    """The error for the first of `methods` that is neither plain nor a registered method, with the
    registered names closest to it (or why it was removed); None when every one is known."""
    for name in methods:
        if name != PLAIN and (error := names.unknown_method(name)) is not None:
            return error
    return None


def named_methods(command: str, args: argparse.Namespace) -> list:
    """The method names the parsed arguments of `command` give."""
    if command in ("eval ppl", "eval passkey"):
        return [] if args.method is None else [args.method]
    if command == "compare":
        return [spec.partition(":")[0] for spec in args.methods or []]
    if command == "demo":
        return [m.strip() for m in args.methods.split(",") if m.strip()]
    if command == "patch":
        return [args.method]
    return []


def lm_eval_method(argv: list[str]) -> list:
    """The method in the --model_args (KEY=VALUE,... or a JSON object) of an lm-eval command line
    that evaluates --model rope_ext."""
    values = {}
    for flag in ("--model", "--model_args"):
        for index, token in enumerate(argv):
            if token == flag and index + 1 < len(argv):
                values[flag] = argv[index + 1]
            elif token.startswith(flag + "="):
                values[flag] = token.partition("=")[2]
    text = values.get("--model_args", "")
    if values.get("--model") != "rope_ext" or not text:
        return []
    if text.lstrip().startswith("{"):
        try:
            given = json.loads(text)
        except json.JSONDecodeError:
            return []  # lm-eval's own parser says what is wrong
        return [given["method"]] if isinstance(given, dict) and given.get("method") else []
    pairs = dict(item.partition("=")[::2] for item in text.split(","))
    return [pairs["method"].strip()] if pairs.get("method", "").strip() else []


def model_arguments(parser, *, method: bool = True) -> None:
    """--model/--dtype/--device/--attn-implementation/--chunk-size, and with `method` also
    --method/--factor/--param/--original-window."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default=None,
        metavar="PATH_OR_ID",
        help=f"local checkpoint directory or hub id (default: {DEFAULT_MODEL}, the embedded SmolLM2-135M)",
    )
    group.add_argument(
        "--dtype",
        default=AUTO,
        choices=(AUTO, *DTYPES),
        help="weights and activations dtype; auto: bfloat16 on a CPU with native bf16 dot products "
        "(AVX512-BF16 or AMX) or a CUDA GPU with bf16, else float32; rotary angles stay fp32 "
        "(default: auto; results record the dtype)",
    )
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    group.add_argument("--attn-implementation", default="sdpa", help="transformers attention backend (default: sdpa)")
    group.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="N",
        help="run each input through the KV cache N tokens at a time (rope_ext.chunked): memory holds "
        "the cache and one chunk; with sink_window the cache keeps only the sinks and the window "
        "(default: one forward per input)",
    )
    if method:
        group.add_argument(
            "--method",
            default=None,
            help=f"{METHOD_HELP}, or plain (unpatched) (default: the model as loaded: a checkpoint saved "
            "patched, or a fine-tune folder, keeps its patch; the embedded SmolLM2 is unpatched)",
        )
        group.add_argument(
            "--factor", type=float, default=None, help="scale relative to the original window (required unless plain)"
        )
        group.add_argument(
            "--param",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="extra method parameter, repeatable (e.g. --param beta_fast=16 --param causal=false; a list as "
            "--param long_factor=[1.0,1.5,2.0], as longrope takes)",
        )
        group.add_argument(
            "--original-window",
            type=int,
            default=None,
            help="the pretraining window: the method replaces the checkpoint's shipped scaling over it (default: the "
            "patch extends the model as loaded)",
        )


def data_arguments(parser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        default=GUTENBERG,
        metavar="SOURCE",
        help=f"'{GUTENBERG}' (each embedded Gutenberg play is a document), '{GUTENBERG_JOINED}' (the first six "
        "plays as one document), a local text file, a folder of text/JSONL files, or a `datasets` id such as "
        "emozilla/pg19-test (needs a reachable hub) (default: gutenberg)",
    )
    group.add_argument("--data-split", default="test", help="split of a `datasets` source (default: test)")
    group.add_argument("--data-field", default="text", help="text field of a `datasets` or JSONL source (default: text)")
    group.add_argument("--min-tokens", type=int, default=0, help="skip documents shorter than this many tokens")
    group.add_argument("--limit", type=int, default=None, help="use at most this many documents (after --min-tokens)")
    group.add_argument(
        "--seed",
        type=int,
        default=None,
        help="with --limit: pick the documents at random with this seed instead of the first ones",
    )


def output_arguments(parser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument(
        "--output", default=None, metavar="DIR", help=f"folder for the results (default: {DEFAULT_ROOT}/<command>-<time>)"
    )
    group.add_argument("--overwrite", action="store_true", help="replace result files that already exist in --output")
    group.add_argument("--no-progress", action="store_true", help="hide progress bars")


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """`rope-ext env`."""


def methods(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="the listing as JSON (name -> summary, formula, params, dynamic)")


def demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=int, default=16384, help="tokens read in one forward (default 16384 = 2x the window)")
    parser.add_argument("--methods", default="plain,ntk,yarn", help="comma-separated; plain = unpatched")
    parser.add_argument("--factor", type=float, default=4.0, help="scale for every patched method (default 4)")
    parser.add_argument("--bucket", type=int, default=2048, help="width of the position buckets in the table")
    output_arguments(parser)


def perplexity(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths", type=int, nargs="+", required=True, metavar="N", help="window lengths in tokens (e.g. 4096 8192 16384)"
    )
    parser.add_argument(
        "--stride",
        type=int,
        default=None,
        help="tokens between window starts (default: the length, non-overlapping; YaRN used 256)",
    )
    parser.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="feed BOS at the start of every window (default: as the tokenizer does)",
    )
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="cut each document to its first LENGTH tokens: one window per document (YaRN's --truncate)",
    )
    parser.add_argument("--bucket", type=int, default=None, help="width of the position buckets (default: max length / 8)")
    model_arguments(parser)
    data_arguments(parser)
    output_arguments(parser)


def passkey(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="prompt lengths in tokens (default: capacity/4, capacity/2, capacity)",
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
    parser.add_argument("--limit", type=int, default=None, help="run at most this many trials in all (every length first)")
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
        default=None,
        metavar="PATH",
        help="passkey.json (or its folder) of the unpatched model at its trained window with the same depths, "
        "trials and seeds: adds the retained retrieval, accuracy / the baseline's",
    )
    model_arguments(parser)
    output_arguments(parser)


def compare(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="methods to compare: METHOD or METHOD:KEY=VALUE[,KEY=VALUE], 'plain' = unpatched "
        "(default: plain and every method `rope-ext methods` lists)",
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="evaluation lengths (default: window/2, window, 2 x window)",
    )
    parser.add_argument(
        "--factor",
        type=float,
        default=None,
        help="factor for every patched method (default: longest length / window, at least 2)",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="METHOD:KEY=VALUE",
        help="a parameter for one method, repeatable (e.g. dynamic:granularity=512)",
    )
    parser.add_argument(
        "--stride",
        type=int,
        default=None,
        help="slide windows over whole documents with this stride (default: first L tokens only)",
    )
    parser.add_argument(
        "--bucket",
        type=int,
        default=None,
        help="width of the position buckets of the longest length (default: longest length / 8)",
    )
    parser.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="BOS at the start of every window (default: as the tokenizer does)",
    )
    parser.add_argument(
        "--passkey-depths", type=float, nargs="+", default=[0.5], metavar="D", help="passkey key depths (default: 0.5)"
    )
    parser.add_argument(
        "--passkey-lengths",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="passkey prompt lengths (default: every --lengths)",
    )
    parser.add_argument("--passkey-trials", type=int, default=1, help="passkey trials per (length, depth) (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=10, help="passkey answer tokens (default: 10)")
    parser.add_argument("--no-passkey", action="store_true", help="perplexity only")
    parser.add_argument(
        "--ruler-samples",
        type=int,
        default=None,
        metavar="K",
        help="add a RULER column through lm-eval: K of the 500 samples RULER builds per length, for "
        "every method (default: no RULER; needs rope-ext[ruler])",
    )
    parser.add_argument(
        "--ruler-task",
        default=None,
        metavar="TASK",
        help="which RULER task (default: niah_single_1, whose filler needs no download)",
    )
    parser.add_argument(
        "--ruler-lengths",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="RULER lengths: prompt plus answer budget, as RULER counts them (default: every --lengths)",
    )
    model_arguments(parser, method=False)
    data_arguments(parser)
    parser.set_defaults(data=GUTENBERG_JOINED, limit=1)
    output_arguments(parser)


def convert_chatglm(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="remote-code ChatGLM2/3 or GLM-4 checkpoint folder")
    parser.add_argument("dst", help="folder for the native transformers GLM checkpoint")
    parser.add_argument(
        "--rope-ratio-meaning",
        choices=ROPE_RATIO_MEANINGS,
        default=None,
        help="what rope_ratio does when the checkpoint's modeling file does not say: 'base' (ChatGLM3-6B-32K, "
        "GLM-4: base = 10000 * rope_ratio) or 'positions' (ChatGLM2-6B-32K: positions / rope_ratio)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="dtype of the written weights (default: the source's)"
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest weight file written (default 5GB)")


def patch_checkpoint(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--method", required=True, help=METHOD_HELP)
    parser.add_argument("--factor", type=float, default=None, help="scale relative to the window the patch extends")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="method parameter, repeatable (e.g. --param beta_fast=16; a list as --param long_factor=[1.0,1.5])",
    )
    parser.add_argument(
        "--original-window",
        type=int,
        default=None,
        help="the pretraining window: the method replaces the checkpoint's shipped scaling over it (default: the "
        "patch extends the model as loaded, from its shipped scaling and the context it serves)",
    )
    parser.add_argument(
        "--allow-shrink", action="store_true", help="accept a patch meant for fewer tokens than the checkpoint serves"
    )
    parser.add_argument(
        "--copy-weights", action="store_true", help="copy the weight files into OUT (default: hard links, else symbolic)"
    )
    parser.add_argument("--json", action="store_true", help="print everything as one JSON object")


def needle_prompt_arguments(parser: argparse.ArgumentParser, seeds: str) -> None:
    """The passkey prompts a command scores its settings on (search, dpe-probe), and the model's
    window, dtype and device; `seeds`: what --seed seeds."""
    parser.add_argument(
        "--needle",
        choices=("digits", "words"),
        default="digits",
        help="how the prompts spell the key: digits, or each digit's English name for a model that saw few digits (default: digits)",
    )
    parser.add_argument(
        "--length", type=int, default=None, help="prompt length in tokens (default: the trained window x --factor)"
    )
    parser.add_argument("--seed", type=int, default=0, help=f"seed of {seeds} (default 0)")
    parser.add_argument(
        "--original-window",
        type=int,
        default=None,
        help="the pretraining window, for checkpoints whose config does not record it",
    )
    parser.add_argument("--dtype", default=AUTO, choices=(AUTO, *DTYPES), help="weights and activations dtype (default: auto)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available, else cpu)")


# rope_ext.search_space.SPACES, named here so that --help starts without torch
SEARCH_SPACES = ("longrope", "dpe", "string", "self_extend")


def search(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH_OR_ID",
        help=f"the base checkpoint (default: {DEFAULT_MODEL}, the embedded SmolLM2-135M)",
    )
    parser.add_argument("--factor", type=float, required=True, help="target length over the trained window (> 1)")
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
        "--groups",
        type=int,
        default=None,
        help="--space dpe: groups of frequency pairs, one scale each (default 8, the authors')",
    )
    parser.add_argument(
        "--output",
        default=None,
        metavar="DIR",
        help=f"folder for the log, best.json and the checkpoint (default: {DEFAULT_ROOT}/search-<time>)",
    )
    parser.add_argument("--resume", action="store_true", help="continue the search logged in --output/search.jsonl")
    parser.add_argument("--population", type=int, default=16, help="candidates kept per generation (default 16)")
    parser.add_argument("--samples", type=int, default=4, help="passkey prompts each candidate is scored on (default 4)")
    parser.add_argument("--generations", type=int, default=None, help="stop after this many generations (default: the budget)")
    needle_prompt_arguments(parser, seeds="the prompts' keys and of the search")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def dpe_probe(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH_OR_ID",
        help=f"the checkpoint to probe (default: {DEFAULT_MODEL}, the embedded SmolLM2-135M)",
    )
    parser.add_argument("--factor", type=float, required=True, help="target length over the trained window (> 1)")
    parser.add_argument(
        "--groups", type=int, default=8, help="groups of frequency pairs, fastest first (default 8, the authors')"
    )
    parser.add_argument(
        "--base",
        type=int,
        default=None,
        help="the scale of the groups not being moved (default: 2 x length / trained window, the authors')",
    )
    parser.add_argument(
        "--candidates",
        default=None,
        metavar="S1,S2,...",
        help="the scales each group is tried at (default: the base x 1/16, 1/4, 1/2, 1, 2, 4, 16, whole numbers >= 1)",
    )
    parser.add_argument("--window", type=int, default=None, help="dpe's local window W (default: the trained window / 8)")
    parser.add_argument(
        "--inside-window",
        action="store_true",
        help="scale from position W on, inside the trained window too, as the authors' code (default: past the trained window)",
    )
    parser.add_argument("--samples", type=int, default=10, help="passkey prompts per setting (default 10)")
    needle_prompt_arguments(parser, seeds="the prompts' keys")
    output_arguments(parser)
