"""M-RoPE (Qwen 3.5): the rotary module is called with a row of positions per axis (text, height,
width), `mrope_section` splitting the frequencies among the axes. For text the axes are equal and
M-RoPE is plain RoPE: rope-ext patches these models exactly there, and refuses at run time a
forward whose axes differ (image or video positions), the model unchanged (docs/families.md).

The models are the census's tiny random fp32 models (tests/census_configs.py, norm weights moved
from 1, one linear-attention and one softmax-attention layer); no M-RoPE architecture takes the tiny
trained LLaMA's weights. SECTIONED gives the text types a rotated span wide enough for every axis to
own frequencies (8 pairs split 3, 3, 2, interleaved as Qwen 3.5 checkpoints are)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import rope_ext
from rope_ext.patches.probe import REASONS, probe

from helpers import leaves_the_trained_window, patch_params, registered, rotates_inside_attention, takes_a_partial_rotation
from test_census import DECODE_TOLERANCE, WINDOW, check, decode_gap, equal_models, ids, logits, tiny, twin_of

TYPES = ["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"]
SECTIONED = dict(
    head_dim=64,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
)
# the static frequency changes, which need nothing of attention: each has a native form
FREQUENCY_METHODS = registered(lambda method: method.rotation == "static" and not method.needs_attention_interface)


def build(model_type: str, **overrides):
    model = tiny(model_type, **overrides)
    assert model is not None, f"{model_type} does not build with the census shrink"
    return model


def axes(length: int, shift: int = 0) -> torch.LongTensor:
    """Per-axis positions [3, 1, length] (text, height, width); `shift` moves the height axis, as
    an image's grid would."""
    positions = torch.arange(length).expand(3, 1, length).clone()
    positions[1] += shift
    return positions


@pytest.mark.slow  # takes long
@pytest.mark.parametrize("model_type", TYPES)
def test_each_type_passes_the_census_check(model_type, tmp_path):
    model = build(model_type)
    assert probe(model).axes == 3
    refusals = {}
    assert check(model, tmp_path, refusals) is None
    assert refusals == {}  # softmax layers of plain causal attention: every attention-side method applies


@pytest.mark.parametrize("method", FREQUENCY_METHODS)
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_frequency_methods_equal_transformers_mrope_twin_for_text(model_type, method):
    plain = build(model_type, **SECTIONED)
    model = copy.deepcopy(plain)
    if not takes_a_partial_rotation(method):  # SECTIONED rotates a quarter of each head
        with pytest.raises(ValueError, match=f"^{method}: "):
            rope_ext.patch(model, method, factor=4, **patch_params(method, model))
        assert equal_models(model, plain)
        return
    info = rope_ext.patch(model, method, factor=4, **patch_params(method, model))

    assert info.native is not None
    rope = model.config.rope_parameters
    assert rope["rope_type"] == rope_ext.methods()[method]["native_type"]
    # the axes' split of the frequencies stays, so that the reloaded model is Qwen 3.5's M-RoPE
    assert rope["mrope_section"] == [3, 3, 2] and rope["mrope_interleaved"] is True
    config = copy.deepcopy(model.config)
    del config.rope_ext
    twin = twin_of(plain, config)
    past = ids(WINDOW + 36, seed=1)
    assert torch.equal(logits(model, past), logits(twin, past))
    # per-axis positions, equal: what the composite model computes for text
    with torch.no_grad():
        assert torch.equal(model(past, position_ids=axes(past.shape[1])).logits, logits(twin, past))
    assert decode_gap(model, past[:, : WINDOW + 8], WINDOW - 4) <= DECODE_TOLERANCE


@pytest.mark.parametrize("method", registered(rotates_inside_attention))
def test_methods_rotating_inside_attention_leave_the_first_window_exact(method):
    """Inside the window each that leaves a LLaMA's trained window as it was rotates by the trained
    frequencies: the model's own logits, bit for bit (not string, which moves distances past a shift
    inside the window by design, nor longrope, whose short factors rescale it); every one decodes
    as one forward and unpatches exactly."""
    plain = build("qwen3_5_text", **SECTIONED)
    model = copy.deepcopy(plain)
    inside, past = ids(WINDOW), ids(WINDOW + 36, seed=1)

    rope_ext.patch(model, method, factor=4, **patch_params(method, model))

    if leaves_the_trained_window(method):
        assert torch.equal(logits(model, inside), logits(plain, inside))
        with torch.no_grad():
            assert torch.equal(model(inside, position_ids=axes(WINDOW)).logits, logits(plain, inside))
    assert decode_gap(model, past[:, : WINDOW + 8], WINDOW - 4) <= DECODE_TOLERANCE
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, inside), logits(plain, inside))


def test_dynamic_equals_transformers_dynamic_mrope_past_the_window():
    """Past the window, rope-ext's rotation inside attention gives the logits of transformers' own
    dynamic NTK, which Qwen 3.5's M-RoPE module applies to every axis alike."""
    plain = build("qwen3_5_text", **SECTIONED)
    model = copy.deepcopy(plain)
    past = ids(2 * WINDOW, seed=1)
    info = rope_ext.patch(model, "dynamic", factor=4, causal=False)
    config = copy.deepcopy(plain.config)
    config.rope_parameters = {**config.rope_parameters, **info.native}
    assert config.rope_parameters["rope_type"] == "dynamic"
    assert torch.equal(logits(model, past), logits(twin_of(plain, config), past))


@pytest.mark.parametrize("method", registered())
def test_a_forward_with_differing_axes_is_refused_and_changes_nothing(method):
    model = build("qwen3_5_text", **SECTIONED)
    if not takes_a_partial_rotation(method):
        pytest.skip(f"{method} does not patch a model that rotates part of each head")
    rope_ext.patch(model, method, factor=4, **patch_params(method, model))
    x = ids(WINDOW + 8, seed=2)
    before = logits(model, x)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :8], cache=cache, use_cache=True)
    held = cache.get_seq_length()
    kept = copy.deepcopy(model)

    with pytest.raises(ValueError, match=rf"rope_ext {method}: .* differ between M-RoPE's 3 axes"):
        with torch.no_grad():
            model(x[:, 8:16], position_ids=axes(8, shift=3) + 8, cache=cache, use_cache=True)

    assert cache.get_seq_length() == held
    assert equal_models(model, kept)
    assert torch.equal(logits(model, x), before)


def test_the_unpatched_model_takes_differing_axes():
    """The refusal is the patch's: transformers' own M-RoPE rotates image positions."""
    model = build("qwen3_5_text", **SECTIONED)
    with torch.no_grad():
        moved = model(ids(8), position_ids=axes(8, shift=3)).logits
    assert not torch.equal(moved, logits(model, ids(8)))


def test_a_module_whose_equal_axes_are_not_rope_ext_rotation_is_refused():
    """The probe compares the module's output at equal per-axis positions with rope-ext's: here a
    module that plain calls (one position per token) leave as RoPE shifts every per-axis call."""
    model = build("qwen3_5_text", **SECTIONED)
    rotary = model.model.rotary_emb

    class Shifted(type(rotary)):
        def forward(self, x, position_ids):
            return super().forward(x, position_ids + 1 if position_ids.dim() == 3 else position_ids)

    rotary.__class__ = Shifted
    plain = copy.deepcopy(model)
    before = logits(model, ids(WINDOW))
    for method in registered():
        with pytest.raises(ValueError, match=f"cannot patch .*{REASONS['format']}.* axes at the tokens' positions is not RoPE"):
            rope_ext.patch(model, method, factor=4, **patch_params(method, model))
        assert equal_models(model, plain)
        assert torch.equal(logits(model, ids(WINDOW)), before)
