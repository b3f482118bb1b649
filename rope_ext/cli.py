"""The `rope-ext` command. Each subcommand lives in its own module with `add_arguments(parser)`
and `run(args) -> exit code`; this file only routes."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help); "eval X" commands are nested under `eval`
COMMANDS = {
    "demo": ("rope_ext.demo", "SmolLM2 past its window: plain vs patched perplexity (offline)"),
    "methods": ("rope_ext.cli", "list the scaling methods and their parameters"),
    "eval ppl": ("rope_ext.evals.perplexity", "sliding-window perplexity of long documents"),
    "eval passkey": ("rope_ext.evals.passkey", "passkey retrieval over lengths x depths"),
    "compare": ("rope_ext.evals.compare", "methods x lengths on one model: perplexity and passkey"),
    "convert-chatglm": ("rope_ext.patches.chatglm.convert", "write a remote-code ChatGLM2/3 or GLM-4 checkpoint as a native transformers GLM checkpoint"),
}
# `rope-ext lm-eval ...` is lm-eval's own command line with the rope_ext model type registered.
LM_EVAL = "lm-eval"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`rope-ext methods` takes no arguments."""


def run(args: argparse.Namespace) -> int:
    import rope_ext

    for name, spec in rope_ext.methods().items():
        params = ", ".join(f"{k}={v}" for k, v in spec["params"].items())
        kind = "dynamic" if spec["dynamic"] else "static"
        print(f"{name:13} {kind:8} {spec['summary']}\n{'':23}{spec['formula']}\n{'':23}params: {params}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rope-ext", description="Extend the context window of HuggingFace models.")
    parser.epilog = f"also: rope-ext {LM_EVAL} ... (lm-eval's command line with --model rope_ext)"
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    nested = {}
    for name, (module, help_text) in COMMANDS.items():
        group, _, leaf = name.rpartition(" ")
        if group and group not in nested:
            nested[group] = sub.add_parser(group, help=f"{group} subcommands").add_subparsers(dest="subcommand", required=True)
        command = (nested[group] if group else sub).add_parser(leaf, help=help_text, description=help_text)
        target = importlib.import_module(module)
        target.add_arguments(command)
        command.set_defaults(run=target.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [LM_EVAL]:
        from rope_ext.evals.lm_eval_model import main as lm_eval_main

        return lm_eval_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"rope-ext {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
