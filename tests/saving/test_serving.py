"""docs/serving.md: what a saved checkpoint's config.json means to the engines that serve it.

The serving engines' reading rules are restated in rope_ext/serving.py as small pure functions, one
per engine version read, from the released wheels' source: vLLM 0.34.0 (the same in 0.30.0 and
0.33.0 for these rules), vLLM 0.29.0 (the same in 0.27.0 and 0.28.0) and SGLang 0.5.23. For every method the table
lists, a patch is saved as config.json and each engine's frequencies, attention factor, accepted
length and table size are compared with rope-ext's own: the table's cell is "yes" exactly when
they agree in the first and last row of a forward of the trained window, of one past it and of
the length the patch is meant for. No engine version read refuses a rope type rope-ext writes.
A written config states the length the patch is meant for; only vLLM's and SGLang's factor rule for
`linear` and `proportional` accepts more.
Transformers' chunked prefill gives the tokens rope_ext.chunked_generate gives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import linear_glm, random_model, required_params

import rope_ext
from rope_ext.geometry import RotaryGeometry
from rope_ext.method import REGISTRY
from rope_ext.patching import installed_patch, installed_rotary
from rope_ext.serving import COLUMNS, ENGINES, pair_frequencies, read, serves_as_patched

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


ROW = re.compile(r"^\| `(\w+)`((?: `\w+=[^`]+`)*) \| (`\w+`|-) \|" + r" ([a-z ]+) \|" * len(COLUMNS) + "$", re.MULTILINE)


def table() -> list[tuple[str, dict, str, dict]]:
    """(method, parameters, rope_type written, {column: cell}) for each row of the doc's table."""
    header = re.search(r"^\| method \| `rope_type` written \| (.+) \|$", DOC.read_text(), flags=re.MULTILINE)
    assert header and tuple(header.group(1).split(" | ")) == COLUMNS
    rows = []
    for name, params, rope_type, *cells in ROW.findall(DOC.read_text()):
        values = {k: {"True": True, "False": False}.get(v, v) for k, v in re.findall(r"`(\w+)=([^`]+)`", params)}
        values = {k: v if isinstance(v, bool) else float(v) for k, v in values.items()}
        rows.append((name, values, rope_type.strip("`"), dict(zip(COLUMNS, cells))))
    return rows


def required(name: str, model) -> dict:
    """`name`'s required parameters for `model`, its rotated pairs read from its config."""
    pairs = read(json.loads(model.config.to_json_string()))[3] // 2
    return required_params(name, pairs)


def native(name: str, **params) -> dict | None:
    params = {**required_params(name, 32), **params}
    method = REGISTRY[name].bind(params)
    geometry = RotaryGeometry(rotary_dim=64, base=10000.0, original_window=8192)
    return method.native(geometry, 4.0, method.validate(4.0, params), {})


def test_the_table_follows_the_registry():
    rows = table()
    assert [name for name, params, *_ in rows if not params] == list(rope_ext.methods())
    listed = rope_ext.methods()
    for name, params, rope_type, _ in rows:
        form = native(name, **params)
        assert rope_type == ("-" if form is None else form["rope_type"]), name
        if not params:  # `rope-ext methods --json` states the same type
            assert listed[name]["native_type"] == (None if form is None else form["rope_type"]), name
    assert native("dynamic", causal=False)["rope_type"] == "dynamic"  # a row of its own in the table


SERVED_WINDOW, SERVED_BASE = 4096, 500000.0


def served_model():
    """A LLaMA with a 4096-token window and 128-dim heads, so that the YaRN and Llama 3 bands fall
    inside the rotated pairs."""
    return random_model(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=SERVED_WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": SERVED_BASE},
    )


# The rows with a parameter named, each after its method's row at the defaults
NAMED_ROWS = [("dynamic", {"causal": False}), ("yarn", {"attention_factor": 1.25}), ("longrope", {"causal": False})]
# What rewrites the table from the registry (rendered_table) into docs/serving.md
REGENERATE = "cd tests && PYTHONPATH=. ../.venv/bin/python saving/test_serving.py"


def served(name: str, params: dict):
    """`name` with `params` patched at factor 4 on served_model(): (the model, the patch, the
    config.json it writes, {column: what that reader serves of it})."""
    model = served_model()
    info = rope_ext.patch(model, name, factor=4, **required(name, model), **params)
    config = json.loads(model.config.to_json_string())
    # transformers reads the written form exactly (tests/saving/test_saving.py) but sets the frequencies
    # of `dynamic` and `longrope` once per forward, from its length (`dynamic_rope_update`,
    # modeling_rope_utils.py): a causal schedule, whose rows of one forward differ, is not its
    causal = model.model.rotary_emb.method.follows_length and info.params.get("causal", True)
    cells = {"transformers 5": "unpatched" if info.native is None else "not as patched" if causal else "yes"}
    for engine, reading in ENGINES.items():
        as_patched = info.native is not None and serves_as_patched(
            reading(config), installed_patch(model), installed_rotary(model)
        )
        cells[engine] = "unpatched" if info.native is None else "yes" if as_patched else "not as patched"
    return model, info, config, cells


def rendered_table() -> str:
    """The table of docs/serving.md, one row per registered method at its defaults (and NAMED_ROWS),
    each cell what `served` finds."""
    lines = [f"| method | `rope_type` written | {' | '.join(COLUMNS)} |", "|---" * (2 + len(COLUMNS)) + "|"]
    for name in rope_ext.methods():
        for params in [{}, *(named for method, named in NAMED_ROWS if method == name)]:
            _, info, _, cells = served(name, params)
            method = " ".join([f"`{name}`", *(f"`{k}={v}`" for k, v in params.items())])
            written = "-" if info.native is None else f"`{info.native['rope_type']}`"
            lines.append(f"| {method} | {written} | {' | '.join(cells[column] for column in COLUMNS)} |")
    return "\n".join(lines)


def committed_table(doc: str) -> str:
    lines = doc.splitlines()
    start = lines.index(f"| method | `rope_type` written | {' | '.join(COLUMNS)} |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return "\n".join(lines[start:end])


def test_the_committed_table_is_the_registry_s_rendering():
    """The table's rows are the registry's methods (a new method gets its row) and each cell is what
    that reader serves: the committed table is what rendered_table() writes."""
    assert committed_table(DOC.read_text()) == rendered_table(), (
        f"docs/serving.md's table is not the rendering: run `{REGENERATE}`"
    )


@pytest.mark.parametrize("row", table(), ids=lambda row: row[0] + "".join(f"-{k}={v}" for k, v in row[1].items()))
def test_each_engine_serves_what_the_table_says(row):
    name, params, _, cells = row
    model, info, config, found = served(name, params)
    assert cells["transformers 5"] == found["transformers 5"]
    for engine, reading in ENGINES.items():
        served_form = reading(config)
        if info.native is None:
            assert (served_form.max_length, served_form.attention) == (SERVED_WINDOW, 1.0), engine
            assert torch.equal(served_form.inv_freq, pair_frequencies(SERVED_BASE, info.rotary_dim)), engine
            assert cells[engine] == "unpatched", engine
        else:
            as_patched = serves_as_patched(served_form, installed_patch(model), installed_rotary(model))
            assert cells[engine] == ("yes" if as_patched else "not as patched"), engine


CHECKPOINTS = {
    "llama": served_model,
    "llama already yarn-scaled": lambda: random_model(
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e4},
    ),
    "mixtral without head_dim": lambda: random_model("mixtral", head_dim=None),
    "glm with a linear checkpoint scaling": linear_glm,
}


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("method,params", [(name, {}) for name in rope_ext.methods()] + [("dynamic", {"causal": False})])
def test_the_written_length_is_the_patch_s_and_only_a_linear_factor_takes_engines_past_it(checkpoint, method, params):
    """A patch with a native form states max_position_embeddings = its max_length (transformers'
    `dynamic` excepted, which reads the field as its window), which transformers and lm-eval read as
    the longest input; the engines accept at most that, except that vLLM and SGLang multiply it by
    the factor of `linear` and `proportional`. One without a native form leaves the checkpoint's own
    config, which engines serve as the unpatched checkpoint."""
    model = CHECKPOINTS[checkpoint]()
    before = json.loads(model.config.to_json_string())
    if method == "proportional" and checkpoint == "glm with a linear checkpoint scaling":
        # GLM rotates half of each head; the patch is refused and writes nothing
        with pytest.raises(ValueError, match="needs a fully rotated head"):
            rope_ext.patch(model, method, factor=3)
        assert json.loads(model.config.to_json_string()) == before
        return
    info = rope_ext.patch(model, method, factor=3, **required(method, model), **params)
    config = json.loads(model.config.to_json_string())
    if info.native is None:
        for key in ("rope_parameters", "max_position_embeddings", "head_dim"):
            assert config.get(key) == before.get(key), key
        return
    rope = config["rope_parameters"]
    kind = rope.get("rope_type")
    assert config["max_position_embeddings"] == (info.max_length if kind != "dynamic" else info.max_length // rope["factor"])
    multiplied = rope["factor"] if kind in ("linear", "proportional") else 1
    for engine, reading in ENGINES.items():
        served = reading(config)
        assert served.max_length <= info.max_length * multiplied, (engine, rope, config["max_position_embeddings"])


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


if __name__ == "__main__":  # REGENERATE: the table rewritten from the registry
    text = DOC.read_text()
    DOC.write_text(text.replace(committed_table(text), rendered_table()))
    print(f"wrote the table of {DOC}")
