"""Context extension on a model that was actually trained (the tiny Gutenberg LLaMA, window W):
past the window the scaled methods must read text better than plain RoPE, and inside it the
dynamic methods must be the unpatched model exactly."""

import pytest
import torch

import rope_ext
from rope_ext.evals.data import Document
from rope_ext.evals.perplexity import evaluate


def perplexity(model, heldout_ids, length, n_windows=6):
    """Token-level PPL of `n_windows` non-overlapping held-out windows of `length` tokens."""
    doc = Document("heldout", heldout_ids[: n_windows * length])
    return evaluate(model, [doc], [length], progress=False)[length]["ppl"]


@pytest.fixture(scope="module")
def plain_at_4x(tiny_path, heldout_ids):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    window = model.config.max_position_embeddings
    return window, perplexity(model, heldout_ids, window), perplexity(model, heldout_ids, 4 * window)


@pytest.mark.parametrize("method", ["ntk", "dynamic", "yarn"])
def test_scaled_methods_beat_plain_rope_at_4x_the_window(tiny_model, heldout_ids, plain_at_4x, method):
    window, plain_1x, plain_4x = plain_at_4x
    assert plain_4x > 1.5 * plain_1x, "plain RoPE should break past the window of the fixture"
    rope_ext.patch(tiny_model, method, factor=4)
    scaled_4x = perplexity(tiny_model, heldout_ids, 4 * window)
    assert scaled_4x < 0.8 * plain_4x, (method, scaled_4x, plain_4x)


@pytest.mark.parametrize("params", [{}, {"causal": False}, {"granularity": 32}])
@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_dynamic_methods_are_exact_inside_the_window(tiny_model, heldout_ids, method, params):
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, :window]
    with torch.no_grad():
        plain = tiny_model(ids).logits
        rope_ext.patch(tiny_model, method, factor=4, **params)
        patched = tiny_model(ids).logits
    assert torch.equal(patched, plain)
