"""`rope-ext finetune ...`: recipes/finetune.py's command line, for installs without the checkout's
recipes/; `accelerate launch -m rope_ext.recipes.finetune ...` runs it on several processes."""

from __future__ import annotations

import sys

from rope_ext.commands import USAGE


def main(argv: list[str]) -> int:
    """One process."""
    from rope_ext.training.config import ConfigError
    from rope_ext.training.finetune import main as finetune_main

    try:
        finetune_main(argv)
    except ConfigError as err:
        print(f"rope-ext finetune: error: {err}", file=sys.stderr)
        return USAGE
    return 0
