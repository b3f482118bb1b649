"""Every method `rope_ext.patch` accepts, by name: the one list of methods. A new method is one
module in this package (a `Method`, rope_ext.method.base) and one line here; what lists methods
elsewhere is generated from this registry (the catalog the command line reads without torch,
rope_ext.catalog; docs/serving.md's table), and the tests that hold those say the command that
writes them anew."""

from __future__ import annotations

from rope_ext.names import unknown_method

from . import alibi_hybrid, dca, dpe, longrope, rerope, rope, self_extend, sink_window, string
from .base import Method

REGISTRY: dict[str, Method] = {
    **{m.name: m for m in rope.METHODS},
    longrope.NAME: longrope.METHOD,
    **{
        m.name: m
        for m in (
            alibi_hybrid.METHOD,
            self_extend.METHOD,
            rerope.METHOD,
            string.METHOD,
            dpe.METHOD,
            dca.METHOD,
            sink_window.METHOD,
        )
    },
}


def get(name: str, params: dict | None = None) -> Method:
    """The method called `name`, bound to `params`; ValueError listing the valid names."""
    try:
        method = REGISTRY[name]
    except (KeyError, TypeError):
        # the CLI's message (with the closest names), which it gives before torch loads
        message = unknown_method(name) or f"unknown method {name!r}; valid methods: {', '.join(REGISTRY)}"
        raise ValueError(message) from None
    return method.bind(params or {})


def check(name: str, factor, params: dict | None = None) -> tuple[Method, float | None, dict]:
    """A method spec checked as every entry point takes one (rope_ext.patch, the eval commands, the
    lm-eval model type, the fine-tune config): (the method bound to `params`, the factor as a float
    or None, the parameters with their defaults filled in). ValueError, one message per fault, on
    an unknown method, a factor missing where the method needs one, a bad factor or parameter."""
    params = params or {}
    method = get(name, params)
    if factor is None and method.factor_required:
        raise ValueError(f"method {name!r} needs a factor (the scale relative to the original window, > 1)")
    params = method.validate(factor, params)
    return method, None if factor is None else float(factor), params
