"""dpe: Dimension-Wise Positional Embeddings Manipulation (Lu et al. 2025, "Effective Length
Extrapolation via Dimension-Wise Positional Embeddings Manipulation", arXiv 2504.18857; reference
code LuLuLuyi/DPE, dpe_for_llama.py), training-free.

RoPE's D/2 frequency pairs are split into G equal groups of consecutive pairs, group 0 the fastest,
each with its own scale s_g. For a query at position i and a key at position j <= i, with local
window W:

    i - j <  W:  the usual positions i and j, in every group                        (local window)
    i - j >= W:  in group g, key floor(j/s_g), query floor(i/s_g) + W - floor(W/s_g)  (scaled)

both kinds of logits in one softmax; with one group this is self_extend with group s. The floor is
used in prefill and decoding alike (the reference code's prefill divides W exactly), so the two
agree for every scale. By default only queries past the trained window use the scaled positions
(`inside_window=True`: from W on, as the reference code). The reference code's top-k "key
dimensions" selection is not here. Parameters, presets and measurements: docs/dpe.md; how it runs:
docs/concepts.md, "How the attention-side methods run".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.geometry import RotaryGeometry

from .attention_side import TwoPartMethod, reaching_group
from .base import ModelFacts, Param

NAME = "dpe"
SUMMARY = "DPE: exact positions for neighbours; distant keys at positions scaled per group of RoPE dimensions"
FORMULA = "i-j < W: positions (i, j); else in frequency group g: (floor(i/s_g) + W - floor(W/s_g), floor(j/s_g)); one softmax"

# The scales the authors publish, one per group of consecutive frequency pairs, fastest first.
# llama3-8b-instruct: LuLuLuyi/DPE README (quick start and "Add the Results to DPE config"), with
# local window 1024 and 8 groups of 8 of Llama-3-8B's 64 pairs, for 128k tokens over its 8192.
PRESETS = {"llama3-8b-instruct": (4, 4, 2, 16, 32, 32, 16, 128)}
WINDOW_FRACTION = 8  # W = L / 8: the authors' 1024 of 8192
PARAMS = (
    Param(
        "scales",
        None,
        "list",
        item=Param("scale", kind="size", lo=1),
        presets=tuple(PRESETS.items()),
        doc="one per group of frequency pairs",
    ),
    Param("window", None, "size", lo=1, doc="W: keys within W tokens keep their positions"),
    Param("inside_window", False, "bool", doc="queries inside the trained window attend in two parts too"),
)


def group_distances(target: int, scales: list[int], window: int) -> list[int]:
    """The largest distance each group gives at `target` tokens: query target - 1 against key 0,
    floor((N - 1)/s) + W - floor(W/s), or N - 1 where the sequence ends inside the window."""
    if target <= window:
        return [target - 1] * len(scales)
    return [(target - 1) // s + window - window // s for s in scales]


@dataclass(frozen=True)
class DpeMethod(TwoPartMethod):
    """DPE's per-group scales and local window, as the two-part engine's grouped distant positions."""

    grouped: ClassVar[bool] = True

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        trained, pairs = geometry.original_window, geometry.rotary_dim // 2
        window = max(1, trained // WINDOW_FRACTION) if params["window"] is None else params["window"]
        if window >= trained:
            raise ValueError(f"{NAME}: the local window ({window}) must be smaller than the trained window ({trained})")
        scales = params["scales"] or [reaching_group(trained, math.ceil(trained * factor), window)]
        if pairs % len(scales):
            raise ValueError(
                f"{NAME}: {len(scales)} scales do not split this model's {pairs} frequency pairs (rotary dim "
                f"{geometry.rotary_dim}) into equal groups; give a number of scales that divides {pairs}"
            )
        return float(factor), {**params, "scales": scales, "window": window}

    def notes(self, geometry: RotaryGeometry, factor: float, params: dict) -> dict:
        """Each group's largest distance at max_length, beside the trained window: a fast group may
        go past it (the authors' Llama-3 scales 2 and 4 do), a slow one should not."""
        trained = geometry.original_window
        target = math.ceil(trained * factor)
        largest = group_distances(target, params["scales"], params["window"])
        return {
            "group_distances": {
                "target": target,
                "largest": largest,
                "inside_trained": [d < trained for d in largest],
                "pairs_per_group": geometry.rotary_dim // 2 // len(params["scales"]),
            }
        }

    def switched(self, frame, trained: int, params: dict) -> torch.Tensor:
        return frame.q_pos >= (params["window"] if params["inside_window"] else trained)

    def distant_query(self, q_pos: torch.Tensor, params: dict) -> torch.Tensor:
        """[..., S, G]: floor(i/s_g) + W - floor(W/s_g) for each group g."""
        scales, window = torch.tensor(params["scales"], device=q_pos.device), params["window"]
        return torch.div(q_pos[..., None], scales, rounding_mode="floor") + (window - window // scales)

    def distant_key(self, k_pos: torch.Tensor, params: dict) -> torch.Tensor:
        """[..., S, G]: floor(j/s_g) for each group g."""
        return torch.div(k_pos[..., None], torch.tensor(params["scales"], device=k_pos.device), rounding_mode="floor")


METHOD = DpeMethod(NAME, SUMMARY, FORMULA, params=PARAMS)
