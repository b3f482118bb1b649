"""dpe: per-group position scales with a local window (rope_ext.method.dpe), against an fp64
reference written from the paper's definition and the authors' code (LuLuLuyi/DPE,
dpe_for_llama.py), at lengths many times the local window and the group scales; bit-exact inside
the trained window; the authors' preset; its parameter rules."""

import pytest
import torch
from transformers import DynamicCache

import rope_ext
from rope_ext.attention import AttentionTransform, Rotator
from rope_ext.method import dpe
from rope_ext.method.attention_side import TwoPartAttention

from helpers import (
    assert_refused_unchanged,
    assert_saves_reloads_and_unpatches,
    left_padded,
    random_ids,
    random_model,
    set_chain,
)

WINDOW = 64  # the random models' trained window
# eight groups of two pairs (head size 32): the groups' order and their size both show; scales
# that do not divide the local window (3, 5) and one that leaves its group unscaled (1)
SCALES = [1, 2, 3, 5, 8, 16, 32, 96]
LOCAL = 12


class NaiveDpe(AttentionTransform):
    """The definition in fp64, for one unpadded sequence, from relative angles: for a query at i and
    a key at j, d = i - j; where the query scales (i >= start) and d >= W, the pairs of group g turn
    by (floor(i/s_g) + W - floor(W/s_g) - floor(j/s_g)) theta_p, else by d theta_p; one softmax.
    Pair p is in group p // (pairs / G), group 0 holding the highest frequencies (theta_0 = 1), as
    the authors' dimension_groups_range indexes inv_freq."""

    def __init__(self, rotary, scales, window, start):
        self.rotary, self.scales, self.window, self.start = rotary, scales, window, start

    def __call__(self, module, query, key, value, attention_mask, attend, scaling=None, **kwargs):
        frame, geometry = self.rotary.frame, self.rotary.geometry
        i, j = frame.q_pos[0][:, None, None], frame.k_pos[0][None, :, None]  # [Sq, 1, 1], [1, Sk, 1]
        dim, pairs = geometry.rotary_dim, geometry.rotary_dim // 2
        theta = 1.0 / geometry.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        s = torch.tensor(self.scales)[torch.arange(pairs) // (pairs // len(self.scales))]  # each pair's scale
        w = self.window
        scaled = (i // s + w - w // s) - j // s
        distance = (i - j).expand_as(scaled)
        angle = torch.where((distance >= w) & (i >= self.start), scaled, distance).double() * theta  # [Sq, Sk, pairs]
        rep = query.shape[1] // key.shape[1]
        q = query.double()
        k = key.double().repeat_interleave(rep, dim=1)
        v = value.double().repeat_interleave(rep, dim=1)
        scores = torch.zeros(*q.shape[:2], q.shape[2], k.shape[2], dtype=torch.float64)
        for p in range(pairs):
            qa, qb, ka, kb = q[..., p], q[..., p + pairs], k[..., p], k[..., p + pairs]
            same = qa[..., :, None] * ka[..., None, :] + qb[..., :, None] * kb[..., None, :]
            cross = qa[..., :, None] * kb[..., None, :] - qb[..., :, None] * ka[..., None, :]
            scores += angle[..., p].cos() * same + angle[..., p].sin() * cross
        scores = (scores * scaling).masked_fill((i - j)[..., 0] < 0, float("-inf"))
        return (scores.softmax(-1) @ v).to(query.dtype).transpose(1, 2), None


def perturbed_model(attn="sdpa"):
    """A random model with head size 32 whose norm weights are not 1."""
    model = random_model("llama", attn=attn, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.slow  # takes long
@pytest.mark.parametrize("inside_window", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_matches_the_fp64_definition_in_one_forward_chunks_decoding_and_a_padded_batch(attn, inside_window):
    length, pad = 700, 5  # 58 local windows; the slowest group's distances reach 18, the fastest 699
    model = perturbed_model(attn)
    rope_ext.patch(model, "dpe", factor=length / WINDOW, scales=SCALES, window=LOCAL, inside_window=inside_window)
    rotary = model.model.rotary_emb
    ids = random_ids(length, seed=1)
    batch, padding, positions = left_padded(ids, pad)
    with torch.no_grad():
        set_chain(model, [NaiveDpe(rotary, SCALES, LOCAL, LOCAL if inside_window else WINDOW)])
        reference, shorter = model(ids).logits, model(ids[:, pad:]).logits
        set_chain(model, [TwoPartAttention(Rotator(rotary))])
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        chunked = torch.cat([model(c, cache=cache, use_cache=True).logits for c in ids.split(97, dim=1)], dim=1)
        cache = DynamicCache(config=model.config)
        model(ids[:, :650], cache=cache, use_cache=True)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(650, length)], dim=1)
        padded = model(batch, attention_mask=padding, position_ids=positions).logits
    tolerance = 1e-5  # measured: under 1e-6; one group a position off is 5e-4
    assert (full - reference).abs().max() <= tolerance
    assert (chunked - reference).abs().max() <= tolerance
    assert (steps - reference[:, 650:]).abs().max() <= tolerance
    assert (padded[:1] - reference).abs().max() <= tolerance
    assert (padded[1:, pad:] - shorter).abs().max() <= tolerance
    with torch.no_grad():
        # the reference with the groups in the other order: the test tells the order apart
        set_chain(model, [NaiveDpe(rotary, SCALES[::-1], LOCAL, LOCAL if inside_window else WINDOW)])
        reversed_groups = model(ids).logits
    assert (reversed_groups - reference).abs().max() > 100 * tolerance
    rope_ext.unpatch(model)
    with torch.no_grad():
        plain = model(ids).logits
    start = LOCAL if inside_window else WINDOW
    assert (plain[:, :start] - full[:, :start]).abs().max() <= 1e-5
    assert (plain[:, start:] - full[:, start:]).abs().max() > 1e-2  # the scaling is not vacuous


def test_one_group_is_self_extend(tiny_model, heldout_ids):
    """With one scale for every pair, dpe is SelfExtend's grouped attention at that group."""
    ids = heldout_ids[None, :500]
    info = rope_ext.patch(tiny_model, "dpe", factor=4, window=16)
    assert info.params["scales"] == [5]  # the smallest group whose distances stay inside 128 at 512 tokens
    with torch.no_grad():
        grouped = tiny_model(ids).logits
        rope_ext.patch(tiny_model, "self_extend", group=5, window=16)
        assert torch.equal(tiny_model(ids).logits, grouped)


def test_inside_the_trained_window_the_trained_model_is_unchanged_bit_for_bit(tiny_model, heldout_ids):
    ids = heldout_ids[None, :300]
    with torch.no_grad():
        plain = tiny_model(ids).logits
        rope_ext.patch(tiny_model, "dpe", factor=4, scales="llama3-8b-instruct")
        patched = tiny_model(ids).logits
        assert torch.equal(plain[:, :128], patched[:, :128])
        rope_ext.patch(tiny_model, "dpe", factor=4, scales="llama3-8b-instruct", inside_window=True)
        authors = tiny_model(ids).logits
    assert torch.equal(plain[:, :16], authors[:, :16])  # below the local window (128 / 8)
    assert (plain[:, 16:128] - authors[:, 16:128]).abs().max() > 1e-2  # the authors' schedule acts inside


def test_decoding_gives_the_greedy_tokens_of_one_forward_on_the_trained_model(tiny_model, heldout_ids):
    rope_ext.patch(tiny_model, "dpe", factor=4, scales=[2, 2, 4, 4, 8, 8, 16, 16])
    prompt = heldout_ids[None, :300]
    with torch.no_grad():
        out = tiny_model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        again = tiny_model(out[:, :-1]).logits[:, prompt.shape[1] - 1 :].argmax(-1)
    assert torch.equal(out[:, prompt.shape[1] :], again)


def test_the_authors_llama3_preset_and_window():
    """Llama-3-8B's shape: 64 pairs in 8 groups of 8, window 8192, local window 1024."""
    model = random_model("llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    info = rope_ext.patch(model, "dpe", factor=16, scales="llama3-8b-instruct")
    assert info.params["scales"] == [4, 4, 2, 16, 32, 32, 16, 128] and info.params["window"] == 1024
    notes = info.notes["group_distances"]
    assert notes["pairs_per_group"] == 8 and notes["target"] == 131072
    # the fast groups (scales 2, 4) go past the trained window at 128k, the slowest stays inside
    assert notes["largest"][2] == 131071 // 2 + 1024 - 512 and not notes["inside_trained"][2]
    assert notes["largest"][7] == 131071 // 128 + 1024 - 8 and notes["inside_trained"][7]


def test_save_reload_and_unpatch_of_a_preset(tiny_model, heldout_ids, tmp_path):
    """A preset is recorded as the scales it names."""
    assert_saves_reloads_and_unpatches(
        tiny_model, "dpe", {"factor": 4, "scales": list(dpe.PRESETS["llama3-8b-instruct"])}, heldout_ids[None, :400], tmp_path
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scales": [2, 4, 8]}, r"3 scales do not split this model's 8 frequency pairs"),
        ({"scales": [2, 0]}, r"scales\[1\] must be an int in \[1,"),
        ({"scales": [2, 2.5]}, r"scales\[1\] must be an int in \[1,"),
        ({"scales": []}, r"scales must be a non-empty list"),
        ({"scales": "llama2"}, r"unknown scales preset 'llama2'; presets: llama3-8b-instruct"),
        ({"window": 64}, r"the local window \(64\) must be smaller than the trained window \(64\)"),
        ({"window": 0}, r"window \(or None for the default\) must be an int in \[1,"),
        ({"inside_window": 1}, r"inside_window must be True or False"),
        ({"group": 4}, r"unknown parameter"),
    ],
)
def test_bad_settings_are_refused_and_change_nothing(kwargs, message):
    assert_refused_unchanged("dpe", {"factor": 4, **kwargs}, message)
