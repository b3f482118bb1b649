"""string: STRING, shifted rotary position embedding (An et al. 2025, "Why Does the Effective Context
Length of LLMs Fall Short?", ICLR; reference code HKUNLP/STRING), training-free.

Models are trained on far fewer long distances than short ones, so the largest distances they
were trained on are the ones they use worst. STRING drops them: for a query at position i and a
key at position j <= i, with shift S and local window W,

    i - j <  S:  relative distance i - j                  (the usual RoPE)
    i - j >= S:  relative distance i - j - S + W          (query at i - S + W, key at j)

both parts in one softmax. Distances S .. L - 1, the least trained, are no longer used past W + (L -
1 - S); the well-trained small distances are used twice. Defaults from the paper: S = int(0.33 N)
(N the length the patch is meant for; "0.25 to 0.4" of it) and W = 128 (S / 2 where S is
smaller, in models with a small window).

Inside the trained window (no factor, or factor 1: N = L) the frequencies are the trained ones, and a
sequence shorter than S is the unpatched model's, bit for bit. To reach N > L the largest distance,
N - 1 - S + W, would leave the trained range; the authors then run STRING over YaRN with factor
(N / L)(1 - S / N) = (N - S) / L (2.68 at N = 4L with S = 0.33 N), as in their Qwen2 runs, and so does
this method (its frequencies are yarn's, rope_ext.method.rope).

`temperature=True` multiplies cos and sin by TEMPERATURE for queries and keys, so every logit by
its square, as the reference code does at every length; the paper does not state it, so it is off
by default.

How it runs: the two-part engine of self_extend and rerope (rope_ext.method.attention_side), with
the near window S and the distant positions above. Queries below S attend through the model's own
backend at their own positions; a query's positions depend only on its own position, so one forward,
chunked prefill and token-by-token decoding give the same numbers. Keys stay at their own positions
in both parts: a DynamicCache's keys are kept rotated between forwards in one copy of the key cache
(rope_ext.attention.keys.RotatedKeys), and a decode step rotates only its query and its new key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.geometry import RotaryGeometry

from .attention_side import TwoPartMethod
from .base import ModelFacts, Param, default_inv_freq
from .rope import yarn

NAME = "string"
PARAMS = (
    Param("shift", None, "size", lo=1, none="the default", doc="S: distances from S on move down to S - W"),
    Param("local", None, "size", lo=0, none="the default", doc="W: what the shift moves distance S to"),
    Param("temperature", False, "bool", doc="cos and sin times TEMPERATURE, as the authors' code"),
)
SUMMARY = "STRING: distances past the shift S replaced by well-trained ones, d - S + W (over YaRN past the window)"
FORMULA = "i-j < S: distance i-j; else i-j-S+W (query at i-S+W); one softmax; frequencies yarn((N-S)/L) when N - S > L"
SHIFT_FRACTION = 0.33  # of N, the paper's default (An et al. 2025, section 4)
LOCAL = 128  # W, the paper's default
TEMPERATURE = 1.0693  # cos/sin scale of HKUNLP/STRING's code for queries and keys


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

    distant_keys_own: ClassVar[bool] = True  # only the query moves: one kept copy of the keys

    def derive(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
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


METHOD = StringMethod(NAME, SUMMARY, FORMULA, params=PARAMS, fn=string_frequencies, factor_required=False, factor_one=True)
