"""The probed adapter (patches/probe.py) on the shapes issue #26 names: layers without RoPE left
alone, hybrid stacks, other cos/sin formats and pairings patched exactly; several rotary modules,
frequencies per layer type and a norm after the rotation refused at patch() with the reason,
changing nothing."""

import copy

import pytest
import torch

import rope_ext
from rope_ext.patches.probe import probe

from test_census import WINDOW, check, ids, logits, tiny
from helpers import (
    computes_attention,
    leaves_the_trained_window,
    load_llama,
    patch_params,
    registered,
    rotates_inside_attention,
)

# Each case runs every registered method its declarations (rotation, requirements) select.
INSIDE_ATTENTION = registered(rotates_inside_attention)
COMPUTES_ATTENTION = registered(computes_attention)


def test_nope_layers_are_found_and_left_alone():
    model = tiny("smollm3", no_rope_layers=[1, 0])  # RoPE in the first layer only
    structure = probe(model)
    assert structure.rope == tuple(bool(flag) for flag in model.config.no_rope_layers)
    assert not all(structure.rope) and any(structure.rope)
    x = ids(WINDOW)
    reference = logits(model, x)
    for method in filter(leaves_the_trained_window, INSIDE_ATTENTION):
        patched = copy.deepcopy(model)
        rope_ext.patch(patched, method, factor=4, **patch_params(method, patched))
        assert torch.equal(logits(patched, x), reference), method


@pytest.mark.parametrize(
    "model_type, layout, cos_format",
    [("cohere", "interleaved", "repeated"), ("phi", "half", "cat"), ("glm", "interleaved", "cat")],
)
def test_pairing_and_format_are_probed(model_type, layout, cos_format):
    structure = probe(tiny(model_type))
    assert (structure.layout, structure.cos_format) == (layout, cos_format)


def test_partial_rotary_is_probed():
    model = tiny("phi")  # partial_rotary_factor 0.5
    structure = probe(model)
    assert structure.rotary_dim == structure.head_dim // 2


@pytest.mark.slow  # takes long
def test_hybrid_stack_is_patched_without_attribute_error():
    model = tiny("falcon_h1")  # layers that mix attention and state-space mixers
    x = ids(WINDOW)
    reference = logits(model, x)
    rope_ext.patch(model, "self_extend", factor=4)
    assert torch.equal(logits(model, x), reference)


# Gemma 3's pattern of sliding layers over 2 layers (the census gives it a full-attention one): no
# full-attention frequencies to replace
UNPROVABLE_SHAPES = {"gemma3_text": {"layer_types": ["sliding_attention", "sliding_attention"]}}


@pytest.mark.parametrize(
    "model_type, reason",
    [
        ("moshi", "several rotary embedding modules"),  # one per layer, each rotating full attention
        ("gemma3_text", "rotary frequencies kept per layer type"),
    ],
)
def test_unprovable_models_are_refused_with_the_reason_and_unchanged(model_type, reason):
    model = tiny(model_type, **UNPROVABLE_SHAPES.get(model_type, {}))
    x = ids(WINDOW)
    before, config = logits(model, x), copy.deepcopy(model.config.to_dict())
    with pytest.raises(ValueError, match=f"cannot patch .*{reason}"):
        rope_ext.patch(model, "self_extend", factor=4)
    assert torch.equal(logits(model, x), before)
    assert model.config.to_dict() == config


@pytest.mark.parametrize("model_type", ["hunyuan_v1_dense", "nanochat"])  # a norm after RoPE; another sign of rotate_half
def test_a_rotation_rope_ext_cannot_reproduce_takes_the_static_methods_only(model_type, tmp_path):
    """The model rotates with the module's output itself, which the probe proved is rope-ext's
    (cos, sin): the static methods patch it exactly (the census's check); the methods that rotate
    queries and keys inside attention are refused with the reason, the model unchanged."""
    model = tiny(model_type)
    x = ids(WINDOW)
    before, config = logits(model, x), copy.deepcopy(model.config.to_dict())
    for method in INSIDE_ATTENTION:
        with pytest.raises(
            ValueError, match=f"{method} rotates queries and keys inside attention, and a rotation rope-ext cannot reproduce"
        ):
            rope_ext.patch(model, method, factor=4, **patch_params(method, model))
        assert torch.equal(logits(model, x), before)
        assert model.config.to_dict() == config
    assert check(model, tmp_path, {}) is None


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2", "doge"])  # learned sinks, a softcap, a learned mask
def test_attention_other_than_softmax_refuses_the_methods_that_compute_attention(model_type):
    model = tiny(model_type)
    x = ids(WINDOW)
    before, config = logits(model, x), copy.deepcopy(model.config.to_dict())
    for method in COMPUTES_ATTENTION:
        # sink_window and dca refuse a model with sliding-window layers (gpt_oss, gemma2) first
        refusal = "the model's attention is not causal softmax attention|the model's layers attend through a sliding"
        with pytest.raises(ValueError, match=f"{method}: ({refusal})"):
            rope_ext.patch(model, method, factor=4, **patch_params(method, model))
        assert torch.equal(logits(model, x), before)
        assert model.config.to_dict() == config
    for method in registered(lambda method: not computes_attention(method)):
        rope_ext.patch(copy.deepcopy(model), method, factor=4, **patch_params(method, model))


def test_a_native_form_the_model_reads_otherwise_is_not_written():
    model = tiny("phi3")  # Phi3Config turns a yarn rope_type into longrope
    info = rope_ext.patch(model, "yarn", factor=4)
    assert info.native is None
    assert model.config.rope_parameters["rope_type"] == "default"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_attention_check_holds_in_half_precision(tiny_path, dtype):
    """The check compares attention in fp32: in bf16 scores of tens round by a tenth, which failed a
    plain LLaMA (SmolLM2 in bf16 was refused every attention-side method) and let Gemma 2's softcap pass."""
    model = load_llama(tiny_path).to(dtype)
    for method in COMPUTES_ATTENTION:
        rope_ext.patch(model, method, factor=4, **patch_params(method, model))
        rope_ext.unpatch(model)
    softcapped = tiny("gemma2").to(dtype)
    with pytest.raises(ValueError, match="self_extend: the model's attention is not causal softmax attention"):
        rope_ext.patch(softcapped, "self_extend", factor=4)


@pytest.mark.parametrize("method", registered(lambda method: method.requires.keys_by_position))
def test_a_sliding_window_key_the_architecture_never_applies_refuses_nothing(method):
    """A stray `sliding_window` on a LLaMA config, which LlamaAttention never reads (issue #51
    item 7): a forward past it shows every key attended, so the methods that choose keys by
    position take the model, as they take it without the key."""
    from helpers import random_ids, random_model

    model = random_model("llama", sliding_window=16)
    reference = random_model("llama")
    x = random_ids(3 * 64)
    for each in (model, reference):
        rope_ext.patch(each, method, factor=4, **patch_params(method, each))
    assert torch.equal(logits(model, x), logits(reference, x))
