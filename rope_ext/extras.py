"""The optional parts of rope-ext and the pip extra that installs each (pyproject.toml).

The core install (torch, transformers, peft) is what `patch()`, `from_pretrained` and saving need.
A feature that needs more calls `require` before it does any work, so that a missing package is
named with the extra that installs it rather than surfacing as an ImportError midway.
"""

from __future__ import annotations

import importlib.util

# extra -> the modules (import names) rope-ext imports from the packages it installs
EXTRAS = {
    "plots": ("matplotlib",),
    "gguf": ("gguf",),
    "eval": ("matplotlib", "datasets", "lm_eval", "yaml"),
    "finetune": ("accelerate", "datasets", "matplotlib", "yaml"),
}

# command -> (extra, the modules of it the command imports whatever its arguments)
COMMANDS = {
    "demo": ("plots", ("matplotlib",)),
    "eval ppl": ("eval", ("matplotlib",)),
    "eval passkey": ("eval", ("matplotlib",)),
    "compare": ("eval", ("matplotlib", "yaml")),
    "lm-eval": ("eval", ("lm_eval", "datasets")),
    "search": ("plots", ("matplotlib",)),
    "finetune": ("finetune", EXTRAS["finetune"]),
}


class MissingExtra(ImportError):
    """A feature's package is not installed; the message names the extra that installs it."""


def missing(modules: tuple[str, ...]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require(extra: str, feature: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise MissingExtra unless `modules` (by default all of `extra`'s) are importable."""
    absent = missing(EXTRAS[extra] if modules is None else modules)
    if absent:
        raise MissingExtra(
            f'{feature} needs {", ".join(absent)}, which the "{extra}" extra installs: pip install "rope-ext[{extra}]"'
        )


def require_for_command(command: str) -> None:
    if command in COMMANDS:
        extra, modules = COMMANDS[command]
        require(extra, f"rope-ext {command}", modules)
