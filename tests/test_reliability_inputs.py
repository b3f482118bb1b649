"""What a user passes is checked before any work: method specs, numbers, data sources and output
paths; a bad one is one clear line (issue #15: late validation, inputs read as data, pickle,
numbers)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from helpers import logits, random_model
from test_chatglm import write_checkpoint

import rope_ext
from rope_ext import cli
from rope_ext.evals import data as data_mod
from rope_ext.evals import loading
from rope_ext.training import data as training_data
from rope_ext.training.config import ConfigError


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the command must have refused before."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr("rope_ext.defaults.load_smollm2", refuse)


def refused(argv, capsys) -> str:
    """The one error line of a command that must exit 2 (a usage error)."""
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# Late validation: every spec and argument is checked before a model loads.

def test_compare_rejects_a_bad_spec_before_computing_the_good_ones(no_model, tmp_path, capsys):
    line = refused(["compare", "--methods", "plain", "ntk", "yarn:beta_fast=x", "--output", str(tmp_path / "c")], capsys)
    assert "beta_fast" in line and "'x'" in line and "number" in line
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("argv, words", [
    (["--factor", "1"], "factor"),
    (["--methods", "plain,nope"], "unknown method 'nope'"),
    (["--length", "1"], "--length"),
])
def test_demo_checks_everything_before_the_plain_row(no_model, tmp_path, capsys, argv, words):
    assert words in refused(["demo", *argv, "--output", str(tmp_path / "d")], capsys)


@pytest.mark.parametrize("argv, words", [
    (["--method", "yarn", "--factor", "4", "--param", "beta_fast=x"], "beta_fast"),
    (["--method", "yarn", "--factor", "4", "--original-window", "0"], "--original-window"),
    (["--bucket", "0"], "--bucket"),
    (["--data", "missing.txt"], "no such file"),
    (["--min-tokens", "-1"], "--min-tokens"),
])
def test_ppl_checks_everything_before_the_model_loads(no_model, tmp_path, capsys, argv, words, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert words in refused(["eval", "ppl", "--lengths", "64", *argv, "--output", str(tmp_path / "p")], capsys)


@pytest.mark.parametrize("argv, words", [
    (["--depths", "1.5"], "--depths"),
    (["--trials", "0"], "--trials"),
    (["--method", "dynamic", "--factor", "2", "--param", "granularity=0"], "granularity"),
    (["--resume"], "passkey.partial.json does not exist"),
])
def test_passkey_checks_everything_before_the_model_loads(no_model, tmp_path, capsys, argv, words):
    assert words in refused(["eval", "passkey", *argv, "--output", str(tmp_path / "k")], capsys)


def test_an_existing_result_is_found_before_the_model_loads(no_model, tmp_path, capsys):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "ppl.json").write_text("{}")
    assert "--overwrite" in refused(["eval", "ppl", "--lengths", "64", "--output", str(tmp_path / "p")], capsys)


# Inputs read as data.

def test_a_binary_file_is_not_text(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)))
    with pytest.raises(ValueError, match=r"weights.bin is a binary file, not text"):
        data_mod.iter_texts(str(path))
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("fine text")
    (folder / "b.txt").write_bytes(b"\x00\x01binary")
    with pytest.raises(ValueError, match=r"b.txt is a binary file"):
        data_mod.iter_texts(str(folder))


def test_ppl_refuses_a_binary_data_file_before_the_model_loads(no_model, tmp_path, capsys):
    path = tmp_path / "model.txt"
    path.write_bytes(b"\x00" * 64)
    assert "binary" in refused(["eval", "ppl", "--lengths", "64", "--data", str(path), "--output", str(tmp_path / "p")], capsys)


def test_the_finetune_recipe_refuses_a_binary_source(tmp_path, tiny_tokenizer):
    path = tmp_path / "data.md"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    spec = {"source": str(path), "split": "train", "text_field": "text", "exclude": []}
    with pytest.raises(ConfigError, match="binary"):
        training_data.load_documents(spec, "exclude", tiny_tokenizer)


@pytest.mark.parametrize("lines, match", [
    (['{"text": "a"}', "", '{"text": "b"', '{"text": "c"}'], r"docs.jsonl:3: not valid JSON"),
    (['{"text": 12345}'], r"docs.jsonl:1: field 'text' must be a string, got int 12345"),
    (['{"text": "a"}', '["text"]'], r"docs.jsonl:2: expected a JSON object with a 'text' field, got list"),
    (['{"body": "a"}'], r"docs.jsonl:1: no field 'text' \(fields: body\)"),
])
def test_a_bad_jsonl_line_names_the_file_and_the_line(tmp_path, lines, match):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
        data_mod.iter_texts(str(path))


@pytest.fixture(scope="module")
def chatglm2(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("glm") / "chatglm2", "chatglm2")


def test_convert_chatglm_to_an_existing_file(chatglm2, tmp_path, capsys):
    dst = tmp_path / "taken"
    dst.write_text("mine")
    line = refused(["convert-chatglm", str(chatglm2), str(dst), "--rope-ratio-meaning", "positions"], capsys)
    assert "taken is a file, not a folder" in line
    assert dst.read_text() == "mine"


def test_convert_chatglm_names_the_flag_on_the_command_line(chatglm2, tmp_path, capsys):
    line = refused(["convert-chatglm", str(chatglm2), str(tmp_path / "out")], capsys)
    assert "pass --rope-ratio-meaning base" in line and "--rope-ratio-meaning positions" in line
    assert "rope_ratio_meaning=" not in line
    assert not (tmp_path / "out").exists()


# The fine-tune's token cache holds no pickle.

def test_the_token_cache_is_read_without_pickle(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("ROPE_EXT_CACHE", str(tmp_path))
    texts = [("one", "The grass is green. " * 20), ("two", "The sky is blue. " * 30)]
    first = training_data.tokenize_cached(texts, tiny_tokenizer)
    assert [p.suffix for p in (tmp_path / "finetune-tokens").iterdir()] == [".arrow"]

    def no_pickle(*args, **kwargs):
        raise AssertionError("the cache was unpickled")

    monkeypatch.setattr(torch, "load", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    again = training_data.tokenize_cached(texts, tiny_tokenizer)
    assert [d.name for d in again] == ["one", "two"]
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(first, again))


# Numbers: other numeric types that mean a number count; bools, strings and extremes do not.

@pytest.fixture(scope="module")
def small():
    return random_model()


@pytest.mark.parametrize("factor", [np.float32(4), np.int64(4), torch.tensor(4.0), torch.tensor(4)])
def test_a_factor_of_another_numeric_type(small, factor):
    info = rope_ext.patch(small, "ntk", factor=factor)
    try:
        assert type(info.factor) is float and info.factor == 4.0
    finally:
        rope_ext.unpatch(small)


def test_parameters_of_other_numeric_types_are_stored_as_python_numbers(small):
    info = rope_ext.patch(small, "yarn", factor=np.float64(2), beta_fast=np.float32(16), beta_slow=torch.tensor(2.0))
    try:
        assert type(info.params["beta_fast"]) is float and type(info.params["beta_slow"]) is float
        json.dumps(info.to_dict())
    finally:
        rope_ext.unpatch(small)
    info = rope_ext.patch(small, "dynamic", factor=2, granularity=np.int64(8))
    try:
        assert type(info.params["granularity"]) is int and info.params["granularity"] == 8
    finally:
        rope_ext.unpatch(small)


@pytest.mark.parametrize("method, kwargs, match", [
    ("ntk", {"factor": True}, r"factor must be a finite number > 1 and <= 1048576, got True"),
    ("ntk", {"factor": "4"}, r"factor must be a finite number > 1 .*got '4'"),
    ("ntk", {"factor": torch.tensor([4.0])}, r"factor must be a finite number"),
    ("ntk", {"factor": 1e308}, r"factor must be a finite number > 1 and <= 1048576, got 1e\+308"),
    ("yarn", {"factor": 4, "beta_fast": True}, r"yarn: parameter beta_fast must be a number, got True"),
    ("yarn", {"factor": 4, "truncate": 1}, r"yarn: truncate must be True or False, got 1"),
    ("yarn", {"factor": 4, "attention_factor": 1e300}, r"attention_factor must be in \(0, 100\]"),
    ("dynamic", {"factor": 4, "granularity": 2**70}, r"granularity must be an int in \[1, 2147483647\]"),
    ("dynamic", {"factor": 4, "granularity": 4.0}, r"granularity must be an int in \[1, 2147483647\], got 4.0"),
    ("self_extend", {"group": 2**70}, r"self_extend: group .* must be an int in \[1, 2147483647\]"),
    ("alibi_hybrid", {"factor": 4, "w": 2**70}, r"alibi_hybrid: w .* must be an int in \[0, 2147483647\]"),
    ("alibi_hybrid", {"factor": 4, "slope_scale": 1e300}, r"slope_scale must be a finite number in \(0, 1e\+06\]"),
    ("ntk", {"factor": 4, "original_window": 2**70}, r"original_window must be an int in \[1, 2147483647\]"),
])
def test_numbers_out_of_type_or_range_are_refused_with_what_is_accepted(small, method, kwargs, match):
    before = [p.clone() for p in small.buffers()]
    with pytest.raises(ValueError, match=match):
        rope_ext.patch(small, method, **kwargs)
    assert loading.patched(small) is None
    assert all(torch.equal(a, b) for a, b in zip(before, small.buffers()))


@pytest.mark.parametrize("method, kwargs", [
    ("yarn", {"factor": 4, "beta_fast": 1e300}),
    ("yarn", {"factor": 4, "attention_factor": 100}),
    ("alibi_hybrid", {"factor": 4, "slope_scale": 1e6}),
    ("llama3", {"factor": 4, "high_freq_factor": 1e300}),
])
def test_the_largest_accepted_values_keep_the_logits_finite(small, method, kwargs):
    rope_ext.patch(small, method, **kwargs)
    try:
        ids = torch.randint(0, small.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(logits(small, ids)).all()
    finally:
        rope_ext.unpatch(small)
