"""string: STRING, shifted rotary position embedding (An et al. 2025, "Why Does the Effective Context
Length of LLMs Fall Short?", ICLR; reference code HKUNLP/STRING), training-free.

For a query at position i and a key at position j <= i, with shift S and local window W:

    i - j <  S:  relative distance i - j                  (the usual RoPE)
    i - j >= S:  relative distance i - j - S + W          (query at i - S + W, key at j)

both parts in one softmax, so the least trained distances S .. L - 1 give way to well-trained small
ones. Defaults from the paper: S = int(0.33 N), N the length the patch is meant for, and W = 128 (S / 2
where S is smaller). Past the trained window the frequencies are YaRN's at (N - S) / L, as in the
authors' runs; `temperature=True` scales cos and sin by the reference code's TEMPERATURE. Parameters
and measurements: docs/string.md; how it runs: docs/concepts.md, "How the attention-side methods
run".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from rope_ext.geometry import RotaryGeometry

from .attention_side import TwoPartMethod
from .base import FrequencyFn, ModelFacts, Param, default_inv_freq
from .rope import yarn

NAME = "string"
SUMMARY = "STRING: distances past the shift S replaced by well-trained ones, d - S + W (over YaRN past the window)"
FORMULA = "i-j < S: distance i-j; else i-j-S+W (query at i-S+W); one softmax; frequencies yarn((N-S)/L) when N - S > L"
SHIFT_FRACTION = 0.33  # of N, the paper's default (An et al. 2025, section 4)
LOCAL = 128  # W, the paper's default
TEMPERATURE = 1.0693  # cos/sin scale of HKUNLP/STRING's code for queries and keys
PARAMS = (
    Param("shift", None, "size", lo=1, doc="S: distances from S on move down to S - W"),
    Param("local", None, "size", lo=0, doc="W: what the shift moves distance S to"),
    Param("temperature", False, "bool", doc="cos and sin times TEMPERATURE, as the authors' code"),
)


def string_frequencies(geom: RotaryGeometry, seq_len=None, *, factor: float, shift: int, local: int, temperature: bool):
    """The trained frequencies where the shifted distances stay inside the window, else YaRN's at
    (N - S) / L; times TEMPERATURE with `temperature`."""
    target = math.ceil(geom.original_window * factor)
    stretch = (target - shift) / geom.original_window
    inv_freq, scale = yarn(geom, factor=stretch) if stretch > 1 else (default_inv_freq(geom), 1.0)
    return inv_freq, scale * TEMPERATURE if temperature else scale


@dataclass(frozen=True)
class StringMethod(TwoPartMethod):
    """STRING's shift and local window, as the two-part engine's near window and distant positions.
    A factor is optional: without one (or with 1) the patch is for the trained window itself."""

    fn: FrequencyFn = field(default=string_frequencies, kw_only=True)
    factor_required: bool = False
    factor_one: bool = True
    distant_keys_own: ClassVar[bool] = True  # only the query moves: one kept copy of the keys

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        trained = geometry.original_window
        factor = 1.0 if factor is None else float(factor)
        target = math.ceil(trained * factor)
        shift = int(SHIFT_FRACTION * target) if params["shift"] is None else params["shift"]
        local = min(LOCAL, shift // 2) if params["local"] is None else params["local"]
        if not local < shift:
            raise ValueError(
                f"{NAME}: need local < shift (the shift moves distances down to local), got local={local}, shift={shift}"
            )
        reach = max(trained, target - shift)  # the window of the frequencies: trained, or yarn's at (N - S) / L
        if shift > reach:
            raise ValueError(
                f"{NAME}: shift {shift} exceeds the {reach} positions the frequencies cover (the trained window {trained}, "
                f"or N - S past it): distances below the shift keep their RoPE distance"
            )
        if shift >= target:
            raise ValueError(
                f"{NAME}: shift {shift} is not below the {target} tokens the patch is meant for: nothing would shift"
            )
        return factor, {**params, "shift": shift, "local": local}

    def near_window(self, params: dict) -> int:
        return params["shift"]

    def switched(self, frame, trained: int, params: dict) -> torch.Tensor:
        return frame.q_pos >= params["shift"]

    def distant_query(self, q_pos: torch.Tensor, params: dict) -> torch.Tensor:
        return q_pos - (params["shift"] - params["local"])

    def distant_key(self, k_pos: torch.Tensor, params: dict) -> torch.Tensor:
        return k_pos


METHOD = StringMethod(NAME, SUMMARY, FORMULA, params=PARAMS)
