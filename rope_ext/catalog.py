"""The registry's listing (`rope_ext.methods()`: name, summary, formula, parameters with their
defaults, static or dynamic) as data shipped beside it, catalog.json, so that `rope-ext methods`
answers without importing torch. tests/cli/test_cli.py checks that the file is the registry's listing;
after a change to a method, `python -m rope_ext.catalog` writes it anew."""

from __future__ import annotations

import json
from importlib import resources

FILE = "catalog.json"


def read() -> dict[str, dict]:
    """The shipped listing, read without torch."""
    return json.loads(resources.files(__package__).joinpath(FILE).read_text(encoding="utf-8"))


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

    path = resources.files(__package__).joinpath(FILE)
    path.write_text(json.dumps(listing(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
