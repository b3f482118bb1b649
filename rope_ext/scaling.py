"""Rotary scaling methods as pure math.

Each method is one function `fn(geometry, seq_len, **params) -> (inv_freq, attention_factor)`:
`inv_freq` is an fp32 tensor of D/2 inverse frequencies for the rotated pairs, `attention_factor`
multiplies cos and sin (so attention logits scale by its square). `seq_len` is the length the
model is looking at right now; only the dynamic methods read it.

Where transformers has the same method, the arithmetic follows the same order in the same dtype,
so a patched model matches a natively configured one bit-for-bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .geometry import RotaryGeometry

MethodFn = Callable[..., "tuple[torch.Tensor, float]"]


def _exponents(geom: RotaryGeometry) -> torch.Tensor:
    """2i/D for each rotated pair, in fp32."""
    return torch.arange(0, geom.rotary_dim, 2, dtype=torch.int64).float() / geom.rotary_dim


def default_inv_freq(geom: RotaryGeometry, base: float | torch.Tensor | None = None) -> torch.Tensor:
    """theta_i = base^(-2i/D): the frequencies the model was trained with."""
    return 1.0 / ((geom.base if base is None else base) ** _exponents(geom))


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


def yarn_mscale(scale: float) -> float:
    """YaRN's attention temperature 0.1 ln(s) + 1, applied to cos and sin (1 for s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * math.log(scale) + 1.0


def _correction_dim(geom: RotaryGeometry, rotations: float) -> float:
    """The (fractional) pair index whose wavelength fits `rotations` times into the window."""
    return (geom.rotary_dim * math.log(geom.original_window / (rotations * 2 * math.pi))) / (
        2 * math.log(geom.base)
    )


def _by_parts(geom: RotaryGeometry, factor: float, beta_fast: float, beta_slow: float, truncate: bool) -> torch.Tensor:
    """YaRN's frequency blend: pairs that rotate more than beta_fast times in the window keep
    their frequency, pairs that rotate less than beta_slow times are interpolated by the factor,
    with a linear ramp between."""
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
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attention_factor: float | None = None,
    truncate: bool = True,
) -> tuple[torch.Tensor, float]:
    """YaRN: NTK-by-parts frequencies plus the attention temperature."""
    inv_freq = _by_parts(geom, factor, beta_fast, beta_slow, truncate)
    return inv_freq, yarn_mscale(factor) if attention_factor is None else attention_factor


def ntk_by_parts(
    geom: RotaryGeometry,
    seq_len: int | None = None,
    *,
    factor: float,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> tuple[torch.Tensor, float]:
    """YaRN's frequency ramp without its temperature."""
    return _by_parts(geom, factor, beta_fast, beta_slow, truncate), 1.0


def dynamic_yarn(
    geom: RotaryGeometry,
    seq_len: int | None = None,
    *,
    factor: float,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> tuple[torch.Tensor, float]:
    """YaRN with s = max(1, L'/L) recomputed as the length grows.

    `factor` does not enter the math: as in the YaRN paper the scale follows the length. It states
    the window the patched model is meant for (PatchInfo.max_length)."""
    scale = 1.0 if seq_len is None else max(1.0, seq_len / geom.original_window)
    if scale == 1.0:
        return default_inv_freq(geom), 1.0
    return _by_parts(geom, scale, beta_fast, beta_slow, truncate), yarn_mscale(scale)


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


@dataclass(frozen=True)
class Method:
    """A registered method: its function, parameters with defaults, and how it behaves."""

    name: str
    fn: MethodFn
    summary: str
    formula: str
    params: dict = field(default_factory=dict)
    dynamic: bool = False  # frequencies depend on the current length

    @property
    def all_params(self) -> dict:
        return {**self.params, **(SCHEDULE_PARAMS if self.dynamic else {})}

    def validate(self, factor, params: dict) -> dict:
        """Checked parameters with defaults filled in; raises ValueError on anything wrong."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ValueError(f"factor must be a number > 1, got {factor!r}")
        if not math.isfinite(factor) or factor <= 1:
            raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
        unknown = sorted(set(params) - set(self.all_params))
        if unknown:
            allowed = ", ".join(self.all_params) or "none"
            raise ValueError(f"unknown parameter(s) {unknown} for method {self.name!r}; allowed: {allowed}")
        merged = {**self.all_params, **params}
        if self.dynamic:
            if not isinstance(merged["causal"], bool):
                raise ValueError(f"{self.name}: causal must be True or False, got {merged['causal']!r}")
            g = merged["granularity"]
            if isinstance(g, bool) or not isinstance(g, int) or g < 1:
                raise ValueError(f"{self.name}: granularity must be an int >= 1, got {g!r}")
        for key, value in merged.items():
            if value is None or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{self.name}: parameter {key}={value!r} must be a finite number")
        if "beta_fast" in merged and not merged["beta_fast"] > merged["beta_slow"] > 0:
            raise ValueError(f"{self.name}: need beta_fast > beta_slow > 0, got {merged['beta_fast']}, {merged['beta_slow']}")
        if "high_freq_factor" in merged and not merged["high_freq_factor"] > merged["low_freq_factor"] > 0:
            raise ValueError(f"{self.name}: need high_freq_factor > low_freq_factor > 0")
        if merged.get("attention_factor") is not None and merged["attention_factor"] <= 0:
            raise ValueError(f"{self.name}: attention_factor must be > 0")
        return merged

    def __call__(self, geom: RotaryGeometry, seq_len: int | None, factor: float, params: dict):
        math_params = {k: v for k, v in params.items() if k not in SCHEDULE_PARAMS}
        return self.fn(geom, seq_len, factor=factor, **math_params)


# How a dynamic method's length is chosen (read by the rotary module, not by the math):
# causal=True gives each token the scaling for the length it has seen, so a full forward equals
# token-by-token decoding; causal=False uses one scaling per forward from its longest position, as
# transformers does. granularity=g re-scales every g tokens past the window instead of every token.
SCHEDULE_PARAMS = {"causal": True, "granularity": 1}

_YARN_PARAMS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}

REGISTRY: dict[str, Method] = {
    m.name: m
    for m in [
        Method("linear", linear, "position interpolation (PI)", "theta_i / s"),
        Method("ntk", ntk, "fixed NTK-aware base", "base * s^(D/(D-2))"),
        Method(
            "dynamic", dynamic, "dynamic NTK: NTK base grown with the current length L'",
            "base * (s*L'/L - (s-1))^(D/(D-2)) when L' > L, else unchanged", dynamic=True,
        ),
        Method(
            "yarn", yarn, "YaRN: NTK-by-parts + attention temperature",
            "ramp-blend of theta_i and theta_i/s; cos, sin * (0.1 ln s + 1)",
            params={**_YARN_PARAMS, "attention_factor": None},
        ),
        Method(
            "dynamic_yarn", dynamic_yarn, "YaRN with s = max(1, L'/L)",
            "yarn with s recomputed from the current length", params=dict(_YARN_PARAMS), dynamic=True,
        ),
        Method(
            "ntk_by_parts", ntk_by_parts, "YaRN's frequency ramp without temperature",
            "ramp-blend of theta_i and theta_i/s", params=dict(_YARN_PARAMS),
        ),
        Method(
            "llama3", llama3, "Llama 3.1 wavelength-banded scaling",
            "theta_i if lambda < L/hf; theta_i/s if lambda > L/lf; smooth blend between",
            params={"low_freq_factor": 1.0, "high_freq_factor": 4.0},
        ),
    ]
}


def get(name: str) -> Method:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(REGISTRY)}") from None


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes m_h = 2^(-8h/H), h = 1..H, in fp32.

    For H not a power of two: the slopes of the power of two just below, then every other slope
    of the next power of two, as in the ALiBi paper."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")

    def geometric(n: int) -> list[float]:
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]

    below = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(below)
    if below < num_heads:
        slopes += geometric(2 * below)[0::2][: num_heads - below]
    return torch.tensor(slopes, dtype=torch.float32)
