"""Patched models at run time: caches, outputs and objects that reach a patch it does not fit are
refused with the reason, and a patched model survives torch.save."""

from __future__ import annotations

import pytest
import torch

import rope_ext
from rope_ext import chunked
from rope_ext.method.sink_window import SinkWindowCache


@pytest.mark.parametrize("method, params", [(None, {}), ("dynamic", {}), ("sink_window", {"sinks": 2, "window": 60})])
def test_a_sink_window_cache_is_refused_by_a_model_it_does_not_fit(tiny_model, heldout_ids, method, params):
    """A SinkWindowCache lets keys go that any other model (or sink_window with other sizes) would
    attend: that model would compute wrong logits from it without a word."""
    if method is not None:
        rope_ext.patch(tiny_model, method, factor=4, **params)
    cache = SinkWindowCache(tiny_model.config.num_hidden_layers, sinks=4, window=60)
    with pytest.raises(ValueError, match=r"SinkWindowCache\(sinks=4, window=60\)"), torch.no_grad():
        tiny_model(heldout_ids[None, :200], cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0


def test_a_sink_window_cache_serves_the_patch_it_was_made_for(tiny_model, heldout_ids):
    rope_ext.patch(tiny_model, "sink_window", factor=4, sinks=4, window=60)
    ids = heldout_ids[None, :200]
    cache = chunked.new_cache(tiny_model)
    with torch.no_grad():
        full = tiny_model(ids).logits
        first = tiny_model(ids[:, :150], cache=cache, use_cache=True).logits
        rest = tiny_model(ids[:, 150:], cache=cache, use_cache=True).logits
    assert (torch.cat((first, rest), dim=1) - full).abs().max() <= 1e-4


SPLIT_SOFTMAX = ["self_extend", "rerope", "string", "dca", "sink_window"]


@pytest.mark.parametrize("method, attn", [*((m, "eager") for m in SPLIT_SOFTMAX), ("dynamic", "sdpa"), ("self_extend", "sdpa")])
def test_output_attentions_is_refused_where_the_patch_has_no_weights(tiny_model, heldout_ids, method, attn):
    """Methods that merge one softmax from several calls have no weights to return, nor has a
    backend that computes none; the model returned an empty tuple without a word."""
    tiny_model.set_attn_implementation(attn)
    rope_ext.patch(tiny_model, method, factor=4)
    window = tiny_model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"output_attentions=True: {method}"), torch.no_grad():
        tiny_model(heldout_ids[None, : 2 * window], output_attentions=True)


@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_output_attentions_of_the_rotation_inside_attention_are_its_weights(tiny_model, heldout_ids, method):
    """Past the window the causal schedule attends in groups of rows; the weights gathered from the
    groups are those each row has when decoded alone (one call through eager)."""
    tiny_model.set_attn_implementation("eager")
    rope_ext.patch(tiny_model, method, factor=4, granularity=8)
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, : 2 * window]
    with torch.no_grad():
        full = tiny_model(ids, output_attentions=True).attentions
        cache = chunked.new_cache(tiny_model)
        tiny_model(ids[:, :-5], cache=cache, use_cache=True)
        steps = [
            tiny_model(ids[:, t : t + 1], cache=cache, use_cache=True, output_attentions=True).attentions
            for t in range(ids.shape[1] - 5, ids.shape[1])
        ]
    assert len(full) == tiny_model.config.num_hidden_layers
    for layer, weights in enumerate(full):
        assert weights.shape[-2:] == (2 * window, 2 * window)
        assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)
        for k, step in enumerate(steps):
            t = ids.shape[1] - 5 + k
            assert (step[layer][:, :, 0] - weights[:, :, t, : t + 1]).abs().max() <= 1e-5
