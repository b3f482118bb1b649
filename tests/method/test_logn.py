"""logn: Qwen's log-n attention scale (rope_ext.attention.Rotator.scale_queries, docs/logn.md) on the methods
whose attention rotates each query itself, on the tiny trained model (window 128)."""

import math

import pytest
import torch

import rope_ext
from rope_ext import cli
from rope_ext import loading
from rope_ext.method import REGISTRY

from helpers import assert_refused_unchanged, assert_saves_reloads_and_unpatches, cached_logits, ppl_past_window

TRAINED = 128  # the tiny model's window
METHODS = [name for name, m in REGISTRY.items() if m.takes_query_scales]  # every method with `logn`
# one method per attention transform (RotateInAttention, TwoPartAttention, DualChunkAttention)
CACHED = ["dynamic", "self_extend", "dca"]


def slow_if_causal_dynamic(method: str, params: dict | None = None):
    """A pytest param; dynamic and dynamic_yarn under their causal schedule (a scaling per token past
    the window, each attended apart) take seconds per long forward: marked integration."""
    values = (method,) if params is None else (method, params)
    slow = method in ("dynamic", "dynamic_yarn") and (params or {}).get("causal", True)
    return pytest.param(*values, marks=[pytest.mark.integration] if slow else [])


def fp32_factors(length: int) -> torch.Tensor:
    """[length] log-n factors in fp32, written from the formula: for the 1-based position i,
    log(i) / log(L) when i > L, else 1."""
    i = torch.arange(1, length + 1)
    return torch.where(i > TRAINED, i.float().log() / math.log(TRAINED), 1.0)


def qwen_factors(length: int) -> torch.Tensor:
    """Qwen-7B's own list (modeling_qwen.py, use_logn_attn), in float64 rounded once to fp32."""
    return torch.tensor([math.log(i, TRAINED) if i > TRAINED else 1 for i in range(1, length + 1)])


@torch.no_grad()
def logits_with_scaled_q_proj(model, ids, factors):
    """Logits with every layer's q_proj output at position p times factors[p]: the log-n scale put
    on the queries before their rotation, by the model itself rather than by rope-ext."""

    def scale(module, args, output):
        return output * factors[None, : output.shape[1], None]

    hooks = [layer.self_attn.q_proj.register_forward_hook(scale) for layer in model.model.layers]
    try:
        return model(ids).logits
    finally:
        for hook in hooks:
            hook.remove()


# 1. inside the window: not a bit changes


@pytest.mark.parametrize("method", METHODS)
def test_inside_the_window_logn_changes_no_bit(tiny_model, heldout_ids, method):
    ids = heldout_ids[None, : 3 * TRAINED]
    outputs = []
    with torch.no_grad():
        for logn in (False, True):
            rope_ext.patch(tiny_model, method, factor=4, logn=logn)
            outputs.append((tiny_model(ids[:, :TRAINED]).logits, tiny_model(ids).logits[:, :TRAINED]))
    (short, long), (short_logn, long_logn) = outputs
    assert torch.equal(short, short_logn)
    assert torch.equal(long, long_logn)  # the rows of a longer forward that have seen at most L tokens


# 2. past the window: the scale written out, applied before the rotation


@pytest.mark.parametrize("method, params", [slow_if_causal_dynamic(m, {}) for m in METHODS] + [("dynamic", {"causal": False})])
def test_past_the_window_it_is_the_query_projection_scaled(tiny_model, heldout_ids, method, params):
    """At 4x the window: logn=True against the same patch with logn=False and q_proj's output
    scaled by the factors. With the formula in fp32 the two agree within 1e-5 (measured: equal);
    Qwen's list, rounded once from float64, is 1 ulp off the fp32 factors at about a quarter of the
    positions, which moves the logits by up to 1e-5 (measured 9.5e-6), the model's fp32 noise."""
    ids = heldout_ids[None, : 4 * TRAINED]
    with torch.no_grad():
        info = rope_ext.patch(tiny_model, method, factor=4, logn=True, **params)
        ours = tiny_model(ids).logits
        rope_ext.patch(tiny_model, method, factor=4, **params)
        without = tiny_model(ids).logits
    assert info.params["logn"] is True
    assert (ours - logits_with_scaled_q_proj(tiny_model, ids, fp32_factors(ids.shape[1]))).abs().max() <= 1e-5
    assert (ours - logits_with_scaled_q_proj(tiny_model, ids, qwen_factors(ids.shape[1]))).abs().max() <= 3e-5
    assert (ours[:, TRAINED:] - without[:, TRAINED:]).abs().max() > 0.1  # the scale acts past the window


@pytest.mark.parametrize("method", [slow_if_causal_dynamic(m) for m in ["dynamic", "self_extend", "rerope"]])
def test_a_left_padded_row_is_scaled_by_its_positions(tiny_model, heldout_ids, method):
    """A row with `pad` padding tokens on the left, positions from 0 at its first real token (as
    generate gives them): its logits are those of the same tokens alone, so the scale follows the
    positions, not the key indices."""
    pad = 40
    ids = heldout_ids[None, : 3 * TRAINED]
    batch = torch.cat((ids, torch.cat((torch.zeros(1, pad, dtype=ids.dtype), ids[:, pad:]), dim=1)))
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    rope_ext.patch(tiny_model, method, factor=4, logn=True)
    with torch.no_grad():
        padded = tiny_model(batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        alone = tiny_model(ids[:, pad:]).logits
        full = tiny_model(ids).logits
    assert (padded[:1] - full).abs().max() <= 1e-4
    assert (padded[1:, pad:] - alone).abs().max() <= 1e-4


# 3. one forward, chunked prefill and token-by-token decoding (the attention-side methods with
# logn: their rows in test_attention_methods.py)


@pytest.mark.integration
def test_chunked_prefill_and_decoding_equal_one_forward(tiny_model, heldout_ids):
    ids = heldout_ids[None, : 3 * TRAINED]
    rope_ext.patch(tiny_model, "dynamic", factor=4, logn=True)
    with torch.no_grad():
        full = tiny_model(ids).logits
    assert (cached_logits(tiny_model, ids, 37) - full).abs().max() <= 1e-4
    assert (cached_logits(tiny_model, ids, 1, prefill=TRAINED - 4) - full[:, TRAINED - 4 :]).abs().max() <= 1e-4


# 4. saving, reloading, unpatching (the attention-side methods with logn: their rows in
# test_attention_methods.py)


def test_save_reload_and_unpatch(tiny_model, heldout_ids, tmp_path):
    params = {"factor": 4, "causal": False, "logn": True}
    assert_saves_reloads_and_unpatches(tiny_model, "dynamic", params, heldout_ids[None, : 3 * TRAINED], tmp_path)


# 5. the parameter: which methods take it, its values, the command line


def test_the_methods_that_rotate_queries_in_attention_take_logn(capsys):
    listed = rope_ext.methods()
    assert {name for name, spec in listed.items() if "logn" in spec["params"]} == set(METHODS)
    assert all(listed[name]["params"]["logn"] is False for name in METHODS)
    assert cli.main(["methods"]) == 0
    out = capsys.readouterr().out
    assert out.count("logn=False") == len(METHODS)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("value", ["true", 1, None])
def test_a_value_other_than_true_or_false_is_refused(method, value):
    assert_refused_unchanged(method, {"factor": 4, "logn": value}, f"{method}: logn must be True or False, got {value!r}")


@pytest.mark.parametrize("method", ["sink_window", "yarn", "ntk", "alibi_hybrid"])
def test_other_methods_do_not_know_logn(method):
    assert_refused_unchanged(method, {"factor": 4, "logn": True}, r"unknown parameter\(s\) \['logn'\]")


def test_the_command_line_turns_logn_on():
    params = loading.parse_params(["logn=true"])
    assert params == {"logn": True}
    loading.check_method("self_extend", 4, params)


# 6. native rope_parameters


def test_dynamic_with_logn_has_no_native_form(tiny_model):
    rope = dict(tiny_model.config.rope_parameters)
    info = rope_ext.patch(tiny_model, "dynamic", factor=4, causal=False)
    assert info.native == {"rope_type": "dynamic", "factor": 4.0, "rope_theta": rope["rope_theta"]}
    info = rope_ext.patch(tiny_model, "dynamic", factor=4, causal=False, logn=True)
    assert info.native is None and info.params["logn"] is True
    assert tiny_model.config.rope_parameters == rope and tiny_model.config.max_position_embeddings == TRAINED


# 7. perplexity past the window (reported; `pytest -s` prints it)


@pytest.mark.integration
def test_perplexity_past_the_window_with_and_without_logn(tiny_path, heldout_ids):
    passages = torch.stack([heldout_ids[s : s + 513] for s in range(0, 16 * 513, 513)])
    plain = ppl_past_window(tiny_path, passages, "plain")
    print(f"\ntiny model, 16 passages of 512 tokens, PPL at positions 128-511; plain {plain:.2f}")
    for method in CACHED:
        without, with_logn = (ppl_past_window(tiny_path, passages, method, logn=logn) for logn in (False, True))
        print(f"{method} x4: {without:.2f} without logn, {with_logn:.2f} with logn")
        assert without != with_logn
