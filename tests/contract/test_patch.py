"""patch / unpatch / reload on random-weight LLaMA-family models: plumbing and exactness; numbers
of other types; and on the tiny trained model what a patch survives (issue #15): a change of
attention backend, a deep copy, a cast before patching, a repatch, generation past its length."""

import copy
import json
import logging

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel
from transformers.utils import logging as hf_logging

import rope_ext
from rope_ext import loading
from rope_ext.rotary import ExtendedRotaryEmbedding

from helpers import (
    DYNAMIC_METHODS,
    WINDOW,
    YARN_PARAMS,
    frequency_scaling,
    greedy,
    load_llama,
    logits,
    native_twin,
    random_ids,
    random_model,
    registered,
    takes_a_factor_alone,
)

FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3"]
NATIVE = {
    "linear": ({}, lambda: {"rope_type": "linear", "factor": 4.0}, None),
    "dynamic": ({"causal": False}, lambda: {"rope_type": "dynamic", "factor": 4.0}, WINDOW),
    "yarn": ({}, lambda: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW}, None),
    "llama3": (
        {},
        lambda: {
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": WINDOW,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        None,
    ),
    "ntk": ({}, lambda: {"rope_type": "default", "rope_theta": 10000.0 * 4 ** (16 / 14)}, None),
    "ntk_by_parts": (
        {},
        lambda: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW, "attention_factor": 1.0},
        None,
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", list(NATIVE))
def test_patch_matches_native_transformers_bit_for_bit(family, method):
    params, rope, max_pos = NATIVE[method]
    model = random_model(family)
    rope_parameters = {"rope_theta": 10000.0, **rope()}
    native = native_twin(model, rope_parameters, max_pos or 4 * WINDOW)
    info = rope_ext.patch(model, method, factor=4, **params)
    assert info.max_length == 4 * WINDOW
    for length in (WINDOW // 2, WINDOW, 3 * WINDOW + 5):
        x = random_ids(length, seed=1)
        assert (logits(model, x) - logits(native, x)).abs().max() <= 1e-5, (method, length)
        if method != "dynamic":  # a dynamic native model keeps state across calls; compare fresh forwards only
            assert torch.equal(logits(model, x), logits(native, x))


# the frequency scalings that take a factor alone (not ntk_alpha nor longrope, which need more)
@pytest.mark.parametrize("method", registered(lambda method: frequency_scaling(method) and takes_a_factor_alone(method)))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_unpatch_restores_the_model_exactly(method, attn):
    model = random_model(attn=attn)
    x = random_ids(3 * WINDOW, seed=1)
    before = logits(model, x)
    config_before = copy.deepcopy(model.config.to_dict())
    rope_ext.patch(model, method, factor=4)
    assert not torch.equal(logits(model, x), before)
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, x), before)
    assert model.config.to_dict() == config_before
    assert model.config._attn_implementation == attn
    assert rope_ext.describe(model) is None
    assert not any(hasattr(layer.self_attn, "rope_ext_attention") for layer in model.model.layers)


def test_repatching_replaces_instead_of_compounding():
    model = random_model()
    x = random_ids(3 * WINDOW, seed=1)
    rope_ext.patch(model, "ntk", factor=2)
    info = rope_ext.patch(model, "yarn", factor=8)
    assert info.original_window == WINDOW and info.max_length == 8 * WINDOW
    fresh = random_model()
    rope_ext.patch(fresh, "yarn", factor=8)
    assert torch.equal(logits(model, x), logits(fresh, x))
    assert model.config.rope_ext["original"]["max_position_embeddings"] == WINDOW
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, x), logits(random_model(), x))


def test_checkpoint_with_existing_yarn_scaling_is_extended_from_it_or_replaced_over_its_original_window():
    scaled = random_model(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": WINDOW},
        max_position_embeddings=2 * WINDOW,
    )
    x = random_ids(3 * WINDOW, seed=1)
    shipped = logits(scaled, x)
    info = rope_ext.patch(scaled, "ntk", factor=4)
    assert (info.original_window, info.max_length, info.starts_from["scaling"]) == (2 * WINDOW, 8 * WINDOW, "yarn")
    assert not torch.equal(logits(scaled, x), shipped)
    plain = random_model()
    info = rope_ext.patch(scaled, "ntk", factor=4, original_window=WINDOW)
    rope_ext.patch(plain, "ntk", factor=4)
    assert info.original_window == WINDOW and info.starts_from["scaling"] is None
    assert torch.equal(logits(scaled, x), logits(plain, x))
    rope_ext.unpatch(scaled)
    assert scaled.config.rope_parameters["rope_type"] == "yarn" and torch.equal(logits(scaled, x), shipped)


def test_checkpoint_with_linear_scaling_is_extended_from_its_served_context():
    scaled = random_model(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, max_position_embeddings=2 * WINDOW
    )
    info = rope_ext.patch(scaled, "yarn", factor=4)
    assert (info.original_window, info.max_length, info.starts_from["scaling"]) == (2 * WINDOW, 8 * WINDOW, "linear")
    rope_ext.unpatch(scaled)
    assert not isinstance(scaled.model.rotary_emb, ExtendedRotaryEmbedding)
    info = rope_ext.patch(scaled, "yarn", factor=4, original_window=WINDOW)
    assert info.max_length == 4 * WINDOW


def test_patch_through_peft_wrapper():
    from peft import LoraConfig, get_peft_model

    model = random_model()
    reference = random_model()
    rope_ext.patch(reference, "yarn", factor=4)
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=True))
    info = rope_ext.patch(wrapped, "yarn", factor=4)
    assert info.family == "llama"
    x = random_ids(3 * WINDOW, seed=1)
    with torch.no_grad():
        assert torch.equal(wrapped(input_ids=x).logits, logits(reference, x))
    rope_ext.unpatch(wrapped)


def test_angles_stay_fp32_in_a_bf16_model():
    model = random_model()
    rope_ext.patch(model, "yarn", factor=4)
    model.to(torch.bfloat16)
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    exact, scale = rope_ext.method.get("yarn")(rotary.geometry, None, 4.0, rotary.params)
    assert torch.equal(rotary.inv_freq, exact)
    positions = torch.arange(3 * WINDOW)[None]
    cos, _ = rotary(torch.zeros(1, dtype=torch.bfloat16), positions)
    expected = (torch.cat([positions[..., None] * exact] * 2, -1).cos() * scale).to(torch.bfloat16)
    assert cos.dtype == torch.bfloat16 and torch.equal(cos, expected)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda m: rope_ext.patch(m, "rope2", factor=4), "valid methods: linear, ntk, dynamic"),
        (lambda m: rope_ext.patch(m, "ntk", factor=1), "factor"),
        (lambda m: rope_ext.patch(m, "ntk", factor=0.5), "factor"),
        (lambda m: rope_ext.patch(m, "ntk", factor=float("nan")), "factor"),
        (lambda m: rope_ext.patch(m, "ntk", factor=float("inf")), "factor"),
        (lambda m: rope_ext.patch(m, "ntk"), "needs a factor"),
        (lambda m: rope_ext.patch(m, "ntk", factor=4, beta_fast=3), "unknown parameter"),
        (lambda m: rope_ext.patch(m, "dynamic", factor=4, granularity=0), "granularity"),
        (lambda m: rope_ext.patch(m, "ntk", factor=4, original_window=-3), "original_window"),
        (lambda m: rope_ext.unpatch(m), "not patched"),
    ],
)
def test_bad_input_is_refused_and_leaves_the_model_untouched(call, match):
    model = random_model()
    x = random_ids(2 * WINDOW, seed=1)
    before, config = logits(model, x), copy.deepcopy(model.config.to_dict())
    with pytest.raises(ValueError, match=match):
        call(model)
    assert torch.equal(logits(model, x), before)
    assert model.config.to_dict() == config


def test_model_without_rotary_embedding_is_refused_with_the_reason():
    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match=r"cannot patch BertModel \(model_type='bert'\): no rotary embedding module"):
        rope_ext.patch(bert, "ntk", factor=4)


def test_modified_rotary_module_is_refused():
    model = random_model()
    model.model.rotary_emb.original_inv_freq.mul_(0.5)
    with pytest.raises(ValueError, match="does not hold the frequencies"):
        rope_ext.patch(model, "ntk", factor=4)


def test_dynamic_static_cache_is_refused_clearly():
    from transformers import StaticCache

    model = random_model()
    rope_ext.patch(model, "dynamic", factor=4)
    cache = StaticCache(config=model.config, max_cache_len=4 * WINDOW)
    with pytest.raises(RuntimeError, match="static"), torch.no_grad():
        model(random_ids(8, seed=1), cache=cache, use_cache=True)


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


@pytest.mark.parametrize(
    "method, kwargs, match",
    [
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
        # issue #51 item 6: the length a patch is meant for, under the bound of every other size
        (
            "yarn",
            {"factor": 2**20, "original_window": 8192},
            r"yarn x1048576 over a 8192-token window is meant for 8589934592 tokens, past 2147483647.* at most 262143",
        ),
        ("dynamic", {"factor": 4, "original_window": 2**30}, r"meant for 4294967296 tokens, past 2147483647"),
    ],
)
def test_numbers_out_of_type_or_range_are_refused_with_what_is_accepted(small, method, kwargs, match):
    before = [p.clone() for p in small.buffers()]
    with pytest.raises(ValueError, match=match):
        rope_ext.patch(small, method, **kwargs)
    assert loading.patched(small) is None
    assert all(torch.equal(a, b) for a, b in zip(before, small.buffers()))


@pytest.mark.parametrize(
    "method, kwargs",
    [
        ("yarn", {"factor": 4, "beta_fast": 1e300}),
        ("yarn", {"factor": 4, "attention_factor": 100}),
        ("alibi_hybrid", {"factor": 4, "slope_scale": 1e6}),
        ("llama3", {"factor": 4, "high_freq_factor": 1e300}),
    ],
)
def test_the_largest_accepted_values_keep_the_logits_finite(small, method, kwargs):
    rope_ext.patch(small, method, **kwargs)
    try:
        ids = torch.randint(0, small.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(logits(small, ids)).all()
    finally:
        rope_ext.unpatch(small)


# On the tiny trained model: what a patch survives.

CHAINED = ["dynamic", "dynamic_yarn", "self_extend", "alibi_hybrid"]  # attention runs through the rope-ext wrapper


@pytest.fixture
def text(heldout_ids):
    return heldout_ids[None, :300]  # past the tiny model's 128-token window


@pytest.mark.parametrize("method", CHAINED)
def test_backend_change_keeps_the_patch_and_unpatch_restores_the_choice(tiny_model, tiny_path, text, method):
    patched_eager = load_llama(tiny_path, attn_implementation="eager")
    rope_ext.patch(patched_eager, method, factor=4)
    plain_eager = load_llama(tiny_path, attn_implementation="eager")
    assert tiny_model.config._attn_implementation == "sdpa"
    rope_ext.patch(tiny_model, method, factor=4)
    tiny_model.set_attn_implementation("eager")
    assert tiny_model.config._attn_implementation == "rope_ext_eager"
    assert torch.equal(logits(tiny_model, text), logits(patched_eager, text))
    assert not torch.allclose(logits(tiny_model, text), logits(plain_eager, text), atol=1e-2)
    rope_ext.unpatch(tiny_model)
    assert tiny_model.config._attn_implementation == "eager"
    assert torch.equal(logits(tiny_model, text), logits(plain_eager, text))
    assert "set_attn_implementation" not in tiny_model.__dict__


def test_unpatch_of_a_static_method_keeps_the_backend_chosen_last(tiny_model):
    rope_ext.patch(tiny_model, "ntk", factor=4)
    tiny_model.set_attn_implementation("eager")
    rope_ext.unpatch(tiny_model)
    assert tiny_model.config._attn_implementation == "eager"


@pytest.mark.parametrize("method", DYNAMIC_METHODS)
def test_deep_copy_is_an_independent_patched_model(tiny_model, tiny_path, text, method):
    rope_ext.patch(tiny_model, method, factor=4)
    twin = copy.deepcopy(tiny_model)
    prompt = text[:, :120]
    expected = greedy(tiny_model, prompt, 20)
    assert torch.equal(greedy(twin, prompt, 20), expected)
    assert torch.equal(logits(twin, text), logits(tiny_model, text))
    patched = logits(tiny_model, text)
    rope_ext.unpatch(twin)
    assert torch.equal(logits(twin, text), logits(load_llama(tiny_path), text))
    assert torch.equal(logits(tiny_model, text), patched) and torch.equal(greedy(tiny_model, prompt, 20), expected)
    rope_ext.patch(twin, "yarn", factor=2)
    rope_ext.unpatch(tiny_model)
    assert rope_ext.describe(twin)["method"] == "yarn" and rope_ext.describe(tiny_model) is None


@pytest.mark.parametrize(
    "cast",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.to(torch.bfloat16),
    ],
    ids=["half", "bfloat16", "to_bfloat16"],
)
def test_a_cast_model_is_patched_with_fp32_frequencies(tiny_model, tiny_path, cast):
    reference = load_llama(tiny_path)
    expected = rope_ext.patch(reference, "ntk", factor=4)
    model = cast(tiny_model)
    assert rope_ext.patch(model, "ntk", factor=4) == expected
    rotary = model.model.rotary_emb
    assert isinstance(rotary, ExtendedRotaryEmbedding) and rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, reference.model.rotary_emb.inv_freq)


def test_a_cast_model_that_was_modified_is_still_refused(tiny_model):
    model = tiny_model.bfloat16()
    model.model.rotary_emb.original_inv_freq.mul_(0.5)
    with pytest.raises(ValueError, match="does not hold the frequencies"):
        rope_ext.patch(model, "ntk", factor=4)


@pytest.mark.parametrize(
    "first, second",
    [
        (("ntk", 2, {}), ("dynamic", 8, {})),
        (("linear", 4, {}), ("self_extend", 4, {})),
        (("yarn", 4, {}), ("alibi_hybrid", 4, {"rope": "yarn"})),
        (("alibi_hybrid", 2, {}), ("llama3", 4, {})),
        (("dynamic_yarn", 4, {}), ("dynamic", 2, {"causal": False})),
    ],
)
def test_repatching_writes_the_config_of_a_first_patch(tiny_model, tiny_path, first, second):
    fresh = load_llama(tiny_path)
    rope_ext.patch(fresh, second[0], factor=second[1], **second[2])
    rope_ext.patch(tiny_model, first[0], factor=first[1], **first[2])
    rope_ext.patch(tiny_model, second[0], factor=second[1], **second[2])
    assert tiny_model.config.to_dict() == fresh.config.to_dict()
    assert tiny_model.config._attn_implementation == fresh.config._attn_implementation


@pytest.fixture
def transformers_warnings():
    """Messages transformers logs during the test (its once-only warnings included)."""
    hf_logging.warning_once.cache_clear()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.mark.parametrize("method", DYNAMIC_METHODS)
def test_generate_warns_of_the_length_only_past_the_patch_max_length(tiny_model, heldout_ids, transformers_warnings, method):
    info = rope_ext.patch(tiny_model, method, factor=2)  # meant for 256 tokens
    greedy(tiny_model, heldout_ids[None, :120], 30)
    assert not [m for m in transformers_warnings if "predefined maximum length" in m]
    greedy(tiny_model, heldout_ids[None, : info.max_length - 2], 4)
    assert [m for m in transformers_warnings if "predefined maximum length" in m] == [
        f"This is a friendly reminder - the current text generation call has exceeded the model's predefined maximum "
        f"length ({info.max_length}). Depending on the model, you may observe exceptions, performance degradation, or nothing at all."
    ]


# The patch in each of its shapes, as JSON (its parameters: YARN_PARAMS): result files and records keep these bytes.
YARN_RECORD = {
    "version": 1,
    "method": "yarn",
    "factor": 4.0,
    "params": YARN_PARAMS,
    "original": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": WINDOW,
        "original_window": WINDOW,
        "starts_from": {"scaling": None, "source": "max_position_embeddings"},
    },
}
YARN_DESCRIBED = {
    "method": "yarn",
    "factor": 4.0,
    "params": YARN_PARAMS,
    "geometry": {"rotary_dim": 16, "base": 10000.0, "original_window": WINDOW, "layout": "half", "head_dim": 16},
    "max_length": 4 * WINDOW,
}
YARN_INFO = {
    "method": "yarn",
    "factor": 4.0,
    "params": YARN_PARAMS,
    "family": "llama",
    "model_type": "llama",
    "original_window": WINDOW,
    "max_length": 4 * WINDOW,
    "rotary_dim": 16,
    "head_dim": 16,
    "base": 10000.0,
    "layout": "half",
    "attention_factor": 1.138629436111989,
    "native": {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": WINDOW,
        "beta_fast": 16,
        "beta_slow": 1.0,
        "truncate": True,
    },
    "notes": {},
    "starts_from": {"scaling": None, "window": WINDOW, "source": "max_position_embeddings"},
}


def test_the_patch_reads_the_same_in_config_json_describe_and_patch_info(tmp_path):
    model = random_model()
    info = rope_ext.patch(model, "yarn", factor=4, beta_fast=16)
    model.save_pretrained(tmp_path)
    # compared as JSON text, so that the order of the keys counts too (config.json sorts them)
    assert json.dumps(model.config.rope_ext) == json.dumps(YARN_RECORD)
    assert json.loads((tmp_path / "config.json").read_text())["rope_ext"] == YARN_RECORD
    assert json.dumps(rope_ext.describe(model)) == json.dumps(YARN_DESCRIBED)
    assert json.dumps(info.to_dict()) == json.dumps(YARN_INFO)
    assert json.dumps(rope_ext.describe(rope_ext.from_pretrained(tmp_path))) == json.dumps(YARN_DESCRIBED)


def test_a_method_warns_at_the_line_that_called_patch():
    model = random_model()
    with pytest.warns(UserWarning, match="breaks its authors' rule") as caught:
        rope_ext.patch(model, "self_extend", factor=4, group=6)
    assert [w.filename for w in caught if "breaks its authors' rule" in str(w.message)] == [__file__]
