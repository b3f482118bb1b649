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
