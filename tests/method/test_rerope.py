"""rerope: ReRoPE and Leaky ReRoPE (rope_ext.method.rerope), against an explicit per-(i, j)
distance matrix on the tiny trained model; its factor, window and leak. What every attention-side
method meets (exactness inside the window, caching, saving, refusals) is in
test_attention_methods.py."""

import math

import pytest
import torch

import rope_ext
from rope_ext.attention import AttentionTransform
from rope_ext.method import rerope
from rope_ext.method.attention_side import TwoPartAttention
from rope_ext.rotation import apply_rotary, cos_sin, rotate_prepared

from helpers import assert_refused_unchanged, rotate, set_chain

TRAINED = 128  # the tiny model's window


class ExplicitDistances(AttentionTransform):
    """The definition with no rotation of queries or keys: each score is the sum over frequencies
    f of (q_a k_a + q_b k_b) cos(d theta_f) + (q_a k_b - q_b k_a) sin(d theta_f), the RoPE score at
    relative distance d, with d from the matrix `distances`, in float64; then the model's mask
    (padding) and softmax."""

    def __init__(self, rotary, window, leak, causal=True):
        self.rotary, self.window, self.leak, self.causal = rotary, window, leak, causal
        self.seen = []

    def distances(self, q_pos, k_pos):
        """[B, Sq, Sk] from positions [B, Sq] and [B, Sk]."""
        d = q_pos[:, :, None] - k_pos[:, None, :]
        far = torch.full_like(d, float(self.window)) if self.leak is None else self.window + (d - self.window) / self.leak
        if self.causal:
            past = q_pos + 1 > TRAINED
        else:  # every query of a forward that goes past the window
            past = torch.full_like(q_pos, bool(q_pos.max() + 1 > TRAINED), dtype=torch.bool)
        return torch.where(past[:, :, None] & (d >= self.window), far, d)

    def __call__(self, module, query, key, value, attention_mask, attend, scaling=None, **kwargs):
        frame, geometry = self.rotary.frame, self.rotary.geometry
        kv_len = key.shape[-2]
        dist = self.distances(frame.q_pos.double(), frame.k_pos[:, -kv_len:].double())[:, None]  # [B, 1, Sq, Sk]
        self.seen.append(dist[0, 0])
        half = geometry.rotary_dim // 2
        theta = 1.0 / geometry.base ** (torch.arange(0, geometry.rotary_dim, 2, dtype=torch.float64) / geometry.rotary_dim)
        rep = query.shape[1] // key.shape[1]
        q, k = query.double(), key.repeat_interleave(rep, dim=1).double()
        scores = torch.zeros(*q.shape[:3], kv_len, dtype=torch.float64)
        for f in range(half):
            qa, qb, ka, kb = q[..., f], q[..., f + half], k[..., f], k[..., f + half]
            even = qa[..., :, None] * ka[..., None, :] + qb[..., :, None] * kb[..., None, :]
            odd = qa[..., :, None] * kb[..., None, :] - qb[..., :, None] * ka[..., None, :]
            scores += even * torch.cos(dist * theta[f]) + odd * torch.sin(dist * theta[f])
        # causality by key index, as the model's: with left padding index and position distances agree
        index = torch.arange(kv_len - query.shape[-2], kv_len)[:, None] - torch.arange(kv_len)[None, :]
        hidden = index < 0
        if attention_mask is not None:
            mask = attention_mask[..., :kv_len]
            hidden = hidden | (~mask if mask.dtype == torch.bool else mask < 0)
        scores = (scores * scaling).masked_fill(hidden, float("-inf"))
        out = scores.softmax(-1).nan_to_num(0.0) @ value.repeat_interleave(rep, dim=1).double()
        return out.to(query.dtype).transpose(1, 2), None


class Compare(AttentionTransform):
    """Runs `ours` and `reference` on the same queries, keys and values (the model's projections at
    every layer) and records the largest difference of their outputs over the query rows that see
    a key, with the scale of the values (the outputs are averages of them); hands on ours."""

    def __init__(self, ours, reference):
        self.ours, self.reference, self.differences = ours, reference, []

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        out, _ = self.ours(module, query, key, value, attention_mask, attend, **kwargs)
        expected, _ = self.reference(module, query, key, value, attention_mask, attend, **kwargs)
        rows = torch.ones(query.shape[0], query.shape[-2], dtype=torch.bool)
        if attention_mask is not None:
            mask = attention_mask[:, 0]
            rows = (mask if mask.dtype == torch.bool else mask == 0).any(-1)
        self.differences.append(((out - expected)[rows].abs().max().item(), value.abs().max().item()))
        return out, None


# past the window: the explicit distances


def slow(*values):
    return pytest.param(*values, marks=pytest.mark.integration)


# float64 scores written out per frequency take seconds a case: the inner loop (-m "not integration")
# runs Leaky ReRoPE at a fractional leak on eager, the full suite every case
@pytest.mark.parametrize(
    "leak, window, causal, attn",
    [
        slow(None, 32, True, "sdpa"),
        (4.5, 24, True, "eager"),
        slow(6, 32, True, "sdpa"),
        slow(None, 20, False, "eager"),
        slow(3, 40, False, "sdpa"),
    ],
)
def test_past_the_window_it_is_the_explicit_distance_matrix(tiny_model, heldout_ids, leak, window, causal, attn):
    """At every layer, on the model's own queries, keys and values: one forward and a left-padded
    batch (masked blocks of rows, TwoPartAttention's `_masked_rows`) against the reference; then
    the whole model with the reference in place of the attention."""
    tiny_model.set_attn_implementation(attn)
    length, pad = 3 * TRAINED - 5, 5
    ids = heldout_ids[None, :length]
    info = rope_ext.patch(tiny_model, "rerope", factor=2, window=window, leak=leak, causal=causal)
    assert (info.params["leak"], info.params["window"]) == (leak, window)
    installed = tiny_model.model.layers[0].self_attn.rope_ext_attention
    reference = ExplicitDistances(tiny_model.model.rotary_emb, window, leak, causal)
    compare = Compare(installed.transforms[0], reference)
    batch = torch.cat((ids, torch.cat((torch.zeros(1, pad, dtype=ids.dtype), ids[:, pad:]), dim=1)))
    padding = torch.ones_like(batch)
    padding[1, :pad] = 0
    with torch.no_grad():
        set_chain(tiny_model, [compare])
        full = tiny_model(ids).logits
        padded = tiny_model(batch, attention_mask=padding, position_ids=(padding.cumsum(-1) - 1).clamp(min=0)).logits
        set_chain(tiny_model, [reference])
        expected = tiny_model(ids).logits
    layers = tiny_model.config.num_hidden_layers
    # Layer 0 (values up to 1) within 1e-5. Deeper layers, values up to 6.6, within 2e-5 of that
    # scale: there the unpatched model's own attention (rotation at positions i and j, then the
    # backend) is up to 3.9e-5 = 6e-6 of it from this float64 reference with no rectification (fp32
    # rounding of the angles and sums); rerope measured up to 1.14e-5 of it.
    assert len(compare.differences) == 2 * layers
    assert all(difference <= 1e-5 for difference, _ in compare.differences[::layers]), compare.differences
    assert all(difference <= 2e-5 * max(1.0, scale) for difference, scale in compare.differences), compare.differences
    # Whole model: the unpatched model differs from this reference with no rectification by 3.5e-5
    # (logits up to 15, after four layers of that rounding), so the bound is 1e-4 here.
    assert (full - expected).abs().max() <= 1e-4
    assert (padded[:1] - full).abs().max() <= 1e-4
    # the reference's distances are the formula's: a few entries written out
    dist = reference.seen[2 * layers]
    i = length - 1
    assert dist[i, i - window + 1] == window - 1  # the last neighbour keeps its distance
    assert dist[i, 0] == (window if leak is None else window + (i - window) / leak)  # the farthest key
    # a row that has seen L tokens: exact under the causal schedule, rectified with causal=False
    rectified = window if leak is None else window + (TRAINED - 1 - window) / leak
    assert dist[TRAINED - 1, 0] == (TRAINED - 1 if causal else rectified)
    if leak is not None:
        assert dist[i, i - window] == window  # continuous at the window's edge
        assert dist[i, i - window - 1] == window + 1 / leak


def test_leaky_and_plain_rerope_differ(tiny_model, heldout_ids):
    ids = heldout_ids[None, : 3 * TRAINED]
    outputs = []
    for leak in (None, 6):
        rope_ext.patch(tiny_model, "rerope", factor=4, leak=leak)
        with torch.no_grad():
            outputs.append(tiny_model(ids).logits)
    assert torch.equal(outputs[0][:, :TRAINED], outputs[1][:, :TRAINED])
    assert (outputs[0][:, TRAINED:] - outputs[1][:, TRAINED:]).abs().max() > 1e-2


def test_greedy_generation_past_the_window_matches_one_forward(tiny_model, heldout_ids):
    rope_ext.patch(tiny_model, "rerope", factor=4, leak="auto")
    prompt = heldout_ids[None, : 2 * TRAINED]
    with torch.no_grad():
        out = tiny_model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        again = tiny_model(out[:, :-1]).logits[:, prompt.shape[1] - 1 :].argmax(-1)
    assert torch.equal(out[:, prompt.shape[1] :], again)


# the rotation at fractional positions


def test_rotation_takes_fractional_positions_with_fp32_angles(tiny_model):
    rope_ext.patch(tiny_model, "rerope", factor=2, leak=4.5)
    attention = tiny_model.model.layers[0].self_attn.rope_ext_attention.transforms[0]
    assert isinstance(attention, TwoPartAttention)
    rotary = tiny_model.model.rotary_emb
    positions = rotary.method.distant_key(torch.arange(300)[None], rotary.params)
    assert positions.dtype == torch.float32 and positions[0, 1] == pytest.approx(1 / 4.5)
    x = torch.randn(1, 2, 300, 32, generator=torch.Generator().manual_seed(0))
    inv_freq, _ = tiny_model.model.rotary_emb.frequencies(TRAINED)
    rotator = attention.rotator

    def rotated(x):
        return rotate_prepared(x.unsqueeze(2), *rotator.factors([positions], inv_freq, 1.0, x.dtype), *rotator.pairing)[:, :, 0]

    ours = rotated(x)
    assert (ours - rotate(x, positions[0], 10000.0, 32)).abs().max() <= 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):  # angles stay fp32 under autocast
        cos, sin = cos_sin(inv_freq, 1.0, positions, torch.float32)
        assert torch.equal(apply_rotary(x, cos, sin, "half"), ours)
    # bf16 activations: the fp32 rotation, cast
    cos, sin = cos_sin(inv_freq, 1.0, positions, torch.bfloat16)
    assert torch.equal(cos, torch.cos(torch.cat((positions[..., None] * inv_freq,) * 2, -1)).to(torch.bfloat16))
    ours_bf16 = rotated(x.bfloat16())
    assert (ours_bf16.float() - ours).abs().max() <= 0.05


# factor, window and leak


def test_what_factor_window_and_leak_mean(tiny_model):
    info = rope_ext.patch(tiny_model, "rerope", factor=4)  # ReRoPE: the factor only names the length
    assert (info.params["window"], info.params["leak"], info.max_length) == (32, None, 512)
    assert info.notes["largest_distance"] == {
        "statement": "w (ReRoPE) or w + (N - 1 - w) / k (Leaky ReRoPE) <= L - 1",
        "target": 512,
        "value": 32.0,
        "limit": 127,
        "holds": True,
    }
    # leak="auto": the smallest integer leak whose largest distance at 512 tokens is within 127
    info = rope_ext.patch(tiny_model, "rerope", factor=4, leak="auto")
    assert info.params["leak"] == 6 and info.max_length == 512
    assert 32 + (511 - 32) / 6 <= 127 < 32 + (511 - 32) / 5
    assert info.notes["largest_distance"]["value"] == pytest.approx(32 + 479 / 6) and info.notes["largest_distance"]["holds"]
    # a leak without a factor: meant for its capacity, floor(w + 1 + k (L - 1 - w))
    info = rope_ext.patch(tiny_model, "rerope", leak=6)
    assert rerope.capacity(128, 32, 6) == 603 == info.max_length and info.factor == 603 / 128
    info = rope_ext.patch(tiny_model, "rerope", leak=4.5, window=24)
    assert info.max_length == math.floor(25 + 4.5 * 103) == 488
    info = rope_ext.patch(tiny_model, "rerope", factor=2, leak=6)  # within the capacity: the factor names the length
    assert info.max_length == 256 and info.params["leak"] == 6
    assert rope_ext.describe(tiny_model)["method"] == "rerope"
    assert tiny_model.config.max_position_embeddings == 128  # a plain reload is the unpatched model
    # at an 8k window, 4x: the same leak as the brief's w + (N - w)/k < L would give
    assert rerope.choose_leak(8192, 32768, 2048) == 6
    assert rerope.capacity(8192, 2048, 6) >= 32768 > rerope.capacity(8192, 2048, 5)
    assert rerope.choose_leak(128, 129, 32) == 2  # never below 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, r"rerope needs a factor \(e\.g\. factor=4\): ReRoPE \(leak=None\) reaches any length"),
        ({"leak": "auto"}, "needs a factor .* leak='auto' picks the leak"),
        ({"factor": 4, "leak": 1}, "leak must be a finite number > 1"),
        ({"factor": 4, "leak": float("inf")}, "leak must be a finite number > 1"),
        ({"factor": 4, "leak": "large"}, "leak must be None \\(ReRoPE\\), 'auto' or a number > 1, got 'large'"),
        ({"factor": 4, "leak": True}, "leak must be None"),
        ({"factor": 8, "leak": 4, "window": 32}, r"leak 4 with window 32 reaches 413 tokens, less than factor 8 x 128"),
        # the leak as given, not rounded: a leak just above 1 is no "leak 1", which is refused
        ({"factor": 4, "leak": 1.0000001, "window": 32}, r"leak 1\.0000001 with window 32 reaches 128 tokens"),
        ({"factor": 4, "window": 128}, "must be smaller than the trained window"),
        ({"factor": 4, "window": 127, "leak": "auto"}, "Leaky ReRoPE at window 127 reaches only 128 tokens"),
        ({"leak": 2, "window": 127}, "does not extend a 128-token window"),
        ({"factor": 4, "granularity": 4}, "unknown parameter"),  # a record's old schedule: tests/method/test_attention_side.py
        ({"factor": 4, "causal": "yes"}, "causal must be True or False"),
        ({"factor": 4, "group": 4}, "unknown parameter"),
        ({"factor": 4, "window": 2.5}, "must be an int"),
        ({"factor": 1, "leak": 6}, "factor must be a finite number > 1"),
    ],
)
def test_bad_parameters_change_nothing(tiny_model, kwargs, message):
    # the messages name the tiny model's 128-token window: refused on that model, not a random one
    assert_refused_unchanged("rerope", kwargs, message, model=tiny_model)


def _ppl(model, ids, first):
    with torch.no_grad():
        logits = model(ids).logits[0, first - 1 : -1]
    return torch.nn.functional.cross_entropy(logits, ids[0, first:]).exp().item()


def test_beats_plain_rope_at_four_times_the_window(tiny_model, heldout_ids):
    starts = range(0, 6 * 4 * TRAINED, 4 * TRAINED)
    passages = [heldout_ids[None, s : s + 4 * TRAINED] for s in starts]
    plain = sum(_ppl(tiny_model, p, 2 * TRAINED) for p in passages) / len(passages)
    for params in ({}, {"leak": "auto"}):
        rope_ext.patch(tiny_model, "rerope", factor=4, **params)
        extended = sum(_ppl(tiny_model, p, 2 * TRAINED) for p in passages) / len(passages)
        assert extended < 0.8 * plain, (params, extended, plain)
