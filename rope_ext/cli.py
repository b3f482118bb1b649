"""The `rope-ext` command: routes to the command named on its line (rope_ext.commands, one module
each: its parser, and the module that checks and runs it once the arguments are parsed). Every
command's module imports no more than the standard library and torch-free modules, so every
`--help` answers at once."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from rope_ext import extras, names
from rope_ext.commands import (
    FAILURE,
    USAGE,
    compare,
    convert_chatglm,
    demo,
    dpe_probe,
    env,
    finetune,
    lm_eval,
    methods,
    passkey,
    patch,
    perplexity,
    search,
)
from rope_ext.loading import PLAIN

# name -> its module; "eval X" commands are nested under `eval`
COMMANDS: dict[str, ModuleType] = {
    "demo": demo,
    "patch": patch,
    "methods": methods,
    "env": env,
    "eval ppl": perplexity,
    "eval passkey": passkey,
    "compare": compare,
    "search": search,
    "dpe-probe": dpe_probe,
    "convert-chatglm": convert_chatglm,
}
# `rope-ext lm-eval ...` is lm-eval's own command line with the rope_ext model type registered;
# `rope-ext finetune ...` is recipes/finetune.py's, for installs without the checkout's recipes/.
LM_EVAL = "lm-eval"
FINETUNE = "finetune"


def unknown_method(methods: list) -> str | None:
    """The error for the first of `methods` that is neither plain nor a registered method, with the
    registered names closest to it (or why it was removed); None when every one is known."""
    for name in methods:
        if name != PLAIN and (error := names.unknown_method(name)) is not None:
            return error
    return None


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
    parser.add_argument("--version", action="version", version=f"rope-ext {env.version('rope-ext')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    nested = {}
    for name, module in COMMANDS.items():
        group, _, leaf = name.rpartition(" ")
        if group and group not in nested:
            nested[group] = sub.add_parser(group, help=f"{group} subcommands").add_subparsers(dest="subcommand", required=True)
        parser_of_command = (nested[group] if group else sub).add_parser(leaf, help=module.HELP, description=module.HELP)
        if name == command:
            module.add_arguments(parser_of_command)
    return parser


def parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """(the command's name, its parsed arguments); argparse exits 2 on a usage error."""
    args = build_parser(selected(argv)).parse_args(argv)
    return " ".join(filter(None, (args.command, getattr(args, "subcommand", None)))), args


def runner(name: str, args: argparse.Namespace) -> ModuleType:
    """The module whose check and run run command `name` with `args`."""
    command = COMMANDS[name]
    return importlib.import_module(command.runs(args) if hasattr(command, "runs") else command.RUNS)


def call(argv: list[str]) -> int:
    """The command `argv` names, checked and run with its errors raised rather than reported as exit
    codes: what a caller in Python wants."""
    name, args = parse(argv)
    target = runner(name, args)
    return target.run(args, target.check(args))


def quiet_libraries() -> None:
    """--no-progress: the progress bars of transformers (weight loading) and the hub (downloads) too."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in ([LM_EVAL], [FINETUNE]):
        try:
            extras.require_for_command(argv[0])
        except extras.MissingExtra as err:
            print(f"rope-ext {argv[0]}: error: {err}", file=sys.stderr)
            return USAGE
        if argv[0] == FINETUNE:
            return finetune.main(argv[1:])
        misspelt = unknown_method(lm_eval.method_names(argv[1:]))
        if misspelt:
            print(f"rope-ext {LM_EVAL}: error: {misspelt}", file=sys.stderr)
            return USAGE
        return lm_eval.main(argv[1:])
    name, args = parse(argv)
    command = COMMANDS[name]
    given = command.method_names(args) if hasattr(command, "method_names") else []
    misspelt = unknown_method(given)  # before the command's module loads torch
    if misspelt:
        print(f"rope-ext {name}: error: {misspelt}", file=sys.stderr)
        return USAGE
    try:
        extras.require_for_command(name)
        target = runner(name, args)
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
