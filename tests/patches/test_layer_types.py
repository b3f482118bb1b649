"""Rotary frequencies kept per layer type (`{layer_type}_inv_freq`, rope_parameters nested by layer
type: Gemma 3, OLMo 3, Laguna, ModernBERT-decoder, Mellum, MiMo-V2-Flash): a patch replaces the
full-attention layers' frequencies, as transformers applies a legacy `rope_scaling` to Gemma 3's
global layers, and keeps the sliding-window layers' (docs/families.md).

The models are the census's tiny random fp32 models (tests/patches/test_census.py `tiny`, norm weights
moved from 1), with both layer types where two layers of the model's own pattern would give one;
no per-layer-type architecture takes the tiny trained LLaMA's weights."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import rope_ext
from rope_ext.patches.probe import REASONS, probe

from helpers import leaves_the_trained_window, registered
from test_census import DECODE_TOLERANCE, WINDOW, decode_gap, equal_models, ids, logits, tiny, twin_of

# Sliding layers that slide within the tests' lengths (their configs' windows are longer).
SLIDING = 16
BOTH = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=SLIDING)
# Gemma 3's default pattern over 2 layers (the census gives it a full-attention one)
TWO_SLIDING = ["sliding_attention", "sliding_attention"]
# model type -> the overrides of the census shrink that give it full-attention layers with RoPE
MODELS = {
    "gemma3_text": BOTH,
    "olmo3": BOTH,
    "laguna": BOTH,
    "modernbert-decoder": dict(sliding_window=SLIDING),
    "mellum": {},
    # 24 * 0.334 rounds down to 8 rotated channels (16 * 0.334 to an odd 5: refused below)
    "mimo_v2_flash": dict(head_dim=24, sliding_window=SLIDING),
}
FREQUENCY_METHODS = ["linear", "ntk", "yarn", "llama3"]
# what the full-attention entry of rope_parameters holds after each
NATIVE_TYPES = {"linear": "linear", "ntk": "default", "yarn": "yarn", "llama3": "llama3"}


def build(model_type: str):
    model = tiny(model_type, **MODELS[model_type])
    assert model is not None, f"{model_type} does not build with the census shrink"
    return model


def positions_of(model, layer_type: str, length: int = WINDOW + 36):
    x = torch.zeros(1)
    return model.model.rotary_emb(x, torch.arange(length)[None], layer_type)


@pytest.mark.parametrize("method", FREQUENCY_METHODS)
@pytest.mark.parametrize("model_type", list(MODELS))
def test_frequency_methods_patch_the_full_attention_layers_as_transformers_native_twin(model_type, method, tmp_path):
    plain = build(model_type)
    model = copy.deepcopy(plain)
    rope_before = copy.deepcopy(plain.config.rope_parameters)
    inside, past = ids(WINDOW), ids(WINDOW + 36, seed=1)
    reference = logits(plain, inside)

    info = rope_ext.patch(model, method, factor=4)

    assert info.layer_types["patched"] == ["full_attention"]
    assert info.native is not None
    rope = model.config.rope_parameters
    # the nested dict keeps its shape: the full-attention entry updated, every other as it was
    assert sorted(rope) == sorted(rope_before)
    assert all(rope[t] == rope_before[t] for t in rope if t != "full_attention")
    assert rope["full_attention"]["rope_type"] == NATIVE_TYPES[method]
    config = copy.deepcopy(model.config)
    del config.rope_ext
    twin = twin_of(plain, config)
    for x in (inside, past):
        assert torch.equal(logits(model, x), logits(twin, x))
    for kept in info.layer_types["kept"]:  # the sliding-window layers rotate as before
        assert all(torch.equal(a, b) for a, b in zip(positions_of(model, kept), positions_of(plain, kept)))
    assert decode_gap(model, past[:, : WINDOW + 8], WINDOW - 4) <= DECODE_TOLERANCE

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a native form: the save gives no warning
        model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path).eval()
    assert torch.equal(logits(reloaded, past), logits(model, past))
    assert rope_ext.describe(reloaded) == rope_ext.describe(model)
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, inside), reference)
    assert model.config.rope_parameters == rope_before


def test_patch_info_and_describe_name_the_patched_and_kept_layer_types():
    model = build("gemma3_text")
    structure = probe(model)
    assert structure.layer_types == ("sliding_attention", "full_attention")
    assert structure.rope == (False, True)

    info = rope_ext.patch(model, "yarn", factor=4)

    expected = {"patched": ["full_attention"], "kept": ["sliding_attention"]}
    assert info.layer_types == info.to_dict()["layer_types"] == expected
    assert rope_ext.describe(model)["layer_types"] == expected
    # a model with one set of frequencies names none
    llama = tiny("llama")
    info = rope_ext.patch(llama, "yarn", factor=4)
    assert info.layer_types is None and "layer_types" not in info.to_dict()
    assert "layer_types" not in rope_ext.describe(llama)


# the methods whose frequencies follow the length and that leave the trained window as it was
@pytest.mark.parametrize("method", registered(lambda method: method.follows_length and leaves_the_trained_window(method.name)))
@pytest.mark.parametrize("model_type", ["gemma3_text", "modernbert-decoder"])
def test_dynamic_methods_rotate_each_layer_type_with_its_own_frequencies(model_type, method):
    """Inside the window a dynamic method rotates by the trained frequencies: the sliding layers
    (theta 1e4) and the full-attention layers (Gemma 3: theta 1e6, ModernBERT: 1.6e5) each by
    their own, or the logits move. Gemma 3's first layer slides, ModernBERT's second."""
    plain = build(model_type)
    model = copy.deepcopy(plain)
    inside, past = ids(WINDOW), ids(WINDOW + 36, seed=1)

    info = rope_ext.patch(model, method, factor=4)

    assert info.layer_types == {"patched": ["full_attention"], "kept": ["sliding_attention"]}
    assert torch.equal(logits(model, inside), logits(plain, inside))
    assert decode_gap(model, past[:, : WINDOW + 8], WINDOW - 4) <= DECODE_TOLERANCE
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, inside), logits(plain, inside))


def test_a_repatch_replaces_the_full_attention_frequencies_and_keeps_the_others():
    plain = build("gemma3_text")
    once, twice = copy.deepcopy(plain), copy.deepcopy(plain)
    past = ids(WINDOW + 36, seed=1)
    rope_ext.patch(once, "linear", factor=4)
    rope_ext.patch(twice, "yarn", factor=2)

    info = rope_ext.patch(twice, "linear", factor=4)

    assert info.layer_types == {"patched": ["full_attention"], "kept": ["sliding_attention"]}
    assert torch.equal(logits(twice, past), logits(once, past))
    assert twice.config.rope_parameters == once.config.rope_parameters
    rope_ext.unpatch(twice)
    assert torch.equal(logits(twice, past), logits(plain, past))
    assert twice.config.rope_parameters == plain.config.rope_parameters


@pytest.mark.parametrize(
    ("model_type", "method"),
    [
        ("gemma3_text", "self_extend"),
        ("gemma3_text", "rerope"),
        ("olmo3", "self_extend"),
        ("modernbert-decoder", "self_extend"),
        ("mellum", "self_extend"),
        ("mellum", "sink_window"),
        ("mellum", "dca"),
    ],
)
def test_attention_side_methods_leave_the_first_window_exact(model_type, method):
    """The layers that rotate with the full-attention frequencies attend through the method, the
    others as before; inside the window the logits are the model's own, bit for bit."""
    plain = build(model_type)
    model = copy.deepcopy(plain)
    inside, past = ids(WINDOW), ids(WINDOW + 36, seed=1)

    rope_ext.patch(model, method, factor=4)

    assert torch.equal(logits(model, inside), logits(plain, inside))
    assert decode_gap(model, past[:, : WINDOW + 8], WINDOW - 4) <= DECODE_TOLERANCE
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, inside), logits(plain, inside))


@pytest.mark.parametrize("method", registered(lambda method: method.requires.keys_by_position))
def test_methods_that_choose_keys_by_position_still_refuse_sliding_window_layers(method):
    plain = build("gemma3_text")
    model = copy.deepcopy(plain)
    with pytest.raises(ValueError, match="sliding window"):
        rope_ext.patch(model, method, factor=4)
    assert equal_models(model, plain)


@pytest.mark.parametrize(
    ("model_type", "overrides", "reason", "detail"),
    [
        # two sliding layers of Gemma 3's pattern: no full-attention frequencies to replace
        ("gemma3_text", {"layer_types": TWO_SLIDING}, "per-layer-type", "holds sliding_attention_inv_freq"),
        ("dory", {}, "per-layer-type", "holds sliding_attention_inv_freq"),
        # full-attention layers without RoPE: the patch would change nothing
        ("beam", {}, "per-layer-type", "holds sliding_attention_inv_freq"),
        ("deepseek_v4", {}, "several-rotary", "compressor.rotary_emb"),
        ("gemma4_unified_text", {}, "per-layer-config", "head_dim"),
        # int(16 * 0.334) = 5: exponents over an odd size, which no rotary geometry states
        ("mimo_v2_flash", {"head_dim": 16}, "frequencies", "rotary dim 6"),
    ],
)
def test_what_cannot_be_patched_exactly_is_refused_with_a_listed_reason(model_type, overrides, reason, detail):
    plain = tiny(model_type, **overrides)
    model = copy.deepcopy(plain)
    with pytest.raises(ValueError) as raised:
        rope_ext.patch(model, "yarn", factor=4)
    message = str(raised.value)
    assert REASONS[reason] in message and detail in message, message
    assert equal_models(model, plain)
