"""The scaling a checkpoint ships, as the base a patch extends (docs/shipped.md).

Most checkpoints people extend are extended already: Llama 3.1 ships llama3 x8 over an 8192-token
pretraining window and serves 131072 tokens, Qwen2.5 a yarn x4 recipe, gpt-oss and DeepSeek-V3
yarn. A patch of such a model starts from the model as loaded: its frequencies and temperature
are the base and the context it serves is the window the factor multiplies.

How a method composes with the shipped scaling: every RoPE scaling is a factor per rotated pair
(theta_i' = theta_i / s_i) and a temperature on cos/sin. The method's own factors are computed as
for a model with the same base trained at the shipped window (its pure frequency function, on
that geometry), and they multiply the shipped factors; the temperatures multiply. A method that
changes no frequency inside the window (self_extend, rerope, dca, sink_window) rotates with the
shipped frequencies bit for bit, and so gives the shipped model there.

Written natively, such a composition is one transformers `longrope` type with equal short and long
factor lists and an explicit attention factor (`native_longrope`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .geometry import RotaryGeometry
from .method.base import Method, default_inv_freq
from .method.longrope import longrope_powers

# Shipped scalings a patch can extend from: one set of frequencies at every length. longrope
# switches between two sets at its pretraining window and dynamic NTK follows the length, so a
# base of either would differ from the shipped model on one side of that switch.
EXTENDABLE = ("llama3", "yarn", "linear")
# rope types whose rope_parameters record the pretraining window
WINDOW_KEYED = ("yarn", "llama3", "longrope")
# a rope_parameters key of models that read original_max_position_embeddings at forward time for a
# position-dependent query scale (ministral3: 1 + beta ln(1 + floor(p / original)))
QUERY_SCALE_KEY = "llama_4_scaling_beta"
# yarn parameters that divide the temperature between cos/sin and the softmax scale (DeepSeek)
TEMPERATURE_SPLIT = ("mscale", "mscale_all_dim")


@dataclass(frozen=True)
class ShippedScaling:
    """The shipped rotary frequencies (fp32 values, one per rotated pair) and the factor the shipped
    rotary module puts on cos/sin. (The window it serves is the patch's geometry's.)"""

    inv_freq: tuple[float, ...]
    attention_factor: float

    def compose(self, geom: RotaryGeometry, inv_freq: torch.Tensor, attention_factor: float) -> tuple[torch.Tensor, float]:
        """The shipped frequencies times the method's per-pair change (its `inv_freq` over the
        trained frequencies of `geom`). Where the method changes nothing (an attention-side method,
        a dynamic one inside the window) they are the shipped frequencies exactly; otherwise each
        pair takes the value transformers' longrope formula gives for the fp32 factor nearest to
        the product, so that the composition has a native form (the formula does not reach every
        fp32 value: a pair the method keeps may move by an ulp)."""
        shipped = torch.tensor(self.inv_freq, dtype=torch.float32)
        temperature = self.attention_factor * attention_factor
        ratio = inv_freq.double() / default_inv_freq(geom).double()
        if bool((ratio == 1).all()):
            return shipped, temperature
        powers = longrope_powers(geom)
        factors = (1.0 / (shipped.double() * ratio * powers.double())).float()
        return 1.0 / (factors * powers), temperature


@dataclass(frozen=True)
class Shipped:
    """What a checkpoint ships that a patch starts from, as its family's adapter read it: the
    patched layers' flat rope_parameters as loaded (`rope`), the scaling a patch extends (None: the
    patch starts from the trained frequencies), the parameters of that scaling a patch cannot give
    (`fixed`: DeepSeek's temperature split, where its softmax scale follows it) and the context the
    checkpoint serves (None where the family does not say)."""

    rope: dict = field(default_factory=dict)
    scaling: str | None = None
    fixed: tuple[str, ...] = ()
    served: int | None = None

    def params(self, method: Method, given: dict) -> dict:
        """The parameters of `method` that the shipped scaling states, for a patch that replaces
        that scaling by a method of its type; the ones in `given` are the user's. {}: none.
        ValueError for a parameter in `given` that a patch extending the shipped scaling cannot
        take, since that scaling fixes it."""
        rope = self.rope
        if self.scaling is not None:
            # DeepSeek's split of the temperature: mscale_all_dim also sets the softmax scale (transformers'
            # deepseek_v3 reads it at construction), which an extension keeps as shipped; a split given for
            # the extension would put the ratio on cos/sin with no softmax to match it. Only where the shipped
            # scaling moves the softmax scale: ministral3 states a split its attention does not read
            if passed := ", ".join(f"{key}={given[key]!r}" for key in self.fixed if given.get(key) is not None):
                stated = ", ".join(f"{key} {rope[key]!r}" for key in TEMPERATURE_SPLIT if rope.get(key) is not None)
                raise ValueError(
                    f"{method.name}: {passed} contradicts this checkpoint's shipped {self.scaling} scaling, which fixes "
                    f"how the temperature divides between cos/sin and the softmax ({stated} at factor "
                    f"{rope.get('factor')!r}); a patch that extends the shipped model keeps that division and puts its "
                    "own temperature on cos/sin (attention_factor=). To choose the division, replace the shipped "
                    f"scaling: original_window={rope.get('original_max_position_embeddings')}"
                )
            return {}
        if rope.get("rope_type") != method.name:
            return {}
        return {k: rope[k] for k in method.all_params if rope.get(k) is not None and k not in given}


def served_context(rope: dict, max_position_embeddings: int) -> int:
    """The context a checkpoint with (flat) rope_parameters `rope` serves as shipped: its
    max_position_embeddings, or for a window-keyed scaling the pretraining window times the factor
    where that is longer (Qwen2.5's yarn recipe keeps max_position_embeddings at 32768)."""
    if rope.get("rope_type") in ("yarn", "llama3") and rope.get("original_max_position_embeddings") and rope.get("factor"):
        return max(max_position_embeddings, math.ceil(rope["original_max_position_embeddings"] * rope["factor"]))
    return max_position_embeddings


class ShippedBase:
    """The frequency function of a method over a shipped scaling (with_shipped_base)."""

    def __init__(self, frequencies, shipped: ShippedScaling):
        self.frequencies, self.shipped = frequencies, shipped

    def __call__(self, geom: RotaryGeometry, seq_len: int | None = None, *, factor, **params):
        inv_freq, scale = self.frequencies(geom, seq_len, factor=factor, **params)
        return self.shipped.compose(geom, inv_freq, scale)


def with_shipped_base(method: Method, shipped: ShippedScaling | None) -> Method:
    """`method` over the checkpoint's shipped scaling (None: over the trained frequencies)."""
    return method if shipped is None else replace(method, fn=ShippedBase(method.fn, shipped))


def shipped_of(method: Method) -> ShippedScaling | None:
    return method.fn.shipped if isinstance(method.fn, ShippedBase) else None


def longrope_factors(geom: RotaryGeometry, inv_freq: torch.Tensor) -> list[float] | None:
    """Per-pair factors under which transformers' longrope formula, 1 / (factor * base^(2i/D)) in
    fp32, gives `inv_freq` bit for bit; None where some pair has no such fp32 factor (the formula
    does not reach every fp32 value)."""
    powers = longrope_powers(geom)
    guess = (1.0 / (inv_freq.double() * powers.double())).float()
    factors = []
    for target, power, start in zip(inv_freq, powers, guess):
        candidates = [start]
        for direction in (math.inf, -math.inf):
            step = start
            for _ in range(3):
                step = torch.nextafter(step, torch.tensor(direction))
                candidates.append(step)
        exact = next((c for c in candidates if torch.equal(1.0 / (c * power), target)), None)
        if exact is None or not torch.isfinite(exact):  # a pair that stops turning (proportional) has no factor
            return None
        factors.append(float(exact))
    return factors


def native_longrope(geom: RotaryGeometry, inv_freq: torch.Tensor, attention_factor: float, max_length: int, rope: dict):
    """The transformers `longrope` rope_parameters whose frequencies are `inv_freq` at every length
    (equal short and long lists) with `attention_factor` on cos/sin, or None. vLLM and SGLang read
    no `attention_factor` for longrope: their factor on cos/sin is `short_mscale` / `long_mscale`
    where given (rope_ext.serving.longrope_mscales), so a temperature other than 1 is written there
    too (transformers ignores the two keys: rope_ext.record.UNLISTED_KEYS)."""
    factors = longrope_factors(geom, inv_freq.cpu())
    if factors is None:
        return None
    kept = {k: v for k, v in rope.items() if k == "partial_rotary_factor"}
    # transformers reads this window only to choose between the (equal) lists; a model that reads it
    # at forward time for a query scale keeps its own, and the engines' default temperature,
    # sqrt(1 + ln(M / L) / ln L), is 1 for a window L no shorter than the M they serve
    window = rope.get("original_max_position_embeddings") if QUERY_SCALE_KEY in rope else None
    window = window or max(max_length, geom.original_window)
    engines = (
        {} if attention_factor == 1 and window >= max_length else dict.fromkeys(("short_mscale", "long_mscale"), attention_factor)
    )
    return {
        "rope_type": "longrope",
        "rope_theta": geom.base,
        **kept,
        "short_factor": factors,
        "long_factor": factors,
        "factor": max_length / geom.original_window,
        "attention_factor": attention_factor,
        "original_max_position_embeddings": window,
        **engines,
    }
