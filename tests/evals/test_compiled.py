"""rope_ext.evals.compiled: a decode step through torch.compile, warmed up beside eager steps, as
bench/decode.py --compile and bench/gpu_check.py run it."""

import pytest
from transformers import DynamicCache

import rope_ext
from rope_ext.evals.compiled import compile_step, warm_up


def fresh_cache(model):
    return DynamicCache(config=model.config)


def test_a_step_that_fails_to_compile_is_stated_not_raised(tiny_model, heldout_ids):
    def fails(*args, **kwargs):
        raise RuntimeError("no kernel for this shape\nthe rest of the trace")

    assert warm_up(tiny_model, fails, heldout_ids[None, :200], fresh_cache, 2) == {
        "error": "RuntimeError: no kernel for this shape"
    }


@pytest.mark.parametrize("method", ["plain", "yarn", "self_extend"])
def test_compiled_decode_gives_eager_decode_on_the_tiny_model(tiny_model, heldout_ids, method):
    """Past the trained window (300 tokens over 128): the compiled steps' greedy tokens are eager
    decode's and their fp32 logits within 1e-5 of the largest (inductor's kernels round in their
    own order); plain and yarn compile to one graph, self_extend's rotation inside attention
    breaks it where its per-forward state lives."""
    if method != "plain":
        rope_ext.patch(tiny_model, method, factor=4.0)
    result = warm_up(tiny_model, compile_step(tiny_model), heldout_ids[None, :300], fresh_cache, 3)
    assert result["same_tokens"] and result["max_rel_gap"] < 1e-5, result
    if method != "self_extend":
        assert result["graph_breaks"] == 0 and result["graphs"] <= 1
