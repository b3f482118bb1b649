import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import rope_ext
from rope_ext import method as methods
from rope_ext.method import rope as M
from rope_ext.method.alibi_hybrid import alibi_slopes
from rope_ext.geometry import RotaryGeometry

GEOMETRIES = [RotaryGeometry(64, 1e5, 8192), RotaryGeometry(16, 1e4, 128), RotaryGeometry(128, 5e5, 8192)]


def hf_config(geom, rope):
    return LlamaConfig(
        hidden_size=geom.rotary_dim * 2,
        num_attention_heads=2,
        head_dim=geom.rotary_dim,
        max_position_embeddings=geom.original_window,
        rope_parameters={"rope_theta": geom.base, **rope},
    )


def LONGROPE(pairs: int) -> dict:
    """Per-pair factors that differ in every pair: short ones near 1, long ones up to 8."""
    return {
        "rope_type": "longrope",
        "factor": 4.0,
        "short_factor": torch.linspace(1.0, 1.3, pairs).tolist(),
        "long_factor": torch.linspace(1.0, 8.0, pairs).tolist(),
    }


@pytest.mark.parametrize("geom", GEOMETRIES, ids=str)
@pytest.mark.parametrize(
    "method,rope,seq_len",
    [
        ("linear", {"rope_type": "linear", "factor": 4.0}, None),
        ("yarn", {"rope_type": "yarn", "factor": 4.0}, None),
        ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, None),
        ("dynamic", {"rope_type": "dynamic", "factor": 4.0}, 3),
        ("dynamic", {"rope_type": "dynamic", "factor": 4.0}, 0.5),
        ("longrope", LONGROPE, None),
        ("longrope", LONGROPE, 1),
        ("longrope", LONGROPE, 3),
        ("longrope", lambda pairs: {**LONGROPE(pairs), "attention_factor": 1.7}, 3),
        ("proportional", {"rope_type": "proportional", "factor": 4.0, "partial_rotary_factor": 0.25}, None),
        ("proportional", {"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 1.0}, None),
    ],
)
def test_frequencies_match_transformers_bit_for_bit(geom, method, rope, seq_len):
    rope = rope(geom.rotary_dim // 2) if callable(rope) else rope
    if rope["rope_type"] in ("yarn", "llama3", "longrope"):
        rope = {**rope, "original_max_position_embeddings": geom.original_window}
    length = None if seq_len is None else int(seq_len * geom.original_window)
    native, native_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](
        hf_config(geom, rope), None, seq_len=None if length is None else torch.tensor(length)
    )
    spec = methods.get(method)
    # the method's parameters that transformers' rope_parameters state (llama3's bands, longrope's lists)
    params = {k: v for k, v in rope.items() if k in spec.params}
    ours, factor = spec(geom, length, rope["factor"], spec.validate(rope["factor"], params))
    assert ours.dtype == torch.float32
    assert torch.equal(ours, native)
    assert factor == native_factor


def test_ntk_base_formula():
    geom = GEOMETRIES[0]
    inv, _ = M.ntk(geom, factor=4)
    base = 1e5 * 4 ** (64 / 62)
    assert torch.allclose(inv, 1.0 / base ** (torch.arange(0, 64, 2).float() / 64), rtol=1e-6)
    # NTK keeps the highest frequency and divides the lowest by exactly s.
    default = M.default_inv_freq(geom)
    assert inv[0] == default[0]
    # the lowest pair (exponent (D-2)/D) is slowed by s^((D/(D-2)) * (D-2)/D) = s exactly
    assert math.isclose(float(default[-1] / inv[-1]), 4, rel_tol=1e-5)


def test_by_parts_ramp_keeps_high_and_interpolates_low_frequencies():
    geom = GEOMETRIES[0]
    inv, temperature = M.ntk_by_parts(geom, factor=8)
    default = M.default_inv_freq(geom)
    assert temperature == 1.0
    assert torch.equal(inv[:5], default[:5])  # rotate > 32 times in the window: kept
    assert torch.allclose(inv[-3:], default[-3:] / 8)  # rotate < once: interpolated
    assert M.yarn(geom, factor=8)[1] == pytest.approx(0.1 * math.log(8) + 1)


def test_dynamic_is_identity_inside_the_window_and_grows_past_it():
    geom = GEOMETRIES[1]
    default = M.default_inv_freq(geom)
    for method in ("dynamic", "dynamic_yarn"):
        spec = methods.get(method)
        params = spec.validate(4, {})
        assert torch.equal(spec(geom, geom.original_window, 4, params)[0], default)
        assert spec(geom, geom.original_window, 4, params)[1] == 1.0
        longer = spec(geom, 4 * geom.original_window, 4, params)[0]
        assert (longer[1:] < default[1:]).all()


def test_registry_lists_methods_with_parameters():
    listed = rope_ext.methods()
    assert set(listed) >= {"linear", "ntk", "dynamic", "yarn", "dynamic_yarn", "ntk_by_parts", "llama3", "longrope"}
    assert listed["yarn"]["params"]["beta_fast"] == 32.0
    assert listed["dynamic"]["dynamic"] and not listed["ntk"]["dynamic"]
    assert listed["dynamic"]["params"]["causal"] is True


@pytest.mark.parametrize(
    "factor,params,match",
    [
        (1.0, {}, "factor"),
        (0.5, {}, "factor"),
        (float("nan"), {}, "factor"),
        (float("inf"), {}, "factor"),
        ("4", {}, "factor"),
        (4, {"beta": 3}, "unknown parameter"),
        (4, {"beta_fast": 1, "beta_slow": 2}, "beta_fast"),
        (4, {"beta_fast": float("nan")}, "finite"),
    ],
)
def test_validation_rejects_bad_parameters(factor, params, match):
    with pytest.raises(ValueError, match=match):
        methods.get("yarn").validate(factor, params)


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="valid methods: linear, ntk"):
        methods.get("rope2")


def test_alibi_slopes():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0**-k for k in range(1, 9)]))
    twelve = alibi_slopes(12)
    assert torch.allclose(twelve[:8], alibi_slopes(8))
    assert torch.allclose(twelve[8:], torch.tensor([2.0 ** (-(2 * k - 1) / 2) for k in range(1, 5)]))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary
def test_in_attention_rotation_has_transformers_bits(layout, rotary_dim):
    """Dynamic methods rotate inside attention with rope_ext.rotary.apply_rotary, which turns the
    pairs by slices instead of building transformers' rotate_half copy; the bits must not change."""
    from transformers.models.glm.modeling_glm import rotate_half as rotate_interleaved
    from transformers.models.llama.modeling_llama import rotate_half

    from rope_ext.rotation import apply_rotary, cos_sin

    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 16)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = cos_sin(inv_freq, 1.3, torch.arange(40).expand(2, 40), x.dtype)
    turn = rotate_half if layout == "half" else rotate_interleaved
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    if layout == "interleaved":
        c = c[..., : rotary_dim // 2].repeat_interleave(2, dim=-1)
        s = s[..., : rotary_dim // 2].repeat_interleave(2, dim=-1)
    x_rot = x[..., :rotary_dim]
    expected = torch.cat(((x_rot * c) + (turn(x_rot) * s), x[..., rotary_dim:]), dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin, layout), expected)
