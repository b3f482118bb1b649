"""What a forward of a method that rotates inside attention computes once and holds: cos/sin of the
positions once per forward, not once per layer, and, for the dynamic methods' causal schedule,
O(length) of them at any number of groups. Results stay those of the full forward
(test_dynamic_cache.py, test_attention_methods.py)."""

import sys
import weakref

import pytest
import torch
from transformers import DynamicCache

import rope_ext
import rope_ext.attention.rotate
import rope_ext.rotation

from helpers import load_llama


class CosSinCalls:
    """Counts the calls of rope_ext's cos_sin (in every rope_ext module that calls it) and keeps
    weak references to what they return, to tell what is still held."""

    def __init__(self, monkeypatch):
        self.calls, self.outputs = 0, []
        original = rope_ext.rotation.cos_sin

        def counted(*args, **kwargs):
            self.calls += 1
            result = original(*args, **kwargs)
            self.outputs += [weakref.ref(t) for t in result]
            return result

        for module in [m for name, m in sys.modules.items() if name.startswith("rope_ext")]:
            if getattr(module, "cos_sin", None) is original:
                monkeypatch.setattr(module, "cos_sin", counted)

    def held(self) -> int:
        """Elements of the cos/sin tensors still alive."""
        return sum(t.numel() for t in (ref() for ref in self.outputs) if t is not None)


def decode_step_calls(model, ids, monkeypatch) -> int:
    """cos_sin calls of one decode step after a prefill of `ids`."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache, use_cache=True)
        counter = CosSinCalls(monkeypatch)
        model(ids[:, -1:], cache=cache, use_cache=True)
    monkeypatch.undo()
    return counter.calls


@pytest.mark.parametrize(
    "method, params",
    [
        ("self_extend", {"factor": 4}),
        ("rerope", {"factor": 4}),
        ("dca", {"factor": 4}),
        ("string", {"factor": 4, "local": 16}),
        ("sink_window", {"factor": 4}),
    ],
)
def test_a_decode_step_computes_cos_sin_once_not_per_layer(tiny_path, heldout_ids, monkeypatch, method, params):
    """A decode step past the window rotates the cache by the same distances in every layer: the
    4-layer tiny model computes as many cos/sin as its first layer alone."""
    ids = heldout_ids[None, :300]  # past the 128-token window
    calls = {}
    for layers in (1, 4):
        model = load_llama(tiny_path, num_hidden_layers=layers)
        rope_ext.patch(model, method, **params)
        calls[layers] = decode_step_calls(model, ids, monkeypatch)
    assert calls[4] == calls[1]


def prefill_calls(model, ids, monkeypatch) -> int:
    """cos_sin calls of one forward over `ids`."""
    counter = CosSinCalls(monkeypatch)
    with torch.no_grad():
        model(ids)
    monkeypatch.undo()
    return counter.calls


@pytest.mark.parametrize("method, params", [("dca", {"factor": 4}), ("yarn_dca", {"factor": 4})])
def test_a_prefill_computes_cos_sin_once_not_per_layer(tiny_path, heldout_ids, monkeypatch, method, params):
    """A prefill past the window rotates every chunk's queries and keys by the same positions in
    every layer: the 4-layer tiny model computes as many cos/sin as its first layer alone."""
    ids = heldout_ids[None, :300]  # several chunks past the 128-token window
    calls = {}
    for layers in (1, 4):
        model = load_llama(tiny_path, num_hidden_layers=layers)
        rope_ext.patch(model, method, **params)
        calls[layers] = prefill_calls(model, ids, monkeypatch)
    assert calls[4] == calls[1]


@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_causal_schedule_holds_cos_sin_of_a_few_groups(tiny_model, heldout_ids, monkeypatch, method):
    """A prompt 96 tokens past the window at granularity 1 is 97 groups, each rotating its whole
    key prefix; the forward holds the cos/sin of at most HELD_GROUPS of them (and of the queries),
    not one set per group."""
    rope_ext.patch(tiny_model, method, factor=4)
    window = tiny_model.config.max_position_embeddings
    length = window + 96
    counter = CosSinCalls(monkeypatch)
    with torch.no_grad():
        tiny_model(heldout_ids[None, :length])
    one_set = 2 * length * tiny_model.config.head_dim  # cos and sin of every key
    held = counter.held() / one_set
    assert held <= rope_ext.attention.rotate.RotateInAttention.HELD_GROUPS + 1, held
