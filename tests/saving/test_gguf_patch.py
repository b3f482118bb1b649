"""`rope-ext patch MODEL.gguf OUT.gguf`: the metadata llama.cpp reads gives the patch's frequencies
and attention factor (rope_ext.export.gguf_rope, restated from llama.cpp's source; tests/saving/
test_gguf_llama_cpp.py runs llama.cpp itself), every other tensor is copied byte for byte, and what
llama.cpp cannot run is refused with nothing written."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

import rope_ext
from rope_ext import cli
from rope_ext.export import gguf_rope
from rope_ext.method.rope import ntk_base
from rope_ext.patching import installed_rotary

from gguf_files import write_llama_gguf
from helpers import WINDOW, cli_error_line, random_model

HEAD = 16  # the random llama's head size (hidden 64, 4 heads)
LONG = [1.0 + i / 4 for i in range(HEAD // 2)]


def fields_of(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def tensors_of(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def llama_cpp_reads(path) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) llama.cpp computes from the file at `path`."""
    tensors = tensors_of(path)
    freqs = np.array(tensors["rope_freqs.weight"].data) if "rope_freqs.weight" in tensors else None
    return gguf_rope.read(fields_of(path), "llama", freqs, HEAD).computed()


@pytest.fixture
def source(tmp_path):
    return write_llama_gguf(random_model(), tmp_path / "model.gguf")


def patch(source, out, method, *options) -> int:
    return cli.main(["patch", str(source), str(out), "--method", method, *options])


STATIC = {
    "linear": [],
    "ntk": [],
    "yarn": [],
    "yarn beta_fast=16": ["--param", "beta_fast=16"],
    "yarn attention_factor=1.2": ["--param", "attention_factor=1.2"],
    "ntk_by_parts": [],
    "llama3": [],
    "ntk_alpha": ["--param", "alpha=3"],
    "longrope short=long": [
        "--param",
        f"long_factor={LONG}".replace(" ", ""),
        "--param",
        f"short_factor={LONG}".replace(" ", ""),
    ],
}


@pytest.mark.parametrize("case", STATIC)
def test_llama_cpp_reads_the_patch_rope_ext_installs(case, source, tmp_path):
    method, params = case.split()[0], STATIC[case]
    out = tmp_path / "out.gguf"
    assert patch(source, out, method, "--factor", "4", *params) == 0
    inv_freq, attention = llama_cpp_reads(out)

    kwargs = {k: rope_ext.loading.parse_value(v) for k, _, v in (p.partition("=") for p in params[1::2])}
    model = random_model()
    info = rope_ext.patch(model, method, factor=4, original_window=WINDOW, **kwargs)
    expected, scale = installed_rotary(model).frequencies(info.max_length)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert math.isclose(attention, scale, rel_tol=1e-6)
    assert fields_of(out)["llama.context_length"] == 4 * WINDOW


def test_llama_cpp_types_where_they_express_the_patch(source, tmp_path):
    """ntk as a new freq_base, linear and yarn as llama.cpp's own types, no rope_freqs tensor; a
    ramp llama.cpp does not compute (beta_fast 16) and llama3 as rope_freqs."""
    expected = {
        "ntk": {"llama.rope.scaling.type": "none", "llama.rope.freq_base": pytest.approx(ntk_base_of(4), rel=1e-7)},
        "linear": {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
        "yarn": {
            "llama.rope.scaling.type": "yarn",
            "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": WINDOW,
            "llama.rope.scaling.attn_factor": 1.0,
        },
    }
    for method, keys in expected.items():
        out = tmp_path / f"{method}.gguf"
        assert patch(source, out, method, "--factor", "4") == 0
        fields = fields_of(out)
        assert {k: fields[k] for k in keys} == keys
        assert "rope_freqs.weight" not in tensors_of(out)
    for method, params in (("yarn", ["--param", "beta_fast=16"]), ("llama3", [])):
        out = tmp_path / f"{method}-freqs.gguf"
        assert patch(source, out, method, "--factor", "4", *params) == 0
        assert fields_of(out)["llama.rope.scaling.type"] == "none"
        assert tensors_of(out)["rope_freqs.weight"].data.shape == (HEAD // 2,)


def ntk_base_of(factor: float) -> float:
    model = random_model()
    info = rope_ext.patch(model, "ntk", factor=factor, original_window=WINDOW)
    assert info.native["rope_theta"] == ntk_base(info.patch.geometry, factor)
    return np.float32(info.native["rope_theta"]).item()


@pytest.mark.parametrize("method", ["yarn", "llama3"])
def test_every_other_tensor_and_key_is_copied(method, source, tmp_path):
    out = tmp_path / "out.gguf"
    assert patch(source, out, method, "--factor", "4") == 0
    before, after = tensors_of(source), tensors_of(out)
    assert set(after) - set(before) == ({"rope_freqs.weight"} if method == "llama3" else set())
    for name, tensor in before.items():
        assert after[name].tensor_type == tensor.tensor_type
        assert after[name].data.tobytes() == tensor.data.tobytes(), name
    rope_keys = {f"llama.{key}" for key in gguf_rope.WRITTEN}
    kept_before = {k: v for k, v in fields_of(source).items() if k not in rope_keys}
    kept_after = {k: v for k, v in fields_of(out).items() if k not in rope_keys}
    assert kept_after == kept_before


def test_a_shipped_yarn_is_extended_as_rope_ext_extends_it(tmp_path):
    """A file that ships yarn x2 over 32 tokens, patched yarn x2 more: what llama.cpp reads is the
    patch rope-ext installs on the transformers model of that file."""
    shipped = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": WINDOW // 2}
    model = random_model(rope_parameters=shipped)
    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": 2.0, "rope.scaling.original_context_length": WINDOW // 2}
    source = write_llama_gguf(model, tmp_path / "model.gguf", rope=keys)
    out = tmp_path / "out.gguf"
    assert patch(source, out, "yarn", "--factor", "2") == 0
    info = rope_ext.patch(model, "yarn", factor=2)
    expected, scale = installed_rotary(model).frequencies(info.max_length)
    inv_freq, attention = llama_cpp_reads(out)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert math.isclose(attention, scale, rel_tol=1e-6)


def test_a_shipped_rope_freqs_is_replaced_over_a_stated_window(tmp_path, capsys):
    """rope_freqs (how llama.cpp serves Llama 3.1's llama3) is transformers' longrope with one set:
    rope-ext extends it only over a window the user states, as it does a shipped longrope."""
    model = random_model()
    freqs = np.linspace(1, 4, HEAD // 2, dtype=np.float32)
    source = write_llama_gguf(model, tmp_path / "model.gguf", rope_freqs=freqs)
    out = tmp_path / "out.gguf"
    line = cli_error_line(["patch", str(source), str(out), "--method", "yarn", "--factor", "4"], capsys)
    assert "longrope" in line and not out.exists()
    assert patch(source, out, "yarn", "--factor", "4", "--original-window", str(WINDOW)) == 0
    info = rope_ext.patch(model, "yarn", factor=4, original_window=WINDOW)
    torch.testing.assert_close(
        llama_cpp_reads(out)[0], installed_rotary(model).frequencies(info.max_length)[0], rtol=1e-6, atol=0
    )


REFUSED = {
    "self_extend": (["--factor", "4"], "changes attention itself"),
    "dca": (["--factor", "4"], "changes attention itself"),
    "dynamic": (["--factor", "4"], "follow the length"),
    "dynamic_yarn": (["--factor", "4"], "follow the length"),
    "longrope": (["--factor", "4", "--param", f"long_factor={LONG}".replace(" ", "")], "short_factor equal to long_factor"),
    "proportional": (["--factor", "4"], "infinite rope_freqs"),
}


@pytest.mark.parametrize("method", REFUSED)
def test_what_llama_cpp_cannot_run_is_refused_and_nothing_written(method, source, tmp_path, capsys):
    options, reason = REFUSED[method]
    out = tmp_path / "out.gguf"
    line = cli_error_line(["patch", str(source), str(out), "--method", method, *options], capsys)
    assert line.startswith("rope-ext patch: error:") and reason in line
    assert list(tmp_path.iterdir()) == [source]


def test_bad_files_are_usage_errors(source, tmp_path, capsys):
    exists = tmp_path / "exists.gguf"
    exists.write_bytes(b"mine")
    assert "exists" in cli_error_line(["patch", str(source), str(exists), "--method", "yarn", "--factor", "4"], capsys)
    assert exists.read_bytes() == b"mine"
    folder = tmp_path / "folder"
    assert ".gguf" in cli_error_line(["patch", str(source), str(folder), "--method", "yarn", "--factor", "4"], capsys)
    missing = tmp_path / "missing.gguf"
    assert "no GGUF file" in cli_error_line(
        ["patch", str(missing), str(tmp_path / "o.gguf"), "--method", "yarn", "--factor", "4"], capsys
    )

    text = tmp_path / "text.gguf"
    text.write_text("not a model")
    assert "not a GGUF file" in cli_error_line(
        ["patch", str(text), str(tmp_path / "o.gguf"), "--method", "yarn", "--factor", "4"], capsys
    )

    other = tmp_path / "qwen2.gguf"
    writer = gguf.GGUFWriter(other, "qwen2")
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = cli_error_line(["patch", str(other), str(tmp_path / "o.gguf"), "--method", "yarn", "--factor", "4"], capsys)
    assert "'qwen2' model" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.gguf", "model.gguf", "qwen2.gguf", "text.gguf"]
