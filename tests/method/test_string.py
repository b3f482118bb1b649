"""string: STRING's shifted distances (rope_ext.method.string), against the definition written out
with full [S, S] matrices, bit-exact below the shift, over YaRN past the trained window."""

import math

import pytest
import torch
from transformers import DynamicCache

import rope_ext
from rope_ext.attention import AttentionTransform, Rotator
from rope_ext.method import rope, string
from rope_ext.method.attention_side import TwoPartAttention

from helpers import (
    WINDOW,
    assert_refused_unchanged,
    assert_saves_reloads_and_unpatches,
    left_padded,
    native_twin,
    random_model,
    rotate,
    set_chain,
)


class NaiveString(AttentionTransform):
    """The definition, for one unpadded sequence: distance d below the shift as it is, d - S + W
    from it, one softmax over all keys."""

    def __init__(self, rotary, shift, local):
        self.rotary, self.shift, self.local = rotary, shift, local

    def __call__(self, module, query, key, value, attention_mask, attend, scaling=None, **kwargs):
        frame, geometry = self.rotary.frame, self.rotary.geometry
        q_pos, k_pos = frame.q_pos[0], frame.k_pos[0]
        base, dim = geometry.base, geometry.rotary_dim
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        keys = rotate(key, k_pos, base, dim).transpose(-1, -2)
        own = rotate(query, q_pos, base, dim) @ keys
        shifted = rotate(query, q_pos - self.shift + self.local, base, dim) @ keys
        distance = q_pos[:, None] - k_pos[None, :]
        scores = torch.where(distance >= self.shift, shifted, own) * scaling
        scores = scores.masked_fill(distance < 0, float("-inf"))
        return (scores.softmax(-1) @ value).transpose(1, 2), None


def perturbed_model(attn="sdpa"):
    """A random model whose norm weights are not 1, so a rotation that does not commute with a norm is seen."""
    model = random_model("llama", attn=attn)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_matches_the_definition_in_one_forward_chunks_decoding_and_a_padded_batch(attn):
    shift, local, pad, length = 20, 6, 5, 150
    model = perturbed_model(attn)
    rope_ext.patch(model, "string", shift=shift, local=local)
    rotary = model.model.rotary_emb
    ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(1))
    batch, padding, positions = left_padded(ids, pad)
    with torch.no_grad():
        set_chain(model, [NaiveString(rotary, shift, local)])
        reference, shorter = model(ids).logits, model(ids[:, pad:]).logits
        set_chain(model, [TwoPartAttention(Rotator(rotary))])
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        chunked = torch.cat([model(c, cache=cache, use_cache=True).logits for c in ids.split(37, dim=1)], dim=1)
        cache = DynamicCache(config=model.config)
        model(ids[:, :100], cache=cache, use_cache=True)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(100, length)], dim=1)
        padded = model(batch, attention_mask=padding, position_ids=positions).logits
    assert (full - reference).abs().max() <= 1e-5
    assert (chunked - reference).abs().max() <= 1e-5
    assert (steps - reference[:, 100:]).abs().max() <= 1e-5
    assert (padded[:1] - reference).abs().max() <= 1e-5
    assert (padded[1:, pad:] - shorter).abs().max() <= 1e-5
    rope_ext.unpatch(model)
    with torch.no_grad():
        plain = model(ids).logits
    # rows below the shift: the plain model's up to the kernel's blocking (one call of `shift`
    # rows here, of all rows there); bit for bit in a sequence shorter than the shift (below)
    assert (plain[:, :shift] - full[:, :shift]).abs().max() <= 1e-6
    assert (plain[:, shift:] - full[:, shift:]).abs().max() > 1e-3  # the shift is not vacuous


def test_below_the_shift_the_trained_model_is_unchanged_bit_for_bit(tiny_model, heldout_ids):
    ids = heldout_ids[None, :42]
    with torch.no_grad():
        plain = tiny_model(ids).logits
    info = rope_ext.patch(tiny_model, "string", local=8)  # the trained window: S = int(0.33 x 128) = 42
    assert (info.factor, info.max_length, info.params["shift"]) == (1.0, 128, 42)
    with torch.no_grad():
        assert torch.equal(tiny_model(ids).logits, plain)


def test_decoding_gives_the_greedy_tokens_of_one_forward_on_the_trained_model(tiny_model, heldout_ids):
    rope_ext.patch(tiny_model, "string", factor=2, local=16)
    prompt = heldout_ids[None, :200]
    with torch.no_grad():
        out = tiny_model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        again = tiny_model(out[:, :-1]).logits[:, prompt.shape[1] - 1 :].argmax(-1)
    assert torch.equal(out[:, prompt.shape[1] :], again)


def test_past_the_window_it_runs_over_yarn_at_the_authors_factor():
    model = random_model("llama")
    info = rope_ext.patch(model, "string", factor=4, local=8)
    target = 4 * WINDOW
    shift = int(0.33 * target)
    stretch = (target - shift) / WINDOW  # (N / L)(1 - S / N)
    assert info.params["shift"] == shift and stretch == pytest.approx(2.6875)
    inv_freq, scale = model.model.rotary_emb.frequencies(target)
    expected, mscale = rope.yarn(model.model.rotary_emb.geometry, factor=stretch)
    assert torch.equal(inv_freq, expected) and scale == mscale
    # below the shift: yarn's model at that factor, as transformers builds it
    twin = native_twin(
        model, {"rope_type": "yarn", "factor": stretch, "rope_theta": 10000.0, "original_max_position_embeddings": WINDOW}
    )
    ids = torch.randint(0, 97, (1, shift), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(ids).logits - twin(ids).logits).abs().max() <= 1e-5


def test_the_reference_codes_temperature_is_opt_in():
    model = random_model("llama")
    rope_ext.patch(model, "string", local=8)
    assert model.model.rotary_emb.frequencies(WINDOW)[1] == 1.0
    rope_ext.patch(model, "string", local=8, temperature=True)
    assert model.model.rotary_emb.frequencies(WINDOW)[1] == string.TEMPERATURE == 1.0693


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"local": 30, "shift": 20}, r"need local < shift"),
        ({"shift": 65, "local": 8}, r"shift 65 exceeds the 64 positions the frequencies cover"),
        ({"factor": 4, "shift": 130, "local": 8}, r"shift 130 exceeds the 126 positions"),
        ({"local": 8, "shift": 64}, r"shift 64 is not below the 64 tokens"),
        ({"local": 8, "factor": 0.5}, r"factor must be a finite number > 1"),
        ({"local": 8, "temperature": "yes"}, r"temperature must be True or False"),
        ({"local": -1}, r"local \(or None for the default\) must be an int in \[0,"),
        ({"local": 8, "window": 4}, r"unknown parameter"),
    ],
)
def test_bad_settings_are_refused_and_change_nothing(kwargs, message):
    assert_refused_unchanged("string", kwargs, message)


def test_the_defaults_are_the_papers_a_third_of_the_length_and_a_local_window_of_128():
    model = random_model("llama", max_position_embeddings=8192)
    info = rope_ext.patch(model, "string")
    assert (info.params["shift"], info.params["local"], info.max_length) == (2703, 128, 8192)
    info = rope_ext.patch(random_model("llama"), "string", factor=3)  # a small window: W = S / 2
    assert (info.params["shift"], info.params["local"]) == (math.floor(0.33 * 3 * WINDOW), 31)


def test_a_patch_for_the_trained_window_saves_reloads_and_unpatches(tiny_model, heldout_ids, tmp_path):
    assert_saves_reloads_and_unpatches(tiny_model, "string", {"local": 8}, heldout_ids[None, :200], tmp_path)
    assert rope_ext.patch(tiny_model, "string", local=8).factor == 1.0
    assert_refused_unchanged("yarn", {"factor": 1}, r"factor must be a finite number > 1")
