"""docs/serving.md: its table of what a saved checkpoint means to a serving engine follows the
registry (a method serves from config.json alone exactly when it has a native transformers form),
and transformers' chunked prefill gives the tokens rope_ext.chunked_generate gives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import rope_ext
from rope_ext.geometry import RotaryGeometry
from rope_ext.method import REGISTRY

DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


# the parameters a method requires, beside its defaults
REQUIRED = {"ntk_alpha": {"alpha": 8.0}, "longrope": {"long_factor": [2.0] * 32, "short_factor": [1.0] * 32}}


def native(name: str, **params) -> dict | None:
    params = {**REQUIRED.get(name, {}), **params}
    method = REGISTRY[name].bind(params)
    geometry = RotaryGeometry(rotary_dim=64, base=10000.0, original_window=8192)
    return method.native(geometry, 4.0, method.validate(4.0, params), {})


def table() -> dict[str, tuple[str, str]]:
    """{method: (serves as-is, rope_type)} from the doc's table."""
    rows = re.findall(r"^\| `(\w+)` \| (yes|no) \| (`\w+`|-) \|", DOC.read_text(), flags=re.M)
    return {name: (served, rope_type.strip("`")) for name, served, rope_type in rows}


def test_the_table_follows_the_registry():
    rows = table()
    assert list(rows) == list(rope_ext.methods())
    for name, (served, rope_type) in rows.items():
        form = native(name)
        assert served == ("no" if form is None else "yes"), name
        assert rope_type == ("-" if form is None else form["rope_type"]), name
    assert native("dynamic", causal=False)["rope_type"] == "dynamic"  # the doc's note under the table


def test_a_saved_checkpoint_states_the_native_form(tiny_model, tmp_path):
    rope_ext.patch(tiny_model, "yarn", factor=2)
    tiny_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 256


@pytest.mark.parametrize("method", ["yarn", "ntk"])
def test_transformers_chunked_prefill_matches_chunked_generate(tiny_model, heldout_ids, method):
    rope_ext.patch(tiny_model, method, factor=2)
    prompt = heldout_ids[:200].unsqueeze(0)
    options = {"max_new_tokens": 8, "do_sample": False}
    ours = rope_ext.chunked_generate(tiny_model, prompt, 64, **options)
    theirs = tiny_model.generate(prompt, prefill_chunk_size=64, **options)
    assert torch.equal(ours, theirs)
    assert torch.equal(theirs, tiny_model.generate(prompt, **options))
