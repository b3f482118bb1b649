"""Composite configs (issue #26): a vision-language or speech model whose causal LM runs its text
model on a text sub-config (`config.text_config`) keeps its rope_parameters there, not in the
composite config. The patch reads the sub-config its rotary module was built from and writes its
native form and its record there, which a save puts inside the composite config.json, where
transformers reloads them.

Tiny random fp32 models of the census (tests/census_configs.py), norm weights moved from 1; a
window of 64 tokens. got_ocr2's text config runs on sdpa beside an eager composite config."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Llama4Config,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
    Llama4VisionConfig,
)

import rope_ext
from rope_ext.patches.probe import REASONS

from census_configs import SHRINK, WINDOW, ids, logits, tiny

COMPOSITE_TYPES = ["got_ocr2", "fuyu", "moss_transcribe_diarize"]


def saved(model, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", COMPOSITE_TYPES)
def test_a_composite_model_is_patched_in_its_text_config_and_reloads_exactly(model_type, tmp_path):
    model = tiny(model_type)
    original = copy.deepcopy((model.config.text_config.rope_parameters, model.config.text_config.max_position_embeddings))
    inside, past = ids(WINDOW), ids(WINDOW + 36, seed=1)
    reference = logits(model, inside)
    plain = copy.deepcopy(model)

    info = rope_ext.patch(model, "yarn", factor=4)
    text = model.config.text_config
    assert info.native is not None and info.model_type == model_type
    assert text.rope_parameters["rope_type"] == "yarn" and text.rope_ext["method"] == "yarn"
    assert not hasattr(model.config, "rope_ext")

    config = copy.deepcopy(model.config)
    del config.text_config.rope_ext
    twin = type(model)(config).eval()
    twin.load_state_dict(plain.state_dict())
    assert torch.equal(logits(model, past), logits(twin, past))

    path = saved(model, tmp_path / "yarn")
    transformers_alone = AutoModelForCausalLM.from_pretrained(path).eval()
    assert torch.equal(logits(transformers_alone, past), logits(model, past))
    reloaded = rope_ext.from_pretrained(path).eval()
    assert rope_ext.describe(reloaded) == rope_ext.describe(model)
    assert torch.equal(logits(reloaded, past), logits(model, past))

    rope_ext.unpatch(model)
    assert torch.equal(logits(model, inside), reference)
    assert (model.config.text_config.rope_parameters, model.config.text_config.max_position_embeddings) == original
    assert not hasattr(model.config.text_config, "rope_ext")


def test_a_method_rotating_inside_attention_routes_the_text_attention_alone(tmp_path):
    """self_extend runs through the rope-ext attention wrapper: the text config's backend names
    it, the vision tower's stays its own; inside the window the logits are the model's."""
    model = tiny("got_ocr2")
    backends = (model.config.text_config._attn_implementation, model.config.vision_config._attn_implementation)
    inside = ids(WINDOW)
    reference = logits(model, inside)
    rope_ext.patch(model, "self_extend", factor=4)
    assert model.config.text_config._attn_implementation.startswith("rope_ext_")
    assert model.config.vision_config._attn_implementation == backends[1]
    assert torch.equal(logits(model, inside), reference)
    reloaded = rope_ext.from_pretrained(saved(model, tmp_path / "self_extend")).eval()
    assert torch.equal(logits(reloaded, ids(WINDOW + 36, seed=1)), logits(model, ids(WINDOW + 36, seed=1)))
    rope_ext.unpatch(model)
    assert (model.config.text_config._attn_implementation, model.config.vision_config._attn_implementation) == backends
    assert torch.equal(logits(model, inside), reference)


@pytest.mark.parametrize("model_type", ["emu3", "mllama"])
def test_a_causal_lm_on_a_text_config_no_auto_class_maps_reloads(model_type, tmp_path):
    """emu3's and mllama's causal LMs save their text config, which AutoModelForCausalLM does not
    map: rope_ext.from_pretrained loads the class config.json names."""
    model = tiny(model_type)
    rope_ext.patch(model, "yarn", factor=4)
    past = ids(WINDOW + 36, seed=1)
    reloaded = rope_ext.from_pretrained(saved(model, tmp_path / "yarn")).eval()
    assert type(reloaded) is type(model)
    assert torch.equal(logits(reloaded, past), logits(model, past))


def test_a_composite_with_per_layer_attributes_is_refused_for_them():
    """gemma4_unified's text config is read (no `config` refusal) and refused for what it holds."""
    model = tiny("gemma4_unified")
    plain = model.config.to_dict()
    with pytest.raises(ValueError, match=re.escape(REASONS["per-layer-config"])):
        rope_ext.patch(model, "yarn", factor=4)
    assert model.config.to_dict() == plain


def test_llama4_composite_takes_the_static_methods_through_its_text_config():
    """Llama4ForConditionalGeneration's rope_parameters are read from its text config. Its forward
    of text alone failed in transformers 5.24 (it read `image_outputs` from the language model's
    output) and runs in 5.25: static methods patch it exactly, the rotation it applies itself
    (complex freqs_cis) refuses the methods that rotate inside attention, changing nothing."""
    text = Llama4TextConfig(**{**SHRINK, "intermediate_size_mlp": 128, "num_experts_per_tok": 1})
    vision = Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
        image_size=28,
        patch_size=14,
    )
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision)).eval()
    plain, inside, past = model.config.to_dict(), ids(WINDOW), ids(WINDOW + 40, seed=1)
    reference = logits(model, inside)
    with pytest.raises(ValueError, match=re.escape(REASONS["rotation"])):
        rope_ext.patch(model, "self_extend", factor=4)
    assert model.config.to_dict() == plain
    info = rope_ext.patch(model, "yarn", factor=4)
    assert info.native is not None
    config = copy.deepcopy(model.config)
    del config.text_config.rope_ext
    twin = Llama4ForConditionalGeneration(config).eval()
    twin.load_state_dict(model.state_dict())
    assert torch.equal(logits(model, past), logits(twin, past))
    rope_ext.unpatch(model)
    assert model.config.to_dict() == plain and torch.equal(logits(model, inside), reference)
