"""The `rope-ext` command. Each subcommand's arguments are a function of rope_ext.arguments, which
imports only the standard library, so every `--help` answers at once; the subcommand itself lives
in its own module with `check(args) -> plan` (every argument, path and spec checked before any
work starts) and `run(args, plan) -> exit code`, imported once the arguments are parsed. This file
only routes.

Exit codes: 0 done, 1 a failure while the command ran, 2 a usage error (argparse's, or one that
`check` found)."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from importlib import metadata

from rope_ext import arguments, catalog, extras

# name -> (module, its arguments in rope_ext.arguments, one-line help); "eval X" commands are nested under `eval`
COMMANDS = {
    "demo": ("rope_ext.demo", arguments.demo, "SmolLM2 past its window: plain vs patched perplexity (offline)"),
    "patch": (
        "rope_ext.patch_checkpoint",
        arguments.patch_checkpoint,
        "write a patched checkpoint from its config alone (weights linked) and the commands that serve it",
    ),
    "methods": ("rope_ext.cli", arguments.methods, "list the scaling methods and their parameters (--json)"),
    "env": ("rope_ext.cli", arguments.no_arguments, "versions, device, bf16 support and threads, for bug reports"),
    "eval ppl": ("rope_ext.evals.perplexity", arguments.perplexity, "sliding-window perplexity of long documents"),
    "eval passkey": ("rope_ext.evals.passkey", arguments.passkey, "passkey retrieval over lengths x depths"),
    "compare": (
        "rope_ext.evals.compare",
        arguments.compare,
        "methods x lengths on one model: perplexity, passkey and optionally RULER",
    ),
    "search": (
        "rope_ext.search",
        arguments.search,
        "evolutionary search of a position map (longrope factors, dpe scales, string shift, temperature); writes the best as a checkpoint",
    ),
    "dpe-probe": (
        "rope_ext.dpe_probe",
        arguments.dpe_probe,
        "DPE's probe of each dimension group's effective distance: one group's scale moved at a time, needles answered",
    ),
    "convert-chatglm": (
        "rope_ext.patches.chatglm.convert",
        arguments.convert_chatglm,
        "write a remote-code ChatGLM2/3 or GLM-4 checkpoint as a native transformers GLM checkpoint",
    ),
}
# `rope-ext lm-eval ...` is lm-eval's own command line with the rope_ext model type registered;
# `rope-ext finetune ...` is recipes/finetune.py's, for installs without the checkout's recipes/.
LM_EVAL = "lm-eval"
FINETUNE = "finetune"
USAGE, FAILURE = 2, 1
PACKAGES = ("rope-ext", "torch", "transformers", "peft", "accelerate", "lm-eval")


def check(args: argparse.Namespace) -> None:
    """Nothing to check for `methods` and `env`."""


def run(args: argparse.Namespace, plan: None = None) -> int:
    if args.command == "env":
        return env()
    listing = catalog.read()
    print(json.dumps(listing, indent=1) if args.json else catalog.text(listing))
    return 0


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def env() -> int:
    """What a bug report needs: package versions, the device and its bf16 support, threads."""
    import torch

    for package in PACKAGES:
        print(f"{package:13} {version(package)}")
    print(f"{'python':13} {platform.python_version()} ({platform.platform()})")
    print(f"{'threads':13} {torch.get_num_threads()} (torch intra-op)")
    cpu = torch.backends.cpu.get_cpu_capability()
    bf16 = torch.cpu._is_avx512_bf16_supported() if hasattr(torch.cpu, "_is_avx512_bf16_supported") else "unknown"
    amx = torch.cpu._is_amx_tile_supported() if hasattr(torch.cpu, "_is_amx_tile_supported") else "unknown"
    print(f"{'cpu':13} {platform.processor() or platform.machine()}, {cpu}; avx512-bf16: {bf16}, amx: {amx}")
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            print(f"{f'cuda:{index}':13} {torch.cuda.get_device_name(index)}, bf16: {torch.cuda.is_bf16_supported()}")
    else:
        print(f"{'cuda':13} not available")
    return 0


def selected(argv: list[str]) -> str | None:
    """The command `argv` names, or None (no command yet, or an unknown one: argparse says so)."""
    for name in COMMANDS:
        if argv[: len(name.split())] == name.split():
            return name
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command listed; the arguments only of `command`."""
    parser = argparse.ArgumentParser(prog="rope-ext", description="Extend the context window of HuggingFace models.")
    parser.epilog = (
        f"also: rope-ext {LM_EVAL} ... (lm-eval's command line with --model rope_ext); "
        f"rope-ext {FINETUNE} --config ... (the LoRA fine-tune, recipes/finetune.py)"
    )
    parser.add_argument("--version", action="version", version=f"rope-ext {version('rope-ext')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    nested = {}
    for name, (_, add_arguments, help_text) in COMMANDS.items():
        group, _, leaf = name.rpartition(" ")
        if group and group not in nested:
            nested[group] = sub.add_parser(group, help=f"{group} subcommands").add_subparsers(dest="subcommand", required=True)
        parser_of_command = (nested[group] if group else sub).add_parser(leaf, help=help_text, description=help_text)
        if name == command:
            add_arguments(parser_of_command)
    return parser


def command_module(name: str, args: argparse.Namespace) -> str:
    """The module that runs command `name`: `rope-ext patch` of a GGUF file is rope_ext.gguf_patch's."""
    if name == "patch" and args.model.lower().endswith(".gguf"):
        return "rope_ext.gguf_patch"
    return COMMANDS[name][0]


def quiet_libraries() -> None:
    """--no-progress: the progress bars of transformers (weight loading) and the hub (downloads) too."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()


def finetune(argv: list[str]) -> int:
    """One process; `accelerate launch -m rope_ext.recipes.finetune ...` runs it on several."""
    from rope_ext.training.config import ConfigError
    from rope_ext.training.finetune import main as finetune_main

    try:
        finetune_main(argv)
    except ConfigError as err:
        print(f"rope-ext {FINETUNE}: error: {err}", file=sys.stderr)
        return USAGE
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in ([LM_EVAL], [FINETUNE]):
        try:
            extras.require_for_command(argv[0])
        except extras.MissingExtra as err:
            print(f"rope-ext {argv[0]}: error: {err}", file=sys.stderr)
            return USAGE
        if argv[0] == FINETUNE:
            return finetune(argv[1:])
        misspelt = arguments.unknown_method(arguments.lm_eval_method(argv[1:]))
        if misspelt:
            print(f"rope-ext {LM_EVAL}: error: {misspelt}", file=sys.stderr)
            return USAGE
        from rope_ext.evals.lm_eval_model import main as lm_eval_main

        return lm_eval_main(argv[1:])
    args = build_parser(selected(argv)).parse_args(argv)
    name = " ".join(filter(None, (args.command, getattr(args, "subcommand", None))))
    misspelt = arguments.unknown_method(arguments.named_methods(name, args))  # before the command's module loads torch
    if misspelt:
        print(f"rope-ext {name}: error: {misspelt}", file=sys.stderr)
        return USAGE
    try:
        extras.require_for_command(name)
        target = importlib.import_module(command_module(name, args))
        plan = target.check(args)
    except (ValueError, OSError, extras.MissingExtra) as err:
        print(f"rope-ext {name}: error: {err}", file=sys.stderr)
        return USAGE
    if getattr(args, "no_progress", False):
        quiet_libraries()
    try:
        return target.run(args, plan)
    except (ValueError, OSError, extras.MissingExtra) as err:
        print(f"rope-ext {name}: failed: {err}", file=sys.stderr)
        return FAILURE


if __name__ == "__main__":
    sys.exit(main())
