"""Llama 4's attention temperature as a parameter of the methods whose attention rotates each query
itself (`attn_scale`, `floor_scale`; rope_ext.attention.Rotator.temper, docs/logn.md):
the rotated query at position p times 1 + attn_scale * log1p(floor((p + 1) / floor_scale)), as
transformers 5's Llama4TextAttention.forward computes it (models/llama4/modeling_llama4.py, under
attn_temperature_tuning) and Ministral3Attention (models/ministral3/modeling_ministral3.py,
get_llama_4_attn_scale with rope_parameters' llama_4_scaling_beta, which counts p instead of p + 1).

Random fp32 models, norm weights moved from 1."""

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import rope_ext
from rope_ext.method import REGISTRY
from rope_ext.method.attention_side import AttentionMethod

from census_configs import norms_moved
from helpers import WINDOW, assert_refused_unchanged, random_ids, random_model

BETA, FLOOR = 0.1, 16  # Llama 4 Scout states attn_scale 0.1 and floor_scale 8192 over a window of 8192


def llama4_temperature(module, query, key, value, attention_mask, **kwargs):
    """sdpa after the query scale of Llama4TextAttention.forward (transformers 5,
    modeling_llama4.py): positions of a forward from 0 without a cache, log1p(floor((p + 1.0) /
    floor_scale)) * attn_scale + 1.0 in fp32, multiplied in and cast back to the query's dtype."""
    positions = torch.arange(query.shape[-2], device=query.device)
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / FLOOR)) * BETA + 1.0
    query = (query * scales.view(1, 1, -1, 1)).to(query.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("llama4_temperature", llama4_temperature)


def model():
    return norms_moved(random_model("llama"))


# every method with the query scales; those of them that attend themselves
QUERY_SCALED = [name for name, m in REGISTRY.items() if m.takes_query_scales]
ATTENDING = [name for name in QUERY_SCALED if isinstance(REGISTRY[name], AttentionMethod)]


@pytest.mark.parametrize("method", QUERY_SCALED)
def test_matches_transformers_llama4_bit_for_bit_inside_the_window(method):
    """Inside the window every method here rotates as the unpatched model: with the temperature
    stepping at 15, 31 and 47 the fp32 logits are transformers' Llama 4 computation's, bit for bit."""
    ids = random_ids(WINDOW)
    reference = model()
    reference.config._attn_implementation = "llama4_temperature"
    patched = model()
    rope_ext.patch(patched, method, factor=4, attn_scale=BETA, floor_scale=FLOOR)
    with torch.no_grad():
        ours, theirs = patched(ids).logits, reference(ids).logits
        plain = model()(ids).logits
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, plain)


@pytest.mark.parametrize("method", ATTENDING)
def test_decoding_past_the_window_equals_one_forward(method):
    """The scale follows each query's own position, so a prefill of 150 tokens and 50 decode steps
    give the logits of one forward over the same 200 tokens."""
    patched, ids = model(), random_ids(200)
    rope_ext.patch(patched, method, factor=4, attn_scale=BETA)  # floor_scale: the trained window
    with torch.no_grad():
        full = patched(ids).logits
        cache = DynamicCache(config=patched.config)
        patched(ids[:, :150], cache=cache, use_cache=True)
        steps = torch.cat([patched(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(150, 200)], 1)
    assert (steps - full[:, 150:]).abs().max() < 1e-5


def test_off_by_default_and_attn_scale_zero_is_the_method_alone():
    ids = random_ids(3 * WINDOW)
    with torch.no_grad():
        logits = []
        for params in ({}, {"attn_scale": 0.0, "floor_scale": 8}):
            patched = model()
            rope_ext.patch(patched, "self_extend", factor=4, **params)
            logits.append(patched(ids).logits)
    assert torch.equal(*logits)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attn_scale": -0.1}, "attn_scale must be a finite number >= 0"),
        ({"attn_scale": float("inf")}, "attn_scale.* must be a finite number"),
        ({"attn_scale": 0.1, "floor_scale": 0}, "floor_scale .* must be an int in"),
        ({"attn_scale": 0.1, "floor_scale": 2.5}, "floor_scale .* must be an int in"),
    ],
)
def test_bad_parameters_change_nothing(kwargs, message):
    assert_refused_unchanged("dca", {"factor": 4, **kwargs}, message)
    assert_refused_unchanged("dynamic", {"factor": 4, **kwargs}, message)


def test_methods_that_do_not_rotate_each_query_refuse_it():
    assert_refused_unchanged("yarn", {"factor": 4, "attn_scale": 0.1}, "unknown parameter")
