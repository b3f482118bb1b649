"""The names of the methods rope-ext registers and of those it retired, and the answer to a name
that is neither. Standard library only, and below everything that names a method: the registry
(rope_ext.method) answers an unknown name with it, and the command line (rope_ext.cli)
answers a misspelt one before torch, transformers or lm-eval load."""

from __future__ import annotations

import difflib

# The names rope_ext.method registers, in its order (tests/cli/test_cli.py holds the two equal).
METHOD_NAMES = (
    "linear",
    "ntk",
    "dynamic",
    "yarn",
    "dynamic_yarn",
    "ntk_by_parts",
    "ntk_alpha",
    "proportional",
    "llama3",
    "longrope",
    "alibi_hybrid",
    "self_extend",
    "rerope",
    "string",
    "dpe",
    "dca",
    "sink_window",
)


# Methods rope-ext no longer has, with what to use instead (records and command lines that name them)
RETIRED = {
    "yarn_dca": (
        "yarn_dca (DCA over YaRN's frequencies) was removed: no released checkpoint or engine runs DCA over YaRN's "
        "frequencies (Qwen2.5-1M states rope_scaling null; vLLM's and SGLang's DCA keep the trained frequencies and "
        "add a length temperature), and dca now computes that temperature: use dca (docs/dca.md)"
    )
}


def unknown_method(name) -> str | None:
    """The error for `name` when it is no registered method, with the registered names closest to
    it (or why it was removed); None when it is one."""
    if isinstance(name, str) and name in METHOD_NAMES:
        return None
    if isinstance(name, str) and name in RETIRED:
        return RETIRED[name]
    close = difflib.get_close_matches(str(name), METHOD_NAMES, n=2)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    return f"unknown method {name!r}{hint}; valid methods: {', '.join(METHOD_NAMES)}"
