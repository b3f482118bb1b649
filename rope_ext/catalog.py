"""The registry's listing (`rope_ext.methods()`: name, summary, formula, parameters with their
defaults, static or dynamic) as data shipped beside it, catalog.json, so that `rope-ext methods`
and the method names the command line checks (rope_ext.names) answer without importing torch.

The file is generated from the registry (rope_ext.method), never written by hand: `stale` says
when it is not the registry's listing, with the command that writes it anew (REGENERATE);
tests/contract/test_new_method.py fails with that message."""

from __future__ import annotations

import json
from importlib import resources

from rope_ext import names

REGENERATE = "python -m rope_ext.catalog"


def path():
    return resources.files(__package__).joinpath(names.CATALOG)


def read() -> dict[str, dict]:
    """The shipped listing, read without torch."""
    return names.catalog()


def rendered(listing: dict[str, dict]) -> str:
    """`listing` (the registry's, rope_ext.methods()) as catalog.json holds it."""
    return json.dumps(listing, indent=1) + "\n"


def stale(listing: dict[str, dict]) -> str | None:
    """Why the shipped file is not `listing` (the registry's), with the command that writes it anew;
    None when it is."""
    if path().read_text(encoding="utf-8") == rendered(listing):
        return None
    return f"rope_ext/{names.CATALOG} is not the registry's listing (a method was added or changed): run `{REGENERATE}`"


def text(listing: dict[str, dict]) -> str:
    """The listing as the lines `rope-ext methods` prints."""
    lines = []
    for name, spec in listing.items():
        params = ", ".join(f"{k}={v}" for k, v in spec["params"].items())
        kind = "dynamic" if spec["dynamic"] else "static"
        lines.append(f"{name:13} {kind:8} {spec['summary']}\n{'':23}{spec['formula']}\n{'':23}params: {params}")
    return "\n".join(lines)


if __name__ == "__main__":
    from rope_ext.patching import listing  # the registry, with torch: only to write the file

    path().write_text(rendered(listing()), encoding="utf-8")
    print(f"wrote {path()}")
