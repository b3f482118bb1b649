"""Saving a patched model (rope_ext.saving, rope_ext.record): what plain transformers reloads of it
(issue #15): a patch transformers can express reloads as itself; one it cannot warns at
save_pretrained, and its config claims no window the plain reload does not deliver;
rope_ext.from_pretrained restores every patch exactly, and refuses a corrupted record clearly."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import rope_ext

from helpers import WINDOW, logits, random_ids, random_model


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn", "ntk_by_parts", "llama3"])
def test_save_and_plain_reload_reproduce_static_methods(tmp_path, method):
    model = random_model()
    info = rope_ext.patch(model, method, factor=4)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    x = random_ids(3 * WINDOW, seed=1)
    assert torch.equal(logits(reloaded, x), logits(model, x))
    assert reloaded.config.max_position_embeddings == info.max_length


@pytest.mark.parametrize(
    "method,params",
    [("dynamic", {}), ("dynamic", {"causal": False}), ("dynamic_yarn", {"granularity": 8}), ("yarn", {"beta_fast": 16.0})],
)
def test_rope_ext_from_pretrained_restores_every_method(tmp_path, method, params):
    model = random_model()
    rope_ext.patch(model, method, factor=4, **params)
    model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    x = random_ids(3 * WINDOW, seed=1)
    assert torch.equal(logits(reloaded, x), logits(model, x))
    assert rope_ext.describe(reloaded) == rope_ext.describe(model)
    rope_ext.unpatch(reloaded)
    assert torch.equal(logits(reloaded, x), logits(random_model(), x))


def rope_ext_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "rope_ext" in str(w.message)]


@pytest.mark.parametrize(
    "method,params",
    [
        ("alibi_hybrid", {}),
        ("alibi_hybrid", {"rope": "yarn"}),
        ("dynamic", {}),
        ("dynamic_yarn", {}),
        ("self_extend", {}),
    ],
)
def test_a_patch_transformers_cannot_express_warns_and_reloads_plainly_as_the_unpatched_model(
    tiny_model, tiny_path, heldout_ids, tmp_path, method, params
):
    x = heldout_ids[None, :300]
    window = tiny_model.config.max_position_embeddings
    unpatched = logits(tiny_model, x)
    info = rope_ext.patch(tiny_model, method, factor=4, **params)
    assert info.native is None
    with pytest.warns(
        UserWarning, match=rf"'{method}' patch .* loads the unpatched model; load it with rope_ext\.from_pretrained\(path\)"
    ):
        tiny_model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert plain.config.max_position_embeddings == window
    assert torch.equal(logits(plain, x), unpatched)
    reloaded = rope_ext.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert rope_ext.describe(reloaded) == rope_ext.describe(tiny_model)
    assert torch.equal(logits(reloaded, x), logits(tiny_model, x))


@pytest.mark.parametrize("method,params", [("ntk", {}), ("yarn", {}), ("dynamic", {"causal": False})])
def test_a_patch_transformers_expresses_saves_without_a_warning(tiny_model, tmp_path, method, params):
    info = rope_ext.patch(tiny_model, method, factor=4, **params)
    assert info.native is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_model.save_pretrained(tmp_path)
    assert rope_ext_warnings(caught) == []


def test_an_unpatched_model_saves_without_a_warning(tiny_model, tmp_path):
    rope_ext.patch(tiny_model, "self_extend", factor=4)
    rope_ext.unpatch(tiny_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_model.save_pretrained(tmp_path)
    assert rope_ext_warnings(caught) == [] and "save_pretrained" not in tiny_model.__dict__


# A corrupted rope_ext record in config.json: one reader (rope_ext.record), one clear error
# naming the file and the key, on every loading route.


def _saved_with_record(tmp_path, edit):
    model = random_model()
    rope_ext.patch(model, "yarn", factor=4)
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    edit(config["rope_ext"])
    path.write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("factor"), "key rope_ext.factor is missing"),
        (lambda r: r.update(factor="4"), "key rope_ext.factor must be"),
        (lambda r: r.update(params=[1]), "key rope_ext.params must be dict"),
        (lambda r: r.update(method="rope2"), "key rope_ext.method names unknown method 'rope2'"),
        (lambda r: r.update(version=7), "rope_ext config format 7 is not supported"),
        (lambda r: r["original"].pop("rope_parameters"), "key rope_ext.original.rope_parameters is missing"),
        (lambda r: r["original"].update(original_window="8k"), "key rope_ext.original.original_window must be a positive int"),
    ],
)
def test_a_corrupted_record_is_refused_naming_the_file_and_key(tmp_path, edit, message):
    folder = _saved_with_record(tmp_path, edit)
    with pytest.raises(ValueError, match=message) as raised:
        rope_ext.from_pretrained(folder)
    assert str(folder / "config.json") in str(raised.value)


def test_the_lm_eval_model_reads_the_record_through_the_same_checks(tmp_path, tiny_path):
    from rope_ext.evals.lm_eval_model import RopeExtLM

    folder = _saved_with_record(tmp_path, lambda r: r.update(version=2))
    with pytest.raises(ValueError, match="rope_ext config format 2 is not supported"):
        RopeExtLM(pretrained=str(folder), tokenizer=str(tiny_path))


@pytest.mark.parametrize(
    "load",
    [
        lambda folder: rope_ext.from_pretrained(folder),
        lambda folder: rope_ext.patch(AutoModelForCausalLM.from_pretrained(folder), "ntk", 4),
    ],
    ids=["from_pretrained", "patch of a plain reload"],
)
def test_the_record_is_read_once_and_handed_to_the_family(tmp_path, monkeypatch, load):
    from rope_ext import record

    folder = _saved_with_record(tmp_path, lambda r: None)
    reads = []
    read = record.read
    monkeypatch.setattr(record, "read", lambda *args: reads.append(args) or read(*args))
    load(folder)
    assert len(reads) == 1
