"""LongRoPE with given factor lists, transformers' `proportional` (Gemma 4's p-RoPE) and HunYuan's
`ntk_alpha` (issue #26): each against transformers' own computation, logits against a natively
configured twin on the tiny trained model, LongRoPE's causal schedule under the KV cache, and what
a save and a plain transformers reload reproduce. The frequency contract rows are in
tests/method/test_methods.py."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, HunYuanDenseV1Config
from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

import rope_ext
from rope_ext import method as methods
from rope_ext.geometry import RotaryGeometry
from rope_ext.method.base import ModelFacts

from helpers import WINDOW, assert_refused_unchanged, cached_logits, logits, native_twin, random_ids, random_model

PAIRS = 16  # the tiny model's head: 32 rotated channels
SHORT = torch.linspace(1.0, 1.25, PAIRS).tolist()
LONG = torch.linspace(1.0, 6.0, PAIRS).tolist()


def longrope_parameters(window: int, **extra) -> dict:
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": window,
        "short_factor": SHORT,
        "long_factor": LONG,
        **extra,
    }


@pytest.mark.parametrize("attention_factor", [None, 1.3])
def test_single_forward_matches_native_longrope_bit_for_bit(tiny_model, heldout_ids, attention_factor):
    """transformers picks the short or long set for a whole forward; so does causal=False at any
    length, and the causal schedule inside the window."""
    window = tiny_model.config.max_position_embeddings
    extra = {} if attention_factor is None else {"attention_factor": attention_factor}
    native = native_twin(tiny_model, longrope_parameters(window, **extra), 4 * window)
    causal = rope_ext.from_pretrained(tiny_model.name_or_path, dtype=torch.float32).eval()
    info = rope_ext.patch(causal, "longrope", factor=4, short_factor=SHORT, long_factor=LONG, **extra)
    rope_ext.patch(tiny_model, "longrope", factor=4, short_factor=SHORT, long_factor=LONG, causal=False, **extra)
    assert info.native == longrope_parameters(window, **extra)
    for length in (window // 2, window, 3 * window + 5):
        x = heldout_ids[None, :length]
        assert torch.equal(logits(tiny_model, x), logits(native, x)), length
        if length <= window:
            assert torch.equal(logits(causal, x), logits(native, x)), length


def test_causal_schedule_one_forward_equals_chunked_prefill_and_decoding(tiny_model, heldout_ids):
    """The row at p < L reads with the short set, past it with the long one, keys rotated with the
    reading row's set: a forward's logits do not depend on how the input was split."""
    window = tiny_model.config.max_position_embeddings
    rope_ext.patch(tiny_model, "longrope", factor=4, short_factor=SHORT, long_factor=LONG)
    ids = heldout_ids[None, : 3 * window]
    prefill = window - 8
    with torch.no_grad():
        full = tiny_model(ids).logits
    chunked = cached_logits(tiny_model, ids, step=window - 3)
    decoded = cached_logits(tiny_model, ids, step=1, prefill=prefill)
    assert (chunked - full).abs().max() <= 1e-4
    assert (decoded - full[:, prefill:]).abs().max() <= 1e-4
    # and rows inside the window do not see the long set the later rows switch to
    with torch.no_grad():
        assert torch.equal(tiny_model(ids[:, :window]).logits, full[:, :window])


def test_chunked_generation_runs_without_a_granularity_warning(recwarn):
    """Two sets of frequencies attend a chunk in at most two groups: nothing to warn about."""
    model = random_model()
    rope_ext.patch(model, "longrope", factor=4, long_factor=[3.0] * 8)
    prompt = random_ids(2 * WINDOW)
    out = rope_ext.chunked_generate(model, prompt, 16, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0))
    assert not [w for w in recwarn if "re-scales" in str(w.message)]


@torch.no_grad()
def test_transformers_longrope_under_its_own_cache_is_neither_its_forward_nor_ours(tiny_model, heldout_ids):
    """What the causal schedule replaces, measured on the same model: transformers' LLaMA with
    longrope decodes past L with the keys cached under the short set, so its logits leave those of
    its own full forward over the prefix (what Phi-3's re-prefill computes)."""
    window = tiny_model.config.max_position_embeddings
    native = native_twin(tiny_model, longrope_parameters(window), 4 * window)
    ids = heldout_ids[None, : window + 24]
    prefill = window - 4
    decoded = cached_logits(native, ids, step=1, prefill=prefill)
    reprefill = torch.stack([native(ids[:, : t + 1]).logits[0, -1] for t in range(prefill, ids.shape[1])])[None]
    assert (decoded[:, :4] - reprefill[:, :4]).abs().max() <= 1e-5  # inside the window: the short set throughout
    assert (decoded - reprefill).abs().max() > 1e-2


def test_save_and_plain_reload(tiny_model, heldout_ids, tmp_path):
    """config.json carries transformers' own longrope: a plain reload is transformers' schedule
    (the patch's own inside the window, causal=False's past it); rope_ext.from_pretrained is the
    causal patch."""
    window = tiny_model.config.max_position_embeddings
    reference = rope_ext.from_pretrained(tiny_model.name_or_path, dtype=torch.float32).eval()
    rope_ext.patch(reference, "longrope", factor=4, short_factor=SHORT, long_factor=LONG, causal=False)
    rope_ext.patch(tiny_model, "longrope", factor=4, short_factor=SHORT, long_factor=LONG)
    tiny_model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert plain.config.rope_parameters == longrope_parameters(window)
    assert plain.config.max_position_embeddings == 4 * window
    reloaded = rope_ext.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert rope_ext.describe(reloaded) == rope_ext.describe(tiny_model)
    short, long = heldout_ids[None, :window], heldout_ids[None, : 3 * window]
    assert torch.equal(logits(plain, short), logits(tiny_model, short))
    assert torch.equal(logits(plain, long), logits(reference, long))
    assert torch.equal(logits(reloaded, long), logits(tiny_model, long))


def test_short_factor_defaults_to_the_trained_frequencies():
    """(the random model rotates 8 pairs)"""
    info = rope_ext.patch(random_model(), "longrope", factor=4, long_factor=[2.0] * 8)
    assert info.params["short_factor"] == [1.0] * 8
    assert info.native["short_factor"] == [1.0] * 8


@pytest.mark.parametrize(
    "params,message",
    [
        ({}, "long_factor is required"),
        ({"long_factor": [2.0] * 3}, r"long_factor has 3 entries; this model rotates 8 pairs"),
        ({"long_factor": [2.0] * 8, "short_factor": [1.0] * 9}, "short_factor has 9 entries"),
        ({"long_factor": [2.0] * 7 + [float("nan")]}, r"long_factor\[7\] must be a finite number"),
        ({"long_factor": [2.0] * 7 + [0.0]}, r"long_factor\[7\] must be a finite number in \[1/1048576, "),
        ({"long_factor": "2,2"}, "long_factor must be a non-empty list of numbers"),
        ({"long_factor": [2.0] * 7 + ["2"]}, r"long_factor\[7\] must be a number"),
        ({"long_factor": [2.0] * 8, "attention_factor": -1.0}, "attention_factor must be in"),
        ({"long_factor": [2.0] * 8, "granularity": 4}, "unknown parameter"),
    ],
)
def test_bad_longrope_input_is_refused_and_changes_nothing(params, message):
    assert_refused_unchanged("longrope", {"factor": 4, **params}, message)


def test_factor_lists_of_other_types_are_stored_as_python_floats():
    info = rope_ext.patch(random_model(), "longrope", factor=4, long_factor=torch.arange(1, 9), short_factor=(1,) * 8)
    assert info.params["long_factor"] == [float(i) for i in range(1, 9)]
    assert all(type(v) is float for v in info.params["long_factor"] + info.params["short_factor"])


# proportional: transformers' own type, with a native twin


def test_proportional_matches_native_twin_and_reloads_plainly(tiny_model, heldout_ids, tmp_path):
    window = tiny_model.config.max_position_embeddings
    rope = {"rope_type": "proportional", "factor": 4.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    native = native_twin(tiny_model, rope, 4 * window)
    info = rope_ext.patch(tiny_model, "proportional", factor=4, partial_rotary_factor=0.5)
    assert info.native == rope
    x = heldout_ids[None, : 3 * window]
    assert torch.equal(logits(tiny_model, x), logits(native, x))
    assert torch.equal(tiny_model.model.rotary_emb.inv_freq, native.model.rotary_emb.inv_freq)
    assert (tiny_model.model.rotary_emb.inv_freq[PAIRS // 2 :] == 0).all()
    tiny_model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(logits(plain, x), logits(tiny_model, x))


@pytest.mark.parametrize(
    "params,message",
    [
        ({"partial_rotary_factor": 0.0}, r"partial_rotary_factor must be in \(0, 1\]"),
        ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be in \(0, 1\]"),
        ({"partial_rotary_factor": 0.1}, "leaves no pair of the 16 rotated channels turning"),
    ],
)
def test_bad_proportional_input_is_refused_and_changes_nothing(params, message):
    assert_refused_unchanged("proportional", {"factor": 4, **params}, message)


def test_proportional_refuses_a_partly_rotated_head():
    spec = methods.get("proportional")
    facts = ModelFacts("glm", "sdpa", 4, True, True)
    with pytest.raises(ValueError, match="rotates 16 of 32 channels per head; proportional RoPE needs a fully rotated head"):
        spec.resolve(facts, RotaryGeometry(16, 1e4, 128, head_dim=32), 4.0, spec.validate(4, {}))


# ntk_alpha: HunYuan's computation; on LLaMA its native form is the default type at the new base


@pytest.mark.parametrize("head_dim,alpha", [(16, 1000.0), (32, 4.0), (128, 50.0)])
def test_ntk_alpha_matches_hunyuan_bit_for_bit(head_dim, alpha):
    config = HunYuanDenseV1Config(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "dynamic", "alpha": alpha, "factor": 1.0, "rope_theta": 10000.0},
    )
    hunyuan = HunYuanDenseV1RotaryEmbedding(config)
    assert hunyuan.rope_type == "ntk_alpha"
    expected, expected_factor = HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters(config)
    spec = methods.get("ntk_alpha")
    ours, factor = spec(RotaryGeometry(head_dim, 10000.0, 4096), None, 4.0, spec.validate(4, {"alpha": alpha}))
    assert torch.equal(ours, expected)
    assert torch.equal(ours, hunyuan.inv_freq)
    assert factor == expected_factor == hunyuan.attention_scaling


def test_ntk_alpha_matches_its_native_form_and_reloads_plainly(tiny_model, heldout_ids, tmp_path):
    window = tiny_model.config.max_position_embeddings
    base = 10000.0 * 8.0 ** (32 / 30)
    native = native_twin(tiny_model, {"rope_type": "default", "rope_theta": base}, 4 * window)
    info = rope_ext.patch(tiny_model, "ntk_alpha", factor=4, alpha=8.0)
    assert info.native == {"rope_type": "default", "rope_theta": base}
    x = heldout_ids[None, : 3 * window]
    assert torch.equal(logits(tiny_model, x), logits(native, x))
    tiny_model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(logits(plain, x), logits(tiny_model, x))


@pytest.mark.parametrize(
    "params,message",
    [
        ({}, "alpha is required"),
        ({"alpha": 0.5}, "alpha must be a finite number >= 1"),
        ({"alpha": "8"}, "alpha must be a number"),
    ],
)
def test_bad_ntk_alpha_input_is_refused_and_changes_nothing(params, message):
    assert_refused_unchanged("ntk_alpha", {"factor": 4, **params}, message)


def test_longrope_attention_factor_is_transformers_default():
    spec = methods.get("longrope")
    geom = RotaryGeometry(2 * PAIRS, 1e4, WINDOW)
    _, scale = spec(geom, None, 4.0, spec.validate(4, {"long_factor": LONG, "short_factor": SHORT}))
    assert scale == math.sqrt(1 + math.log(4.0) / math.log(WINDOW))


def test_causal_decoding_uses_the_long_set_from_position_L():
    """Position L - 1 is the last row of the short set: the first long row is p = L (the random
    model: a window of WINDOW, 8 rotated pairs)."""
    model = random_model()
    rope_ext.patch(model, "longrope", factor=4, long_factor=[3.0] * 8)
    rotation = model.model.rotary_emb.rotation
    lengths = rotation.scaled_lengths(torch.arange(WINDOW - 2, WINDOW + 2)[None])
    frequencies = [rotation.frequencies(int(n))[0] for n in lengths[0]]
    assert torch.equal(frequencies[0], frequencies[1]) and torch.equal(frequencies[2], frequencies[3])
    assert not torch.equal(frequencies[1], frequencies[2])
    ids = random_ids(WINDOW + 4)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :WINDOW], cache=cache, use_cache=True)
        assert torch.allclose(
            model(ids[:, WINDOW:], cache=cache, use_cache=True).logits, model(ids).logits[:, WINDOW:], atol=1e-5
        )
