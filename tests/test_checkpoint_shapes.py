"""The checkpoints users load most, from configs shaped like their published config.json (issue #26,
item 5): the rope_parameters, window and attention options each checkpoint ships, shrunk to the
census's tiny size (window 64 where the checkpoint's pretraining window is recorded). Each is put
through the census's check (tests/test_census.py): yarn equal to transformers' natively configured
twin, attention-side methods exact inside the window or refused with a listed reason, decode equal to
the full forward, save/reload and unpatch exact. A checkpoint that already carries a scaling is
patched relative to the pretraining window that scaling records."""

from __future__ import annotations

import pytest
from test_census import WINDOW, check, tiny

import rope_ext

SHAPES = {
    # meta-llama/Llama-3.1-8B: llama3 x8 over an 8192-token pretraining window, theta 500000
    "llama-3.1": (
        "llama",
        {
            "max_position_embeddings": WINDOW * 16,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": WINDOW,
            },
        },
    ),
    # Qwen/Qwen2.5-7B-Instruct with the yarn block its model card adds for 128k
    "qwen2.5-yarn": (
        "qwen2",
        {
            "max_position_embeddings": WINDOW,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": WINDOW,
            },
            "use_sliding_window": False,
        },
    ),
    # mistralai/Mistral-7B-v0.1: a 4096-token sliding window in every layer
    "mistral-swa": (
        "mistral",
        {"sliding_window": WINDOW // 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    # mistralai/Mistral-7B-v0.3: no sliding window, theta 1e6
    "mistral-full": ("mistral", {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # google/gemma-2-2b: local/global layers, logit softcaps, query_pre_attn_scalar
    "gemma-2": (
        "gemma2",
        {
            "sliding_window": WINDOW // 2,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # google/gemma-3-4b-it's text model: linear x8 on the global layers over a 32768-token window
    # (a linear scaling records no window: original_window= below), local layers at theta 1e4
    "gemma-3": (
        "gemma3_text",
        {
            "sliding_window": WINDOW // 2,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": WINDOW * 8,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # microsoft/Phi-3.5-mini-instruct: longrope short/long factor lists over a 4096-token window
    "phi-3.5-mini": (
        "phi3",
        {
            "max_position_embeddings": WINDOW * 32,
            "original_max_position_embeddings": WINDOW,
            "sliding_window": WINDOW * 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.02, 1.05, 1.1, 1.3, 1.6, 2.1, 2.7],
                "long_factor": [1.0, 1.3, 2.0, 4.5, 9.0, 18.0, 30.0, 44.0],
                "original_max_position_embeddings": WINDOW,
            },
        },
    ),
    # HuggingFaceTB/SmolLM3-3B: every fourth layer without RoPE
    "smollm3": (
        "smollm3",
        {
            "num_hidden_layers": 4,
            "no_rope_layer_interval": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},
        },
    ),
    # openai/gpt-oss-20b: yarn x32 over 4096 (truncate off), learned sinks, alternating sliding layers
    "gpt-oss": (
        "gpt_oss",
        {
            "max_position_embeddings": WINDOW * 32,
            "sliding_window": WINDOW // 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": WINDOW,
            },
        },
    ),
}

# Attention-side methods each shape refuses, by the reason key (patches/probe.py REASONS, or the
# methods' own refusal of sliding-window layers); every other method patches it exactly.
# what patch() needs of a shape: a linear scaling records no pretraining window
GIVEN = {"gemma-3": {"original_window": WINDOW}}
REFUSED = {
    "gemma-3": {"sink_window": "sliding-window", "dca": "sliding-window"},
    "mistral-swa": {"sink_window": "sliding-window", "dca": "sliding-window"},
    "gemma-2": {"self_extend": "attention", "sink_window": "sliding-window", "dca": "sliding-window"},
    "gpt-oss": {"self_extend": "attention", "sink_window": "sliding-window", "dca": "sliding-window"},
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_published_shapes_are_patched_exactly(shape, tmp_path):
    from test_census import method_reason

    model_type, config = SHAPES[shape]
    model = tiny(model_type, **config)
    assert model is not None, f"{shape} does not build"
    refusals = {}
    assert check(model, tmp_path, refusals, **GIVEN.get(shape, {})) is None
    assert {method: method_reason(message) for method, message in refusals.items()} == REFUSED.get(shape, {})


@pytest.mark.parametrize("shape", ["llama-3.1", "qwen2.5-yarn", "phi-3.5-mini", "gpt-oss"])
def test_a_scaled_checkpoint_is_patched_relative_to_its_pretraining_window(shape):
    model_type, config = SHAPES[shape]
    info = rope_ext.patch(tiny(model_type, **config), "yarn", factor=8)
    assert (info.original_window, info.max_length) == (WINDOW, 8 * WINDOW)


@pytest.mark.parametrize("shape", ["llama-3.1", "qwen2.5-yarn", "phi-3.5-mini", "gpt-oss"])
def test_unpatch_gives_back_the_checkpoint_s_own_scaling(shape):
    model_type, config = SHAPES[shape]
    model = tiny(model_type, **config)
    shipped = dict(model.config.rope_parameters)
    rope_ext.patch(model, "yarn", factor=8)
    rope_ext.unpatch(model)
    assert model.config.rope_parameters == shipped
