"""Several rotary modules (docs/families.md): the probe finds which module rotates which attention
layers by one identity run per module. Granite-SWA keeps one module per RoPE base beside an unused
global one: the module of the full-attention layers is patched, the sliding layers' kept; a model
whose modules each rotate full-attention layers (Moshi, BLT) or that keep frequencies per layer
type beside others (DeepSeek-V4, Gemma 4) is refused with what was found."""

from __future__ import annotations

import copy

import pytest
import torch

import rope_ext
from rope_ext.patches.probe import REASONS, probe

from census_configs import WINDOW, ids, tiny
from helpers import leaves_the_trained_window, registered
from test_census import check, decode_gap, equal_models, logits

TYPES = ("granite_swa", "granitemoe_swa")
THETAS = {"sliding_attention": 10000.0, "full_attention": 1000000.0}


def two_bases(model_type):
    """A sliding layer at one base and a full-attention layer at another: one module each."""
    layer_types = ["sliding_attention", "full_attention"]
    return tiny(model_type, layer_types=layer_types, layer_rope_theta=[THETAS[t] for t in layer_types], sliding_window=16)


def yarn_twin(model, factor=4):
    """`model` with its full-attention module rebuilt by transformers' own class from a yarn config
    at that module's base: the patch as transformers computes it, the sliding module untouched."""
    twin = copy.deepcopy(model)
    rotary = twin.model.rotary_embs[1]
    config = copy.deepcopy(rotary.config)
    config.rope_parameters = {
        **config.rope_parameters,
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": WINDOW,
    }
    twin.model.rotary_embs[1] = type(rotary)(config)
    return twin


@pytest.mark.parametrize("model_type", TYPES)
def test_the_probe_finds_which_module_rotates_which_layer(model_type):
    structure = probe(two_bases(model_type))
    assert structure.rotary == "model.rotary_embs.1"
    assert structure.kept_rotary == ("model.rotary_embs.0",)
    assert structure.unused_rotary == ("model.rotary_emb",)
    assert structure.rope == (False, True)
    assert structure.layer_types == ("sliding_attention", "full_attention")
    assert structure.rope_theta == THETAS["full_attention"]


@pytest.mark.parametrize("model_type", TYPES)
def test_yarn_patches_the_full_attention_module_exactly_and_keeps_the_sliding_one(model_type, tmp_path):
    model = two_bases(model_type)
    plain = copy.deepcopy(model)
    past, inside = ids(WINDOW + 36, seed=1), ids(WINDOW)
    kept = plain.model.rotary_embs[0](torch.zeros(1), torch.arange(100)[None])
    info = rope_ext.patch(model, "yarn", factor=4)
    # a yarn rope_parameters would reach the sliding module too: no native form, the config unchanged
    assert info.native is None
    assert model.config.rope_parameters == plain.config.rope_parameters
    assert info.layer_types == {
        "patched": ["full_attention"],
        "kept": ["sliding_attention"],
        "rotary": {"patched": ["model.rotary_embs.1"], "kept": ["model.rotary_embs.0"], "unused": ["model.rotary_emb"]},
    }
    assert rope_ext.describe(model)["layer_types"] == info.layer_types
    assert all(torch.equal(a, b) for a, b in zip(model.model.rotary_embs[0](torch.zeros(1), torch.arange(100)[None]), kept))
    assert torch.equal(logits(model, past), logits(yarn_twin(plain), past))
    assert decode_gap(model, past[:, : WINDOW + 8], WINDOW - 4) <= 1e-4
    model.save_pretrained(tmp_path)
    assert torch.equal(logits(rope_ext.from_pretrained(tmp_path).eval(), past), logits(model, past))
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, inside), logits(plain, inside))
    restored, own = model.model.rotary_embs[1], plain.model.rotary_embs[1]
    assert type(restored) is type(own) and torch.equal(restored.inv_freq, own.inv_freq)


# the methods whose frequencies follow the length and that leave the trained window as it was
@pytest.mark.parametrize("method", registered(lambda method: method.follows_length and leaves_the_trained_window(method.name)))
def test_methods_rotating_inside_attention_leave_the_first_window_and_the_sliding_layer_alone(method):
    """Inside the window a dynamic method rotates by the trained frequencies: bit-equal only if the
    full-attention layer gets its own base (1e6) and the sliding layer keeps its rotation (1e4)."""
    model = two_bases("granite_swa")
    plain = copy.deepcopy(model)
    inside, past = ids(WINDOW), ids(WINDOW + 36, seed=1)
    rope_ext.patch(model, method, factor=4)
    assert torch.equal(logits(model, inside), logits(plain, inside))
    assert decode_gap(model, past[:, : WINDOW + 8], WINDOW - 4) <= 1e-4
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, inside), logits(plain, inside))


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("shape", ["census", "two bases"])
def test_the_census_check_passes(model_type, shape, tmp_path):
    """The census's own check (tests/patches/test_census.py): one base for both layers (the census config:
    the one module in use is patched, with a native form) and two bases."""
    model = tiny(model_type) if shape == "census" else two_bases(model_type)
    refusals = {}
    assert check(model, tmp_path, refusals) is None
    assert set(refusals) == {"self_extend", "sink_window", "dca"}
    assert REASONS["attention"] in refusals["self_extend"]  # learned sinks
    assert all("sliding window" in refusals[method] for method in ("sink_window", "dca"))


@pytest.mark.parametrize(
    "model_type, found",
    [
        ("moshi", "2 of them rotate full-attention layers"),
        ("blt", "4 of them rotate full-attention layers"),
        ("deepseek_v4", "`model.rotary_emb` holds main_inv_freq"),
        ("gemma4", "`model.language_model.rotary_emb` holds full_attention_inv_freq"),
    ],
)
def test_models_whose_modules_cannot_be_told_apart_are_refused_with_what_was_found(model_type, found):
    model = tiny(model_type)
    plain = copy.deepcopy(model)
    with pytest.raises(ValueError, match=REASONS["several-rotary"]) as refused:
        rope_ext.patch(model, "yarn", factor=4)
    assert found in str(refused.value)
    assert equal_models(model, plain)


def test_a_layer_of_base_0_is_left_without_rotation():
    """Granite-SWA's base 0 (NoPE): the layer no module rotates, beside a kept and a patched one."""
    layer_types = ["sliding_attention", "full_attention", "full_attention"]
    model = tiny("granite_swa", num_hidden_layers=3, layer_types=layer_types, layer_rope_theta=[1e4, 1e6, 0], sliding_window=16)
    structure = probe(model)
    assert structure.rope == (False, True, False)
    assert structure.layer_types == ("sliding_attention", "full_attention", None)
    assert structure.nope_attention == ("model.layers.0.self_attn", "model.layers.2.self_attn")
