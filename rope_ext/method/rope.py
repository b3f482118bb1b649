"""The RoPE scaling methods: new frequencies for the rotation, nothing else.

Each is one pure function `fn(geometry, seq_len, **params) -> (inv_freq, attention_factor)`:
`inv_freq` is an fp32 tensor of D/2 inverse frequencies for the rotated pairs, `attention_factor`
multiplies cos and sin (so attention logits scale by its square). `seq_len` is the length the
model is looking at right now; only the dynamic methods read it. Formulas and their papers:
docs/references.md, "Scaling formulas".

Where transformers has the same method, the arithmetic follows the same order in the same dtype,
so a patched model matches a natively configured one bit-for-bit, and `native` gives the
`rope_parameters` under which transformers reloads the patch by itself.

The dynamic methods also take `logn`, Qwen's log-n scale of the queries past the trained window,
which their attention applies (rope_ext.attention.Rotator.scale_queries, docs/logn.md).
The static ones cannot: the model's own attention applies their (cos, sin) to queries and keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rope_ext.geometry import RotaryGeometry

from .base import MAX_ATTENTION_FACTOR, MAX_FACTOR, Method, ModelFacts, Ordered, Param, default_inv_freq, with_defaults


def ntk_base(geom: RotaryGeometry, scale: float) -> float:
    """NTK-aware base b * s^(D/(D-2)): the lowest frequency is interpolated by s, the highest kept."""
    d = geom.rotary_dim
    return geom.base * scale ** (d / (d - 2))


def linear(geom: RotaryGeometry, seq_len: int | None = None, *, factor: float) -> tuple[torch.Tensor, float]:
    """Position interpolation: every frequency divided by the factor."""
    inv_freq = default_inv_freq(geom)
    inv_freq /= factor
    return inv_freq, 1.0


def ntk(geom: RotaryGeometry, seq_len: int | None = None, *, factor: float) -> tuple[torch.Tensor, float]:
    """Fixed NTK-aware scaling: a larger base, frequencies otherwise unchanged."""
    return default_inv_freq(geom, ntk_base(geom, factor)), 1.0


def dynamic(geom: RotaryGeometry, seq_len: int | None = None, *, factor: float) -> tuple[torch.Tensor, float]:
    """Dynamic NTK: the original frequencies up to the window, then an NTK base grown with length.

    b' = b * (s*L'/L - (s-1))^(D/(D-2)). The base is computed in fp32 tensor arithmetic because
    that is what transformers does at run time (it passes seq_len as a tensor)."""
    window = geom.original_window
    if seq_len is None or seq_len <= window:
        return default_inv_freq(geom), 1.0
    d = geom.rotary_dim
    length = torch.tensor(seq_len, dtype=torch.int64)
    base = geom.base * ((factor * length / window) - (factor - 1)) ** (d / (d - 2))
    return default_inv_freq(geom, base), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 mscale ln(s) + 1, applied to cos and sin (1 for s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(geom: RotaryGeometry, rotations: float) -> float:
    """The (fractional) pair index whose wavelength fits `rotations` times into the window."""
    return (geom.rotary_dim * math.log(geom.original_window / (rotations * 2 * math.pi))) / (2 * math.log(geom.base))


def _by_parts(
    geom: RotaryGeometry, factor: float, *, beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True
) -> torch.Tensor:
    """YaRN's frequency blend: pairs that rotate more than beta_fast times in the window keep
    their frequency, pairs that rotate less than beta_slow times are interpolated by the factor,
    with a linear ramp between; `truncate` rounds the ramp's ends to whole pairs. The ramp's
    defaults are those of yarn, ntk_by_parts and dynamic_yarn, which pass their `**ramp` here."""
    d = geom.rotary_dim
    low = _correction_dim(geom, beta_fast)
    high = _correction_dim(geom, beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = geom.base ** (torch.arange(0, d, 2).float() / d)
    keep = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn(
    geom: RotaryGeometry,
    seq_len: int | None = None,
    *,
    factor: float,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    **ramp,
) -> tuple[torch.Tensor, float]:
    """YaRN: NTK-by-parts frequencies plus the attention temperature. DeepSeek's convention
    (`mscale` and `mscale_all_dim`, both set) puts mscale(s, mscale) / mscale(s, mscale_all_dim) on
    cos and sin; the model's attention multiplies its softmax scale by mscale(s, mscale_all_dim)^2,
    which reaches every channel of q.k (transformers' deepseek_v3, as the checkpoint ships)."""
    inv_freq = _by_parts(geom, factor, **ramp)
    if attention_factor is not None:
        return inv_freq, attention_factor
    if mscale and mscale_all_dim:
        return inv_freq, float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return inv_freq, yarn_mscale(factor)


def ntk_by_parts(geom: RotaryGeometry, seq_len: int | None = None, *, factor: float, **ramp) -> tuple[torch.Tensor, float]:
    """YaRN's frequency ramp without its temperature."""
    return _by_parts(geom, factor, **ramp), 1.0


def dynamic_yarn(geom: RotaryGeometry, seq_len: int | None = None, *, factor: float, **ramp) -> tuple[torch.Tensor, float]:
    """YaRN with s = max(1, L'/L) recomputed as the length grows.

    `factor` does not enter the math: as in the YaRN paper the scale follows the length. It states
    the window the patched model is meant for (PatchInfo.max_length)."""
    scale = 1.0 if seq_len is None else max(1.0, seq_len / geom.original_window)
    if scale == 1.0:
        return default_inv_freq(geom), 1.0
    return _by_parts(geom, scale, **ramp), yarn_mscale(scale)


def llama3(
    geom: RotaryGeometry,
    seq_len: int | None = None,
    *,
    factor: float,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
) -> tuple[torch.Tensor, float]:
    """Llama 3.1: keep short wavelengths, divide long ones by the factor, blend in between."""
    inv_freq = default_inv_freq(geom)
    window = geom.original_window
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = window / low_freq_factor
    high_freq_wavelen = window / high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (window / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def ntk_alpha(geom: RotaryGeometry, seq_len: int | None = None, *, factor: float, alpha: float) -> tuple[torch.Tensor, float]:
    """HunYuan's NTK with a fixed alpha: the base b * alpha^(D/(D-2)), whatever the factor (which
    states the window the patch is meant for)."""
    return default_inv_freq(geom, ntk_base(geom, alpha)), 1.0


def proportional(
    geom: RotaryGeometry, seq_len: int | None = None, *, factor: float, partial_rotary_factor: float = 0.25
) -> tuple[torch.Tensor, float]:
    """p-RoPE (transformers' `proportional`, Gemma 4): the highest int(p D / 2) frequencies at
    their trained values, the others 0 (those pairs never turn), all divided by the factor."""
    d = geom.rotary_dim
    angles = int(partial_rotary_factor * d // 2)
    rotated = 1.0 / (geom.base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / d))
    inv_freq = torch.cat((rotated, torch.zeros(d // 2 - angles, dtype=torch.float32))) if angles < d // 2 else rotated
    inv_freq /= factor
    return inv_freq, 1.0


NativeFn = Callable[[RotaryGeometry, float, dict, dict], "dict | None"]


@dataclass(frozen=True)
class RopeMethod(Method):
    """A frequency scaling, with the transformers `rope_parameters` that express it (if any)."""

    native_fn: NativeFn | None = None
    # (geometry, factor, ratio, rope) -> rope_parameters on a checkpoint with a linear scaling `ratio`
    over_linear_fn: Callable | None = None

    def native(self, geometry: RotaryGeometry, factor: float, params: dict, rope: dict) -> dict | None:
        return None if self.native_fn is None else self.native_fn(geometry, factor, params, rope)

    def native_over_linear(self, geometry: RotaryGeometry, factor: float, ratio: float, rope: dict) -> dict | None:
        return None if self.over_linear_fn is None else self.over_linear_fn(geometry, factor, ratio, rope)


@dataclass(frozen=True)
class ProportionalMethod(RopeMethod):
    """transformers' `proportional` takes the exponents over the whole head, so the model must
    rotate all of it; at least one pair must keep turning."""

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        if geometry.head_dim not in (None, geometry.rotary_dim):
            raise ValueError(
                f"{self.name}: the model rotates {geometry.rotary_dim} of {geometry.head_dim} channels per head; "
                "proportional RoPE needs a fully rotated head (it chooses which pairs turn)"
            )
        if int(params["partial_rotary_factor"] * geometry.rotary_dim // 2) < 1:
            raise ValueError(
                f"{self.name}: partial_rotary_factor={params['partial_rotary_factor']} leaves no pair of the "
                f"{geometry.rotary_dim} rotated channels turning"
            )
        return factor, params


def _base(geometry: RotaryGeometry, rope: dict) -> dict:
    return {"rope_theta": geometry.base, **{k: v for k, v in rope.items() if k == "partial_rotary_factor"}}


def _window(geometry: RotaryGeometry) -> dict:
    return {"original_max_position_embeddings": geometry.original_window}


def _ramp(params: dict) -> dict:
    return {k: params.get(k) for k in ("beta_fast", "beta_slow", "truncate")}


def _native_yarn(geometry, factor, params, rope):
    temperature = {k: params[k] for k in ("attention_factor", "mscale", "mscale_all_dim") if params[k] is not None}
    return {"rope_type": "yarn", "factor": factor, **_base(geometry, rope), **_window(geometry), **_ramp(params), **temperature}


# YaRN's ramp (`_by_parts`, whose signature states their defaults)
_YARN_PARAMS = with_defaults(
    _by_parts,
    Param("beta_fast", doc="rotations in the window above which a pair keeps its frequency"),
    Param("beta_slow", doc="rotations in the window below which a pair is interpolated"),
    Param("truncate", kind="bool", doc="round the ramp's ends to whole pairs, as transformers does"),
)
_YARN_ORDER = (Ordered(("beta_fast", "beta_slow")),)
# the cos and sin scale that replaces YaRN's temperature, where given; it scales logits by its square
ATTENTION_FACTOR = Param("attention_factor", None, lo=0, lo_open=True, hi=MAX_ATTENTION_FACTOR)

METHODS = [
    RopeMethod(
        "linear",
        linear,
        "position interpolation (PI)",
        "theta_i / s",
        native_fn=lambda g, factor, params, rope: {"rope_type": "linear", "factor": factor, **_base(g, rope)},
        over_linear_fn=lambda g, factor, ratio, rope: {"rope_type": "linear", "factor": ratio * factor, **_base(g, rope)},
    ),
    RopeMethod(
        "ntk",
        ntk,
        "fixed NTK-aware base",
        "base * s^(D/(D-2))",
        native_fn=lambda g, factor, params, rope: {"rope_type": "default", **_base(g, rope), "rope_theta": ntk_base(g, factor)},
        over_linear_fn=lambda g, factor, ratio, rope: {
            "rope_type": "linear",
            "factor": ratio,
            **_base(g, rope),
            "rope_theta": ntk_base(g, factor),
        },
    ),
    RopeMethod(
        "dynamic",
        dynamic,
        "dynamic NTK: NTK base grown with the current length L'",
        "base * (s*L'/L - (s-1))^(D/(D-2)) when L' > L, else unchanged",
        rotation="attention",
        follows_length=True,
        takes_query_scales=True,
        # transformers' `dynamic` is this method with causal=False and logn=False only: it has no
        # per-token schedule and no log-n scale, so the others have no native form
        # (rope_ext.from_pretrained). It reads max_position_embeddings as the trained window,
        # which rope_ext.record.served_window writes for it.
        native_fn=lambda g, factor, params, rope: (
            None if params["causal"] or params["logn"] else {"rope_type": "dynamic", "factor": factor, **_base(g, rope)}
        ),
    ),
    RopeMethod(
        "yarn",
        yarn,
        "YaRN: NTK-by-parts + attention temperature",
        "ramp-blend of theta_i and theta_i/s; cos, sin * (0.1 ln s + 1)",
        params=(
            *_YARN_PARAMS,
            ATTENTION_FACTOR,
            Param("mscale", None, doc="DeepSeek's mscale: the temperature 0.1 mscale ln(s) + 1 on cos and sin"),
            Param("mscale_all_dim", None, doc="DeepSeek's mscale_all_dim: the temperature divided by this one's"),
        ),
        constraints=_YARN_ORDER,
        native_fn=_native_yarn,
    ),
    RopeMethod(
        "dynamic_yarn",
        dynamic_yarn,
        "YaRN with s = max(1, L'/L)",
        # No native form: a plain reload is the unscaled model, so the config keeps its window.
        "yarn with s recomputed from the current length",
        params=_YARN_PARAMS,
        constraints=_YARN_ORDER,
        rotation="attention",
        follows_length=True,
        takes_query_scales=True,
    ),
    RopeMethod(
        "ntk_by_parts",
        ntk_by_parts,
        "YaRN's frequency ramp without temperature",
        "ramp-blend of theta_i and theta_i/s",
        params=_YARN_PARAMS,
        constraints=_YARN_ORDER,
        native_fn=lambda g, factor, params, rope: {
            "rope_type": "yarn",
            "factor": factor,
            **_base(g, rope),
            **_window(g),
            **_ramp(params),
            "attention_factor": 1.0,
        },
    ),
    RopeMethod(
        "ntk_alpha",
        ntk_alpha,
        "HunYuan's NTK-aware base with a fixed alpha",
        "base * alpha^(D/(D-2))",
        # `alpha` is required: it is the base's stretch, apart from the length factor
        params=(
            Param(
                "alpha",
                required=True,
                lo=1,
                hi=MAX_FACTOR,
                doc="the base becomes base * alpha^(D/(D-2))",
            ),
        ),
        native_fn=lambda g, factor, params, rope: {
            "rope_type": "default",
            **_base(g, rope),
            "rope_theta": ntk_base(g, params["alpha"]),
        },
    ),
    ProportionalMethod(
        "proportional",
        proportional,
        "p-RoPE (Gemma 4's proportional): the lowest frequencies set to 0, the rest / s",
        "theta_i / s for i < p D/2, else 0",
        params=with_defaults(
            proportional,
            Param(
                "partial_rotary_factor",
                lo=0,
                lo_open=True,
                hi=1,
                doc="the share of the head's frequencies that keep turning",
            ),
        ),
        native_fn=lambda g, factor, params, rope: {
            "rope_type": "proportional",
            "factor": factor,
            "rope_theta": g.base,
            "partial_rotary_factor": params["partial_rotary_factor"],
        },
    ),
    RopeMethod(
        "llama3",
        llama3,
        "Llama 3.1 wavelength-banded scaling",
        "theta_i if lambda < L/hf; theta_i/s if lambda > L/lf; smooth blend between",
        params=with_defaults(
            llama3,
            Param("low_freq_factor", doc="wavelengths above L / low_freq_factor are divided by the factor"),
            Param("high_freq_factor", doc="wavelengths below L / high_freq_factor keep their frequency"),
        ),
        constraints=(Ordered(("high_freq_factor", "low_freq_factor")),),
        native_fn=lambda g, factor, params, rope: {
            "rope_type": "llama3",
            "factor": factor,
            **_base(g, rope),
            **_window(g),
            **params,
        },
    ),
]
