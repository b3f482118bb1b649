"""patch / unpatch / reload on random-weight LLaMA-family models: plumbing and exactness."""

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertModel, DynamicCache

import rope_ext
from rope_ext.rotary import ExtendedRotaryEmbedding

from helpers import WINDOW, logits, native_twin, random_model

FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3"]
NATIVE = {
    "linear": ({}, lambda: {"rope_type": "linear", "factor": 4.0}, None),
    "dynamic": ({"causal": False}, lambda: {"rope_type": "dynamic", "factor": 4.0}, WINDOW),
    "yarn": ({}, lambda: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW}, None),
    "llama3": (
        {},
        lambda: {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": WINDOW,
                 "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        None,
    ),
    "ntk": ({}, lambda: {"rope_type": "default", "rope_theta": 10000.0 * 4 ** (16 / 14)}, None),
    "ntk_by_parts": (
        {}, lambda: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW, "attention_factor": 1.0}, None,
    ),
}


def ids(length, seed=1):
    return torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(seed))


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
        x = ids(length)
        assert (logits(model, x) - logits(native, x)).abs().max() <= 1e-5, (method, length)
        if method != "dynamic":  # a dynamic native model keeps state across calls; compare fresh forwards only
            assert torch.equal(logits(model, x), logits(native, x))


@pytest.mark.parametrize("method", ["linear", "ntk", "dynamic", "yarn", "dynamic_yarn", "ntk_by_parts", "llama3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_unpatch_restores_the_model_exactly(method, attn):
    model = random_model(attn=attn)
    x = ids(3 * WINDOW)
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
    x = ids(3 * WINDOW)
    rope_ext.patch(model, "ntk", factor=2)
    info = rope_ext.patch(model, "yarn", factor=8)
    assert info.original_window == WINDOW and info.max_length == 8 * WINDOW
    fresh = random_model()
    rope_ext.patch(fresh, "yarn", factor=8)
    assert torch.equal(logits(model, x), logits(fresh, x))
    assert model.config.rope_ext["original"]["max_position_embeddings"] == WINDOW
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, x), logits(random_model(), x))


def test_checkpoint_with_existing_yarn_scaling_composes_from_its_original_window():
    scaled = random_model(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                          "original_max_position_embeddings": WINDOW}, max_position_embeddings=2 * WINDOW)
    plain = random_model()
    info = rope_ext.patch(scaled, "ntk", factor=4)
    rope_ext.patch(plain, "ntk", factor=4)
    assert info.original_window == WINDOW
    x = ids(3 * WINDOW)
    assert torch.equal(logits(scaled, x), logits(plain, x))
    rope_ext.unpatch(scaled)
    assert scaled.config.rope_parameters["rope_type"] == "yarn"


def test_checkpoint_with_linear_scaling_needs_its_original_window():
    scaled = random_model(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                          max_position_embeddings=2 * WINDOW)
    with pytest.raises(ValueError, match="original_window"):
        rope_ext.patch(scaled, "yarn", factor=4)
    assert not isinstance(scaled.model.rotary_emb, ExtendedRotaryEmbedding)
    info = rope_ext.patch(scaled, "yarn", factor=4, original_window=WINDOW)
    assert info.max_length == 4 * WINDOW


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn", "ntk_by_parts", "llama3"])
def test_save_and_plain_reload_reproduce_static_methods(tmp_path, method):
    model = random_model()
    info = rope_ext.patch(model, method, factor=4)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    x = ids(3 * WINDOW)
    assert torch.equal(logits(reloaded, x), logits(model, x))
    assert reloaded.config.max_position_embeddings == info.max_length


@pytest.mark.parametrize("method,params", [("dynamic", {}), ("dynamic", {"causal": False}), ("dynamic_yarn", {"granularity": 8}), ("yarn", {"beta_fast": 16.0})])
def test_rope_ext_from_pretrained_restores_every_method(tmp_path, method, params):
    model = random_model()
    rope_ext.patch(model, method, factor=4, **params)
    model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    x = ids(3 * WINDOW)
    assert torch.equal(logits(reloaded, x), logits(model, x))
    assert rope_ext.describe(reloaded) == rope_ext.describe(model)
    rope_ext.unpatch(reloaded)
    assert torch.equal(logits(reloaded, x), logits(random_model(), x))


# The patch in each of its shapes, as JSON: result files and records keep these bytes.
YARN_PARAMS = {"beta_fast": 16, "beta_slow": 1.0, "truncate": True, "attention_factor": None}
YARN_RECORD = {
    "version": 1, "method": "yarn", "factor": 4.0, "params": YARN_PARAMS,
    "original": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": WINDOW,
                 "original_window": WINDOW},
}
YARN_DESCRIBED = {
    "method": "yarn", "factor": 4.0, "params": YARN_PARAMS,
    "geometry": {"rotary_dim": 16, "base": 10000.0, "original_window": WINDOW, "layout": "half", "head_dim": 16},
    "max_length": 4 * WINDOW,
}
YARN_INFO = {
    "method": "yarn", "factor": 4.0, "params": YARN_PARAMS, "family": "llama", "model_type": "llama",
    "original_window": WINDOW, "max_length": 4 * WINDOW, "rotary_dim": 16, "head_dim": 16, "base": 10000.0,
    "layout": "half", "attention_factor": 1.138629436111989,
    "native": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": WINDOW,
               "beta_fast": 16, "beta_slow": 1.0, "truncate": True},
    "notes": {},
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
    assert [w.filename for w in caught] == [__file__]


def test_patch_through_peft_wrapper():
    from peft import LoraConfig, get_peft_model

    model = random_model()
    reference = random_model()
    rope_ext.patch(reference, "yarn", factor=4)
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=True))
    info = rope_ext.patch(wrapped, "yarn", factor=4)
    assert info.family == "llama"
    x = ids(3 * WINDOW)
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
    x = ids(2 * WINDOW)
    before, config = logits(model, x), copy.deepcopy(model.config.to_dict())
    with pytest.raises(ValueError, match=match):
        call(model)
    assert torch.equal(logits(model, x), before)
    assert model.config.to_dict() == config


def test_unsupported_family_names_the_supported_ones():
    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match="supported model types: llama, mistral"):
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
        model(ids(8), cache=cache, use_cache=True)
