"""What a patch survives on the tiny trained model: a change of attention backend, a deep copy, a
cast before patching, a repatch, long and assisted generation; and unpatch on a ChatGLM checkpoint
whose attention layers have no core attention (issue #15)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.utils import logging as hf_logging

import rope_ext
from rope_ext.rotary import ExtendedRotaryEmbedding

from test_chatglm import load as load_chatglm
from test_chatglm import write_checkpoint

CHAINED = ["dynamic", "dynamic_yarn", "self_extend", "alibi_hybrid"]  # attention runs through the rope-ext wrapper
DYNAMIC = ["dynamic", "dynamic_yarn", "self_extend"]  # keys are cached before rotation


def load(path, **kwargs):
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@torch.no_grad()
def logits(model, ids):
    return model(ids).logits


def greedy(model, prompt, new_tokens, **kwargs):
    return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)


@pytest.fixture
def text(heldout_ids):
    return heldout_ids[None, :300]  # past the tiny model's 128-token window


@pytest.mark.parametrize("method", CHAINED)
def test_backend_change_keeps_the_patch_and_unpatch_restores_the_choice(tiny_model, tiny_path, text, method):
    patched_eager = load(tiny_path, attn_implementation="eager")
    rope_ext.patch(patched_eager, method, factor=4)
    plain_eager = load(tiny_path, attn_implementation="eager")
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


@pytest.mark.parametrize("method", DYNAMIC)
def test_deep_copy_is_an_independent_patched_model(tiny_model, tiny_path, text, method):
    rope_ext.patch(tiny_model, method, factor=4)
    twin = copy.deepcopy(tiny_model)
    prompt = text[:, :120]
    expected = greedy(tiny_model, prompt, 20)
    assert torch.equal(greedy(twin, prompt, 20), expected)
    assert torch.equal(logits(twin, text), logits(tiny_model, text))
    patched = logits(tiny_model, text)
    rope_ext.unpatch(twin)
    assert torch.equal(logits(twin, text), logits(load(tiny_path), text))
    assert torch.equal(logits(tiny_model, text), patched) and torch.equal(greedy(tiny_model, prompt, 20), expected)
    rope_ext.patch(twin, "yarn", factor=2)
    rope_ext.unpatch(tiny_model)
    assert rope_ext.describe(twin)["method"] == "yarn" and rope_ext.describe(tiny_model) is None


@pytest.mark.parametrize("cast", [
    lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.to(torch.bfloat16),
], ids=["half", "bfloat16", "to_bfloat16"])
def test_a_cast_model_is_patched_with_fp32_frequencies(tiny_model, tiny_path, cast):
    reference = load(tiny_path)
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


@pytest.mark.parametrize("first, second", [
    (("ntk", 2, {}), ("dynamic", 8, {})),
    (("linear", 4, {}), ("self_extend", 4, {})),
    (("yarn", 4, {}), ("alibi_hybrid", 4, {"rope": "yarn"})),
    (("alibi_hybrid", 2, {}), ("llama3", 4, {})),
    (("dynamic_yarn", 4, {}), ("dynamic", 2, {"causal": False})),
])
def test_repatching_writes_the_config_of_a_first_patch(tiny_model, tiny_path, first, second):
    fresh = load(tiny_path)
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


@pytest.mark.parametrize("method", DYNAMIC)
def test_generate_warns_of_the_length_only_past_the_patch_max_length(tiny_model, heldout_ids, transformers_warnings, method):
    info = rope_ext.patch(tiny_model, method, factor=2)  # meant for 256 tokens
    greedy(tiny_model, heldout_ids[None, :120], 30)
    assert not [m for m in transformers_warnings if "predefined maximum length" in m]
    greedy(tiny_model, heldout_ids[None, : info.max_length - 2], 4)
    assert [m for m in transformers_warnings if "predefined maximum length" in m] == [
        f"This is a friendly reminder - the current text generation call has exceeded the model's predefined maximum "
        f"length ({info.max_length}). Depending on the model, you may observe exceptions, performance degradation, or nothing at all."
    ]


@pytest.mark.parametrize("method", DYNAMIC)
def test_assisted_decoding_equals_greedy_decoding(tiny_model, heldout_ids, method):
    rope_ext.patch(tiny_model, method, factor=4)
    prompt = heldout_ids[None, 500:600]  # generation runs past the 128-token window
    plain = greedy(tiny_model, prompt, 60)
    assert torch.equal(greedy(tiny_model, prompt, 60, prompt_lookup_num_tokens=3), plain)


def test_a_longer_cache_than_the_patch_wrote_is_still_refused(tiny_model, heldout_ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        tiny_model(heldout_ids[None, :10], cache=cache, use_cache=True)
    rope_ext.patch(tiny_model, "dynamic", factor=4)
    with pytest.raises(RuntimeError, match="did not write"), torch.no_grad():
        tiny_model(heldout_ids[None, 10:11], cache=cache, use_cache=True)


def test_chatglm_without_core_attention_unpatches_a_static_patch(tmp_path):
    model = load_chatglm(write_checkpoint(tmp_path / "chatglm3", "chatglm3"))
    for layer in model.transformer.encoder.layers:
        del layer.self_attention.core_attention
    rotary = model.transformer.rotary_pos_emb
    config = copy.deepcopy(model.config.to_dict())
    rope_ext.patch(model, "yarn", factor=4)
    rope_ext.unpatch(model)
    assert model.transformer.rotary_pos_emb is rotary and rope_ext.describe(model) is None
    assert model.config.to_dict() == config
    assert not model.transformer._forward_pre_hooks and not model.transformer._forward_hooks
    with pytest.raises(ValueError, match="expect `transformer.encoder.layers\\[i\\].self_attention.core_attention`"):
        rope_ext.patch(model, "dynamic", factor=4)
