"""Saving a patched model (rope_ext.saving, rope_ext.record): what plain transformers reloads of it
(issue #15): a patch transformers can express reloads as itself; one it cannot warns at
save_pretrained, and its config claims no window the plain reload does not deliver;
rope_ext.from_pretrained restores every patch exactly, and refuses a corrupted record clearly."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from helpers import WINDOW, logits, random_ids, random_model
from transformers import AutoModelForCausalLM

import rope_ext
from rope_ext import record


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn", "ntk_by_parts", "llama3"])
def test_save_and_plain_reload_reproduce_static_methods(tmp_path, method):
    model = random_model()
    info = rope_ext.patch(model, method, factor=4)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    x = random_ids(3 * WINDOW, seed=1)
    assert torch.equal(logits(reloaded, x), logits(model, x))
    # the longest input transformers and lm-eval's `hf` model take: the length the patch is meant for
    # (vLLM and SGLang multiply it by a linear factor: tests/saving/test_serving.py restates their rules)
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


@pytest.mark.parametrize("method,params", [("ntk", {}), ("yarn", {})])
def test_a_patch_every_engine_serves_saves_without_a_warning(tiny_model, tmp_path, method, params):
    info = rope_ext.patch(tiny_model, method, factor=4, **params)
    assert info.native is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_model.save_pretrained(tmp_path)
    assert rope_ext_warnings(caught) == []


def test_a_save_names_the_engines_that_serve_it_otherwise(tiny_model, tmp_path):
    """transformers' `dynamic` reloads the one-schedule dynamic patch; vLLM's and SGLang's dynamic
    NTK is a fixed base at the config's window (docs/serving.md), which the save says."""
    info = rope_ext.patch(tiny_model, "dynamic", factor=4, causal=False)
    assert info.native is not None
    with pytest.warns(UserWarning, match="transformers 5 serves this checkpoint as patched; vLLM 0.30-0.34 not as patched"):
        tiny_model.save_pretrained(tmp_path)


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
        # issue #51 item 2: a tampered original or parameter, named as the others are
        (lambda r: r["original"].update(rope_parameters="default"), "key rope_ext.original.rope_parameters must be dict"),
        (
            lambda r: r["original"]["rope_parameters"].pop("rope_theta"),
            "key rope_ext.original.rope_parameters.rope_theta is missing",
        ),
        (
            lambda r: r["original"]["rope_parameters"].update(rope_theta="1e4"),
            "key rope_ext.original.rope_parameters.rope_theta must be a positive number",
        ),
        (
            lambda r: r["original"].update(max_position_embeddings="64"),
            "key rope_ext.original.max_position_embeddings must be a positive int",
        ),
        (lambda r: r["original"].pop("max_position_embeddings"), "key rope_ext.original.max_position_embeddings is missing"),
        (lambda r: r["params"].update(beta_fast="fast"), "key rope_ext.params: .*beta_fast"),
        (lambda r: r["params"].update(window=3), "key rope_ext.params: .*window"),
    ],
)
def test_a_corrupted_record_is_refused_naming_the_file_and_key(tmp_path, edit, message):
    folder = _saved_with_record(tmp_path, edit)
    with pytest.raises(ValueError, match=message) as raised:
        rope_ext.from_pretrained(folder)
    assert str(folder / "config.json") in str(raised.value)


def test_a_recorded_parameter_the_model_refuses_is_refused_naming_the_file(tmp_path):
    """A parameter only the model can check (dca's chunk against the trained window), tampered."""
    model = random_model()
    rope_ext.patch(model, "dca", factor=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dca has no native form
        model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["rope_ext"]["params"]["chunk_size"] = 2 * WINDOW
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"key rope_ext\.params: dca: chunk_size 128 exceeds the trained window 64") as raised:
        rope_ext.from_pretrained(tmp_path)
    assert str(path) in str(raised.value)


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


# What rope-ext writes to config.json stays the model's config: rope_parameters updated, not
# replaced; nested per-layer-type parameters keep their shape; head_dim written where transformers
# needs it to reload (issue #29 item 2, issue #26 item 2).

MODEL_KEYS = {"llama_4_scaling_beta": 0.1, "long_mscale": 1.25, "a_key_no_one_knows": "kept"}


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn", "llama3", "self_extend"])
def test_keys_the_model_reads_survive_patch_save_reload_and_unpatch(tmp_path, method):
    model = random_model(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **MODEL_KEYS})
    original = copy.deepcopy(model.config.rope_parameters)
    rope_ext.patch(model, method, factor=4)
    assert model.config.rope_parameters.items() >= MODEL_KEYS.items()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self_extend's: transformers alone loads the unpatched model
        model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"].items() >= MODEL_KEYS.items()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path)
    for loaded in (plain, reloaded):
        assert loaded.config.rope_parameters.items() >= MODEL_KEYS.items()
    for patched in (model, reloaded):
        rope_ext.unpatch(patched)
        assert patched.config.rope_parameters == original


def test_a_native_form_replaces_the_scaling_and_keeps_the_rest():
    original = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "mscale": 0.7,
        "mscale_all_dim": 0.7,
        "beta_fast": 16,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        **MODEL_KEYS,
    }
    kept = copy.deepcopy(original)
    native = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert record.rope_parameters(original, native) == {
        **native,
        "original_max_position_embeddings": 1024,
        "partial_rotary_factor": 0.5,
        **MODEL_KEYS,
    }
    assert original == kept


NESTED = {
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}


def test_nested_rope_parameters_keep_their_shape_through_write_save_and_restore(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma3_text",
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=copy.deepcopy(NESTED),
    )
    original = record.config_values(config)
    native = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}
    record.write_native(config, native, original, 256, layer_type="full_attention")
    assert config.rope_parameters == {"full_attention": native, "sliding_attention": NESTED["sliding_attention"]}
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters == config.rope_parameters
    with pytest.raises(ValueError, match="per layer type"):
        record.rope_parameters(NESTED, native)
    without_rope = {"full_attention": NESTED["full_attention"], "no_rope": None}
    assert record.rope_parameters(without_rope, native, "full_attention") == {"full_attention": native, "no_rope": None}
    record.restore(config, original)
    assert config.rope_parameters == NESTED


def perturbed_norms(model):
    """Norm weights away from 1, so that a wrong head size or layout cannot hide behind them."""
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.mul_(torch.rand(weight.shape, generator=torch.Generator().manual_seed(3)) + 0.5)
    return model


@pytest.mark.parametrize("method,params", [("yarn", {}), ("ntk_by_parts", {}), ("dynamic", {"causal": False})])
def test_a_mixtral_config_without_head_dim_saves_reloads_and_unpatches_exactly(tmp_path, method, params):
    model = perturbed_norms(random_model("mixtral", head_dim=None))
    x = random_ids(3 * WINDOW, seed=1)
    plain = logits(model, x)
    written = ("rope_parameters", "max_position_embeddings", "head_dim")
    config = {key: copy.deepcopy(getattr(model.config, key)) for key in written}
    assert config["head_dim"] is None  # as Mixtral-8x7B ships
    rope_ext.patch(model, method, factor=4, **params)
    patched = logits(model, x)
    model.save_pretrained(tmp_path)
    native = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert torch.equal(logits(native, x), patched)
    reloaded = rope_ext.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert torch.equal(logits(reloaded, x), patched)
    for unpatched in (model, reloaded):
        rope_ext.unpatch(unpatched)
        assert torch.equal(logits(unpatched, x), plain)
        assert {key: getattr(unpatched.config, key) for key in written} == config


# What the record says the checkpoint was and what config.json states are one claim: a reload
# compares them and refuses a difference, naming config.json and the key (issue #51 item 1).


def _saved_and_edited(tmp_path, method, params, edit):
    model = random_model()
    rope_ext.patch(model, method, factor=4, **params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a patch without a native form: transformers alone loads the unpatched model
        model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("method,params", [("yarn", {}), ("dynamic", {}), ("dynamic", {"causal": False}), ("self_extend", {})])
@pytest.mark.parametrize(
    "edit,key",
    [
        (lambda c: c["rope_parameters"].update(rope_theta=10001.0), "rope_parameters.rope_theta"),
        (lambda c: c["rope_ext"]["original"]["rope_parameters"].update(rope_theta=10001.0), "rope_parameters.rope_theta"),
        (lambda c: c.update(max_position_embeddings=c["max_position_embeddings"] + 64), "max_position_embeddings"),
        # yarn's native form writes no trace of it: the record's window, derived from it, disagrees instead
        (
            lambda c: c["rope_ext"]["original"].update(max_position_embeddings=WINDOW + 1),
            "(max_position_embeddings|rope_ext.original.original_window)",
        ),
    ],
    ids=["config rope_theta", "record rope_theta", "config max_position_embeddings", "record max_position_embeddings"],
)
def test_a_record_that_disagrees_with_its_config_json_is_refused_naming_both(tmp_path, method, params, edit, key):
    path = _saved_and_edited(tmp_path, method, params, edit)
    with pytest.raises(ValueError, match=rf"key {key} is") as raised:
        rope_ext.from_pretrained(tmp_path)
    assert str(path) in str(raised.value)
    assert "rope_ext.original" in str(raised.value)


@pytest.mark.parametrize("method,params", [("yarn", {}), ("dynamic", {}), ("self_extend", {})])
def test_a_record_that_agrees_with_its_config_json_reloads(tmp_path, method, params):
    """The same save, untouched, and with a key the patch never writes edited: both reload."""
    _saved_and_edited(tmp_path, method, params, lambda c: c.update(rms_norm_eps=2e-6))
    assert rope_ext.describe(rope_ext.from_pretrained(tmp_path))["method"] == method
