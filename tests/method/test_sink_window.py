"""sink_window: local attention with attention sinks (rope_ext.method.sink_window), against its
definition written out with full [S, S] matrices, its bounded KV cache, and on the tiny trained
model. What every attention-side method meets (exactness inside the window, caching, saving,
refusals) is in test_attention_methods.py."""

import pytest
import torch
import torch.nn.functional as F

import rope_ext
from rope_ext.attention import AttentionTransform
from rope_ext.method.sink_window import SinkWindowCache

from helpers import WINDOW, assert_refused_unchanged, ppl_past_window, random_ids, random_model, rotate, set_chain


class NaiveSinkWindow(AttentionTransform):
    """The definition with full matrices, for one unpadded sequence: a query at i sees keys j < s
    (query at min(i, s + w - 1), key at j) and keys i - w < j <= i (positions i and j), nothing else."""

    def __init__(self, rotary):
        self.rotary = rotary

    def __call__(self, module, query, key, value, attention_mask, attend, scaling=None, **kwargs):
        frame, geometry, params = self.rotary.frame, self.rotary.geometry, self.rotary.params
        i, j = frame.q_pos[0], frame.k_pos[0]
        s, w, dim = params["sinks"], params["window"], geometry.rotary_dim
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)

        def scores(q_positions, k_positions):
            return rotate(query, q_positions, geometry.base, dim) @ rotate(key, k_positions, geometry.base, dim).transpose(-1, -2)

        sink = (j < s)[None, :]
        chosen = torch.where(sink, scores(torch.clamp(i, max=s + w - 1), j), scores(i, j)) * scaling
        distance = i[:, None] - j[None, :]
        visible = (distance >= 0) & (sink | (distance < w))
        chosen = chosen.masked_fill(~visible, float("-inf"))
        return (chosen.softmax(-1) @ value).transpose(1, 2), None


@pytest.mark.parametrize("params", [{}, {"sinks": 0}, {"sinks": 2, "window": 20}, {"sinks": 7, "window": 1}])
def test_matches_the_definition(params):
    model = random_model("qwen2")
    rope_ext.patch(model, "sink_window", factor=4, **params)
    x = random_ids(4 * WINDOW)
    with torch.no_grad():
        ours = model(x).logits
        set_chain(model, [NaiveSinkWindow(model.model.rotary_emb)])
        naive = model(x).logits
    assert (ours - naive).abs().max() < 1e-5


def test_defaults_fill_the_trained_window():
    info = rope_ext.patch(random_model(), "sink_window", factor=4)
    assert (info.params["sinks"], info.params["window"], info.max_length) == (4, WINDOW - 4, 4 * WINDOW)


@pytest.mark.parametrize("params", [{}, {"sinks": 2, "window": 50}, {"sinks": 0, "window": 30}])
def test_the_bounded_cache_lets_go_only_keys_no_query_sees(tiny_model, heldout_ids, params):
    """chunked prefill and decoding through a SinkWindowCache: the numbers of one forward, with
    the cache holding sinks + window - 1 keys per layer however long the input."""
    x = heldout_ids[None, :400]
    info = rope_ext.patch(tiny_model, "sink_window", factor=4, **params)
    held = info.params["sinks"] + info.params["window"] - 1
    with torch.no_grad():
        full = tiny_model(x).logits
        cache = rope_ext.chunked.new_cache(tiny_model)
        assert isinstance(cache, SinkWindowCache)
        hidden, _ = rope_ext.chunked_forward(tiny_model, x[:, :300], chunk_size=37, cache=cache)
        assert [layer.held() for layer in cache.layers] == [held] * len(cache.layers)
        assert cache.get_seq_length() == 300
        steps = [tiny_model(x[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(300, 400)]
        nll = rope_ext.chunked_nll(tiny_model, x, chunk_size=64)
    assert [layer.held() for layer in cache.layers] == [held] * len(cache.layers)
    assert (tiny_model.lm_head(hidden) - full[:, :300]).abs().max() <= 1e-4
    assert (torch.cat(steps, dim=1) - full[:, 300:]).abs().max() <= 1e-4
    expected = F.cross_entropy(full[0, :-1], x[0, 1:], reduction="none").double()
    assert (nll - expected).abs().max() <= 1e-4


def test_generation_through_the_bounded_cache_gives_the_same_tokens(tiny_model, heldout_ids):
    rope_ext.patch(tiny_model, "sink_window", factor=4, sinks=2, window=40)
    prompt = heldout_ids[None, :300]
    with torch.no_grad():
        bounded = rope_ext.chunked_generate(tiny_model, prompt, chunk_size=64, max_new_tokens=30, do_sample=False)
        every_key = tiny_model.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(bounded, every_key)


def test_the_bounded_cache_cannot_be_cropped(tiny_model, heldout_ids):
    rope_ext.patch(tiny_model, "sink_window", factor=4, sinks=2, window=40)
    _, cache = rope_ext.chunked_forward(tiny_model, heldout_ids[None, :100], chunk_size=50)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)


def test_reads_past_the_window_better_than_plain_rope(tiny_path, heldout_ids):
    passages = torch.stack([heldout_ids[s : s + 513] for s in range(0, 8 * 513, 513)])
    assert ppl_past_window(tiny_path, passages, "sink_window") < 0.9 * ppl_past_window(tiny_path, passages, "plain")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sinks": WINDOW}, "sinks must be below the trained window"),
        ({"window": WINDOW}, "exceeds the trained window"),
        ({"sinks": -1}, "sinks must be an int"),
        ({"window": 1.5}, "window .* must be an int"),
        ({"sinks": True}, "sinks must be an int"),
        ({"causal": False}, "unknown parameter"),  # a record's old schedule: tests/method/test_attention_side.py
    ],
)
def test_bad_parameters_change_nothing(kwargs, message):
    assert_refused_unchanged("sink_window", {"factor": 4, **kwargs}, message)
