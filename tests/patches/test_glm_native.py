"""Native transformers GLM / GLM-4 (`glm`, `glm4`): partial rotary on interleaved pairs, patched
like LLaMA and bit-exact against natively configured models; linear-scaled checkpoints (converted
ChatGLM2-6B-32K) are patched on top of their scaling."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import rope_ext
from rope_ext.patches.glm import position_geometry
from rope_ext.method.rope import ntk_base

from helpers import frequency_scaling, random_ids, registered, takes_a_factor_alone, takes_a_partial_rotation

WINDOW = 32
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# method -> (rope_ext params, native rope_parameters, native max_position_embeddings)
NATIVE = {
    "linear": ({}, {"rope_type": "linear", "factor": 4.0}, 4 * WINDOW),
    "ntk": ({}, {"rope_theta": 10000.0 * 4 ** (8 / 6)}, 4 * WINDOW),
    "dynamic": ({"causal": False}, {"rope_type": "dynamic", "factor": 4.0}, WINDOW),
    "yarn": ({}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW}, 4 * WINDOW),
    "ntk_by_parts": (
        {},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW, "attention_factor": 1.0},
        4 * WINDOW,
    ),
    "llama3": (
        {},
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": WINDOW,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        4 * WINDOW,
    ),
}


def glm(model_type="glm", rope=None, max_positions=WINDOW, state=None):
    config = AutoConfig.for_model(
        model_type,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        rope_parameters={**DEFAULT, **(rope or {})},
        pad_token_id=0,
        eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


@torch.no_grad()
def logits(model, x):
    return model(x).logits


@pytest.mark.parametrize("model_type", ["glm", "glm4"])
@pytest.mark.parametrize("method", list(NATIVE))
def test_patch_matches_native_transformers_bit_for_bit(model_type, method):
    params, rope, max_positions = NATIVE[method]
    model = glm(model_type)
    native = glm(model_type, rope, max_positions, state=model.state_dict())
    info = rope_ext.patch(model, method, factor=4, **params)
    assert (info.rotary_dim, info.head_dim, info.layout, info.max_length) == (8, 16, "interleaved", 4 * WINDOW)
    for length in (WINDOW // 2, 3 * WINDOW + 5):
        x = random_ids(length, seed=1)
        assert torch.equal(logits(model, x), logits(native, x)), (method, length)
    x = random_ids(3 * WINDOW, seed=1)
    assert not torch.equal(logits(model, x), logits(glm(model_type), x))


@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_dynamic_decode_equals_full_forward_past_the_window(method):
    model = glm()
    rope_ext.patch(model, method, factor=4)
    x = random_ids(2 * WINDOW + 8, seed=1)
    full = logits(model, x)
    with torch.no_grad():
        out = model(x[:, : WINDOW - 4], use_cache=True)
        steps = [out.logits]
        for i in range(WINDOW - 4, x.shape[1]):
            out = model(x[:, i : i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-4


# as tests/patches/test_chatglm.py METHODS: the scalings that take a factor alone and run on half-rotated heads
@pytest.mark.parametrize(
    "method",
    registered(
        lambda method: frequency_scaling(method) and takes_a_factor_alone(method) and takes_a_partial_rotation(method.name)
    ),
)
def test_unpatch_restores_the_model_exactly(method):
    model = glm("glm4")
    x = random_ids(3 * WINDOW, seed=1)
    before, config = logits(model, x), copy.deepcopy(model.config.to_dict())
    rope_ext.patch(model, method, factor=4)
    assert not torch.equal(logits(model, x), before)
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, x), before)
    assert model.config.to_dict() == config


# A converted ChatGLM2-6B-32K: positions divided by rope_ratio 4, window = max_position_embeddings.
PI = {"rope_type": "linear", "factor": 4.0}


def test_linear_scaled_checkpoint_is_patched_on_top_of_its_scaling(tmp_path):
    model = glm(rope=PI)
    state = model.state_dict()
    info = rope_ext.patch(model, "linear", factor=2)
    assert (info.original_window, info.max_length, info.base) == (WINDOW, 2 * WINDOW, 10000.0)
    x = random_ids(3 * WINDOW, seed=1)
    assert torch.equal(logits(model, x), logits(glm(rope={"rope_type": "linear", "factor": 8.0}, state=state), x))
    rope_ext.patch(model, "ntk", factor=2)
    ntk = glm(rope={**PI, "rope_theta": 10000.0 * 2 ** (8 / 6)}, state=state)
    assert (logits(model, x) - logits(ntk, x)).abs().max() <= 1e-5
    # both have a native form: a plain reload reproduces them
    model.save_pretrained(tmp_path / "ntk")
    assert model.config.rope_parameters["rope_theta"] == ntk_base(position_geometry(model.model.rotary_emb.geometry, 4.0), 2.0)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "ntk").eval(), x), logits(model, x))
    # window-dependent methods see the window in the checkpoint's position units (32 / 4 = 8)
    rope_ext.patch(model, "yarn", factor=2)
    yarn_in_position_units = glm(
        rope={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": WINDOW // 4},
        max_positions=WINDOW // 2,
        state=state,
    )
    yarn_in_position_units.model.rotary_emb.inv_freq /= 4  # then divide positions by the checkpoint's ratio
    assert (logits(model, x) - logits(yarn_in_position_units, x)).abs().max() <= 1e-5
    # no native form for yarn on top of linear: the config keeps the checkpoint's scaling, rope_ext reloads
    checkpoint_rope = glm(rope=PI).config.rope_parameters
    assert model.config.rope_parameters == checkpoint_rope
    model.save_pretrained(tmp_path / "yarn")
    assert torch.equal(logits(rope_ext.from_pretrained(tmp_path / "yarn").eval(), x), logits(model, x))
    rope_ext.unpatch(model)
    assert model.config.rope_parameters == checkpoint_rope and model.config.max_position_embeddings == WINDOW
