"""The contract every context-extension method meets.

A method is a `Method`: a name, parameters with defaults and their validation, and one pure
frequency function `(geometry, seq_len, *, factor, **params) -> (inv_freq, attention_factor)`.
What a method may add is declared on it, never special-cased by the orchestration
(rope_ext.patching):

- `bind(params)`: the method for these parameters, for a method whose parameter set depends on
  one of them (alibi_hybrid's `rope`);
- `resolve(facts, geometry, factor, params)`: parameters derived from the model (self_extend's
  group and window, alibi_hybrid's bias-free distance), checked against what the model is;
- `attention(rotary, facts, params)`: transforms run inside attention (rope_ext.attention), with what
  they keep on the model;
- `native(geometry, factor, params, rope)`: the transformers `rope_parameters` that reproduce the
  method on a plain reload, or None (`native_over_linear`: the same on a checkpoint that keeps
  its own linear scaling);
- `needs_attention_interface`: attention must run through transformers' AttentionInterface;
- `load_state(model, path, params)`: state a saved checkpoint holds beyond the config;
- `keeps_config_window`: the config's max_position_embeddings stays the trained window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from rope_ext.geometry import RotaryGeometry

FrequencyFn = Callable[..., "tuple[torch.Tensor, float]"]

# How a dynamic method's length is chosen (read by the rotary module, not by the math):
# causal=True gives each token the scaling for the length it has seen, so a full forward equals
# token-by-token decoding; causal=False uses one scaling per forward from its longest position, as
# transformers does. granularity=g re-scales every g tokens past the window instead of every token.
SCHEDULE_PARAMS = {"causal": True, "granularity": 1}


@dataclass(frozen=True)
class ModelFacts:
    """What a method may check about the model it patches, as the family adapter reads it."""

    family: str
    backend: str  # the attention implementation, without a rope-ext wrapper prefix
    num_heads: int
    causal: bool  # every attention layer is causal
    attention_interface: bool  # attention runs through transformers' AttentionInterface
    config: dict = field(default_factory=dict)  # the model's config, for settings a checkpoint states for a method


@dataclass(frozen=True)
class Method:
    """A registered method: its frequency function, parameters with defaults, and how it behaves."""

    name: str
    fn: FrequencyFn
    summary: str
    formula: str
    params: dict = field(default_factory=dict)
    dynamic: bool = False  # what a query sees depends on the length it has seen: keys are cached before rotation
    needs_attention_interface: bool = False
    keeps_config_window: bool = False
    factor_required: bool = True

    @property
    def rescales(self) -> bool:
        """Whether the frequencies follow the length (so queries past the window fall into one
        group per scaling under the causal schedule)."""
        return self.dynamic

    @property
    def all_params(self) -> dict:
        return {**self.params, **(SCHEDULE_PARAMS if self.dynamic else {})}

    def bind(self, params: dict) -> Method:
        return self

    def validate(self, factor, params: dict) -> dict:
        """Checked parameters with defaults filled in; raises ValueError on anything wrong."""
        check_factor(factor)
        self.check_known(params)
        merged = {**self.all_params, **params}
        if self.dynamic:
            check_schedule(self.name, merged)
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

    def check_known(self, params: dict, context: str = "") -> None:
        unknown = sorted(set(params) - set(self.all_params))
        if unknown:
            allowed = ", ".join(self.all_params) or "none"
            raise ValueError(f"unknown parameter(s) {unknown} for {context or f'method {self.name!r}'}; allowed: {allowed}")

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        return factor, params

    def attention(self, rotary, facts: ModelFacts, params: dict) -> list:
        return []

    def native(self, geometry: RotaryGeometry, factor: float, params: dict, rope: dict) -> dict | None:
        return None

    def native_over_linear(self, geometry: RotaryGeometry, factor: float, ratio: float, rope: dict) -> dict | None:
        """`native` for a checkpoint trained with its positions divided by `ratio` (a linear
        scaling it keeps under the patch), or None where the two do not compose into one type."""
        return None

    def load_state(self, model, path, params: dict) -> None:
        pass

    def __call__(self, geom: RotaryGeometry, seq_len: int | None, factor: float, params: dict):
        math_params = {k: v for k, v in params.items() if k not in SCHEDULE_PARAMS}
        return self.fn(geom, seq_len, factor=factor, **math_params)


def check_factor(factor) -> None:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ValueError(f"factor must be a number > 1, got {factor!r}")
    if not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"factor must be a finite number > 1, got {factor!r}")


def check_schedule(name: str, params: dict) -> None:
    if not isinstance(params["causal"], bool):
        raise ValueError(f"{name}: causal must be True or False, got {params['causal']!r}")
    g = params["granularity"]
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"{name}: granularity must be an int >= 1, got {g!r}")


def default_inv_freq(geom: RotaryGeometry, base: float | torch.Tensor | None = None) -> torch.Tensor:
    """theta_i = base^(-2i/D): the frequencies the model was trained with."""
    exponents = torch.arange(0, geom.rotary_dim, 2, dtype=torch.int64).float() / geom.rotary_dim
    return 1.0 / ((geom.base if base is None else base) ** exponents)


def trained_frequencies(geom: RotaryGeometry, seq_len=None, *, factor, **params) -> tuple[torch.Tensor, float]:
    """The model's own frequencies, for methods that change attention rather than the rotation."""
    return default_inv_freq(geom), 1.0
