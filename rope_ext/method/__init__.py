"""Every method `rope_ext.patch` accepts, by name. A new method is one module in this package
(a `Method`, rope_ext.method.base) and one line here."""

from __future__ import annotations

from . import alibi_hybrid, dca, rerope, rope, self_extend, sink_window, string
from .base import Method

REGISTRY: dict[str, Method] = {
    **{m.name: m for m in rope.METHODS},
    **{m.name: m for m in (alibi_hybrid.METHOD, self_extend.METHOD, rerope.METHOD, string.METHOD, dca.METHOD, sink_window.METHOD)},
}


def get(name: str, params: dict | None = None) -> Method:
    """The method called `name`, bound to `params`; ValueError listing the valid names."""
    try:
        method = REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(REGISTRY)}") from None
    return method.bind(params or {})
