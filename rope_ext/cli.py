"""The `rope-ext` command. Each subcommand lives in its own module with `add_arguments(parser)`
and `run(args) -> exit code`; this file only routes."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("rope_ext.demo", "SmolLM2 past its window: plain vs patched perplexity (offline)"),
    "methods": ("rope_ext.cli", "list the scaling methods and their parameters"),
    "convert-chatglm": ("rope_ext.convert_chatglm", "write a remote-code ChatGLM2/3 or GLM-4 checkpoint as a native transformers GLM checkpoint"),
}


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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        target = importlib.import_module(module)
        target.add_arguments(command)
        command.set_defaults(run=target.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"rope-ext {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
