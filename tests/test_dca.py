"""dca: Dual Chunk Attention (rope_ext.method.dca), against its definition written out with full
[S, S] matrices, its parameters, and on the tiny trained model. What every attention-side method
meets (exactness inside the window, caching, saving, refusals) is in test_attention_methods.py."""

import copy

import pytest
import torch

import rope_ext
from rope_ext.attention import AttentionTransform
from rope_ext.method import dca

from helpers import WINDOW, assert_refused_unchanged, ppl_past_window, random_ids, random_model, rotate, set_chain


class NaiveDualChunk(AttentionTransform):
    """The three position maps with full matrices, for one unpadded sequence: a query below
    chunk_size keeps its own positions; others see keys at j mod s and sit at i mod s (same chunk),
    min(i mod s + s, c - 1) (previous chunk) or c - 1 (earlier chunks)."""

    def __init__(self, rotary):
        self.rotary = rotary

    def __call__(self, module, query, key, value, attention_mask, attend, scaling=None, **kwargs):
        frame, geometry, params = self.rotary.frame, self.rotary.geometry, self.rotary.params
        i, j = frame.q_pos[0], frame.k_pos[0]
        c, s, dim = params["chunk_size"], params["chunk_size"] - params["local_size"], geometry.rotary_dim
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)

        def scores(q_positions, k_positions):
            return rotate(query, q_positions, geometry.base, dim) @ rotate(key, k_positions, geometry.base, dim).transpose(-1, -2)

        own, intra = scores(i, j), scores(i % s, j % s)
        succ, inter = scores(torch.clamp(i % s + s, max=c - 1), j % s), scores(torch.full_like(i, c - 1), j % s)
        step = (i // s)[:, None] - (j // s)[None, :]
        dca = torch.where(step == 0, intra, torch.where(step == 1, succ, inter))
        chosen = torch.where((i < c)[:, None], own, dca) * scaling
        chosen = chosen.masked_fill(i[:, None] < j[None, :], float("-inf"))
        return (chosen.softmax(-1) @ value).transpose(1, 2), None


@pytest.mark.parametrize("params", [{}, {"chunk_size": 48, "local_size": 6}, {"local_size": 20}])
def test_matches_the_definition(monkeypatch, params):
    model = random_model("qwen2")
    rope_ext.patch(model, "dca", factor=4, **params)
    x = random_ids(4 * WINDOW)
    masks = []
    attend_with_lse = dca.attend_with_lse

    def recorded(query, key, value, *, mask=None, **kwargs):
        masks.append(mask)
        return attend_with_lse(query, key, value, mask=mask, **kwargs)

    monkeypatch.setattr(dca, "attend_with_lse", recorded)
    with torch.no_grad():
        ours = model(x).logits
        set_chain(model, [NaiveDualChunk(model.model.rotary_emb)])
        naive = model(x).logits
    assert (ours - naive).abs().max() < 1e-5
    # the rows past chunk_size (the first of them mid-chunk) attend without a mask
    assert masks and all(mask is None for mask in masks)


def test_fp32_rounding_past_the_window_is_that_of_plain_attention(tiny_model, heldout_ids):
    """The three parts merged by log-sum-exp add no error beyond fp32 rounding: against the same
    model in fp64, the patched fp32 logits are about as close as plain attention's."""
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, : 4 * window]
    exact = copy.deepcopy(tiny_model).double()
    with torch.no_grad():
        plain_error = (tiny_model(ids).logits.double() - exact(ids).logits).abs().max()
        rope_ext.patch(tiny_model, "dca", factor=4)
        rope_ext.patch(exact, "dca", factor=4)
        error = (tiny_model(ids).logits.double() - exact(ids).logits)[:, window:].abs().max()
    assert error <= 2 * plain_error, (error, plain_error)


def test_reads_past_the_window_better_than_plain_rope(tiny_path, heldout_ids):
    passages = torch.stack([heldout_ids[s : s + 513] for s in range(0, 16 * 513, 513)])
    assert ppl_past_window(tiny_path, passages, "dca") < 0.9 * ppl_past_window(tiny_path, passages, "plain")


def test_qwen_dual_chunk_attention_config_sets_chunk_local_and_window():
    model = random_model("qwen2", max_position_embeddings=4 * WINDOW)
    model.config.dual_chunk_attention_config = {"chunk_size": 48, "local_size": 4, "original_max_position_embeddings": WINDOW}
    info = rope_ext.patch(model, "dca", factor=4)
    assert (info.params["chunk_size"], info.params["local_size"], info.original_window) == (48, 4, WINDOW)
    assert info.max_length == 4 * WINDOW
    explicit = rope_ext.patch(model, "dca", factor=4, chunk_size=32, local_size=8)
    assert (explicit.params["chunk_size"], explicit.params["local_size"]) == (32, 8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunk_size": 2 * WINDOW}, "exceeds the trained window"),
        ({"local_size": WINDOW}, "local_size must be between"),
        ({"chunk_size": 1.5}, "must be an int"),
        ({"causal": False}, "do not apply"),
    ],
)
def test_bad_parameters_change_nothing(kwargs, message):
    assert_refused_unchanged("dca", {"factor": 4, **kwargs}, message)
