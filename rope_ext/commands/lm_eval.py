"""`rope-ext lm-eval ...`: lm-eval's own command line with the rope_ext model type registered
(rope_ext.evals.lm_eval_model)."""

from __future__ import annotations

import json


def method_names(argv: list[str]) -> list:
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


def main(argv: list[str]) -> int:
    from rope_ext.evals.lm_eval_model import main as lm_eval_main

    return lm_eval_main(argv)
