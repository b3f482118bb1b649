"""llama.cpp's rotary embedding as it reads it from a GGUF file, restated from its released source,
and the GGUF metadata (plus, where needed, the `rope_freqs` tensor) under which llama.cpp computes a
rope-ext patch's frequencies and attention factor (docs/serving.md, "GGUF and llama.cpp").

Read from llama.cpp as llama-cpp-python 0.3.36 vendors it (ggml-org/llama.cpp@0c1e57098, the
sdist's vendor/llama.cpp; PyPI's source distribution of llama-cpp-python==0.3.36):

- src/llama-arch.cpp: the keys `{arch}.rope.freq_base`, `.rope.scaling.type`, `.rope.scaling.factor`
  (older files: `.rope.scale_linear`), `.rope.scaling.original_context_length`,
  `.rope.scaling.attn_factor`, `{arch}.context_length`, and the tensor `rope_freqs.weight`.
- src/llama-model.cpp `load_hparams`: freq_base defaults to 10000; the scaling type to "linear"
  (none, linear, yarn, longrope); freq_scale = 1 / factor (a factor absent or 0: 1); the original
  context to context_length; attn_factor to 1.
- src/models/llama.cpp: the llama architecture loads `rope_freqs.weight` (n_rot/2 floats, shared by
  every layer) unless the type is longrope, which loads rope_factors_long/short instead and picks
  one set by the context size (src/llama-model.cpp `get_rope_factors`), and hands it to
  `ggml_rope_ext` for q and k. It does not read the yarn_beta_fast/slow keys (only grok, mistral3
  and a few others do), so YaRN's ramp is always beta_fast 32, beta_slow 1 (src/llama-hparams.h).
- src/llama-context.cpp, the llama_context constructor: type none sets freq_scale to 1;
  ext_factor is 1 for yarn, else 0; for yarn the attention factor is mscale(factor) / (1 + 0.1 ln
  factor), which the rope op multiplies back by (1 + 0.1 ln factor); it is then multiplied by
  attn_factor for every type.
- ggml/src/ggml-cpu/ops.cpp `rope_yarn`, `ggml_rope_cache_init`, and ggml/src/ggml.c
  `ggml_rope_yarn_corr_dims`: pair i at position p turns by p * base^(-2i/n_rot) / rope_freqs[i],
  times freq_scale; with ext_factor, the YaRN blend of the two between the pair indices where a
  pair turns beta_fast and beta_slow times in the original context (floor and ceil); cos and sin
  times the attention factor (times 1 + 0.1 ln(1/freq_scale) with ext_factor).

The restatement computes the ideal values in float64; llama.cpp computes them in float32 (each
pair's angle as a running product, theta *= base^(-2/n_rot)), which differs by a few units in the
last place of fp32, as transformers' own fp32 frequencies do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

LLAMA_CPP = "llama.cpp as vendored by llama-cpp-python 0.3.36 (ggml-org/llama.cpp@0c1e57098)"
# the architectures whose graph rope-ext has read: the llama graph (src/models/llama.cpp), which
# takes the rope_freqs tensor; another architecture's graph reads other keys and tensors
ARCHITECTURES = ("llama",)
ROPE_FREQS = "rope_freqs.weight"
TYPES = ("none", "linear", "yarn", "longrope")
# llama.cpp's YaRN ramp for the llama architecture (src/llama-hparams.h defaults, keys not read)
BETA_FAST, BETA_SLOW = 32.0, 1.0
# the keys rope-ext writes under {arch}.; every other rope.scaling key is left out of the written file
WRITTEN = (
    "context_length",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.attn_factor",
)
REPLACED_PREFIXES = ("rope.scaling.", "rope.scale_linear")


def yarn_mscale(factor: float) -> float:
    """llama-context.cpp's get_mscale(factor, 1): 0.1 ln(factor) + 1, 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def pair_powers(base: float, dims: int) -> np.ndarray:
    """base^(-2i/dims) for each pair, float64: the angle per position before any scaling."""
    return base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)


@dataclass(frozen=True)
class LlamaCppRope:
    """The rope of one GGUF as llama.cpp's llama architecture reads it, defaults filled in."""

    dims: int  # n_rot: the rotated channels per head
    base: float
    context: int  # {arch}.context_length: n_ctx_train, llama.cpp's default context size
    scaling: str  # none, linear, yarn or longrope
    factor: float  # 1 / freq_scale (1 where llama.cpp does not scale)
    original_context: int
    attn_factor: float
    freqs: np.ndarray | None  # rope_freqs.weight: each pair's wavelength multiplier

    def computed(self) -> tuple[torch.Tensor, float]:
        """(the inverse frequency of each pair, the factor on cos and sin) that llama.cpp computes."""
        if self.scaling == "longrope":
            raise ValueError("llama.cpp's longrope type picks rope_factors_long or _short by the context size; not restated")
        theta = pair_powers(self.base, self.dims)
        if self.freqs is not None:
            theta = theta / self.freqs.astype(np.float64)
        scale = 1.0 if self.scaling == "none" else 1.0 / self.factor
        if self.scaling != "yarn":
            return torch.from_numpy(theta * scale).float(), self.attn_factor
        low, high = self.correction_dims()
        ramp = 1 - np.clip((np.arange(self.dims // 2) - low) / max(0.001, high - low), 0, 1)
        blended = theta * scale * (1 - ramp) + theta * ramp
        return torch.from_numpy(blended).float(), yarn_mscale(self.factor) * self.attn_factor

    def correction_dims(self) -> tuple[float, float]:
        """ggml_rope_yarn_corr_dims: the pair indices between which YaRN's ramp runs."""

        def dim(turns: float) -> float:
            return self.dims * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(self.base))

        return max(0.0, math.floor(dim(BETA_FAST))), min(self.dims - 1.0, math.ceil(dim(BETA_SLOW)))


def read(fields: dict, arch: str, freqs: np.ndarray | None, dims: int) -> LlamaCppRope:
    """llama.cpp's reading (src/llama-model.cpp load_hparams) of `fields`, {key: value} of a GGUF."""

    def get(key, default=None):
        return fields.get(f"{arch}.{key}", default)

    factor = get("rope.scaling.factor", get("rope.scale_linear", 0.0)) or 1.0
    scaling = get("rope.scaling.type", "linear")
    if scaling not in TYPES:
        raise ValueError(f"{arch}.rope.scaling.type is {scaling!r}; llama.cpp reads {', '.join(TYPES)}")
    context = int(get("context_length"))
    return LlamaCppRope(
        dims=dims,
        base=float(get("rope.freq_base", 10000.0)),
        context=context,
        scaling=scaling,
        factor=1.0 if scaling == "none" else float(factor),
        original_context=int(get("rope.scaling.original_context_length", context)),
        attn_factor=float(get("rope.scaling.attn_factor", 1.0)),
        freqs=freqs,
    )


def shipped_parameters(rope: LlamaCppRope) -> dict:
    """The transformers `rope_parameters` of the rotation llama.cpp computes from `rope` (what a
    transformers model of the GGUF must rotate by to be the model llama.cpp runs)."""
    plain = {"rope_type": "default", "rope_theta": rope.base}
    if rope.freqs is not None:
        if rope.scaling == "yarn" or rope.factor != 1:
            raise ValueError("the GGUF scales by rope_freqs and by its scaling type at once; rope-ext reads one of them")
        # theta_i / rope_freqs[i]: transformers' longrope with one factor list for every length
        factors = [float(f) for f in rope.freqs]
        return {
            **plain,
            "rope_type": "longrope",
            "factor": rope.context / rope.original_context,
            "original_max_position_embeddings": rope.original_context,
            "short_factor": factors,
            "long_factor": factors,
            "attention_factor": rope.attn_factor,
        }
    if rope.scaling == "yarn":
        temperature = {} if rope.attn_factor == 1 else {"attention_factor": yarn_mscale(rope.factor) * rope.attn_factor}
        return {
            **plain,
            "rope_type": "yarn",
            "factor": rope.factor,
            "original_max_position_embeddings": rope.original_context,
            "beta_fast": BETA_FAST,
            "beta_slow": BETA_SLOW,
            **temperature,
        }
    if rope.attn_factor != 1:
        raise ValueError(
            f"the GGUF sets attn_factor {rope.attn_factor:g} on a {rope.scaling} scaling, which transformers cannot load"
        )
    if rope.factor != 1:
        return {**plain, "rope_type": "linear", "factor": rope.factor}
    return plain


def expressed(native: dict | None, inv_freq: torch.Tensor, attention: float, base: float, dims: int, window: int, length: int):
    """`choose_keys`, its floats as the file stores them (float32), which llama.cpp reads."""
    keys, freqs = choose_keys(native, inv_freq, attention, base, dims, window, length)
    return {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in keys.items()}, freqs


def choose_keys(native: dict | None, inv_freq: torch.Tensor, attention: float, base: float, dims: int, window: int, length: int):
    """(the metadata, {key under {arch}.: value}, and the rope_freqs values or None) under which
    llama.cpp computes `inv_freq` and `attention` (a patch's static frequencies and factor on cos
    and sin), over a `window`-token original context, for `length` tokens. The patch's transformers
    form `native` is written as llama.cpp's own type where one matches it (default: a new
    freq_base; linear; yarn with llama.cpp's ramp); any other set of frequencies as rope_freqs,
    each pair's wavelength multiplier over the file's freq_base, with the factor on cos and sin as
    attn_factor."""
    keys = {"context_length": int(length), "rope.scaling.original_context_length": int(window)}
    kind = (native or {}).get("rope_type")
    if kind == "default":
        return {**keys, "rope.freq_base": float(native["rope_theta"]), "rope.scaling.type": "none"}, None
    if kind == "linear" and attention == 1:
        scaled = {"rope.scaling.type": "linear", "rope.scaling.factor": float(native["factor"])}
        return {**keys, "rope.freq_base": float(native["rope_theta"]), **scaled}, None
    if kind == "yarn" and yarn_ramp_of_llama_cpp(native, window):
        factor = float(native["factor"])
        yarn = {
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": factor,
            "rope.scaling.attn_factor": attention / yarn_mscale(factor),
        }
        return {**keys, "rope.freq_base": float(native["rope_theta"]), **yarn}, None
    if bool((inv_freq == 0).any()):
        raise ValueError(
            "the patch sets some pairs' frequency to 0, an infinite rope_freqs value (llama.cpp's --check-tensors rejects it)"
        )
    freqs = pair_powers(base, dims) / inv_freq.double().numpy()
    return {
        **keys,
        "rope.freq_base": float(base),
        "rope.scaling.type": "none",
        "rope.scaling.attn_factor": attention,
    }, freqs.astype(np.float32)


def yarn_ramp_of_llama_cpp(native: dict, window: int) -> bool:
    """Whether a transformers yarn `rope_parameters` has the ramp llama.cpp's llama architecture
    computes: beta_fast 32, beta_slow 1, rounded to whole pairs, over `window`, no DeepSeek mscale."""
    return (
        native.get("beta_fast") in (None, BETA_FAST)
        and native.get("beta_slow") in (None, BETA_SLOW)
        and native.get("truncate") in (None, True)
        and native.get("mscale") is None
        and native.get("mscale_all_dim") is None
        and native.get("original_max_position_embeddings", window) == window
    )
