"""Native transformers GLM and GLM-4 (`glm`, `glm4`): LLaMA's module layout with a partial rotary
(partial_rotary_factor 0.5: the first half of each head) applied to interleaved pairs.

A GLM checkpoint whose config carries a `linear` scaling is what `rope-ext convert-chatglm` writes
for ChatGLM2-6B-32K, a model fine-tuned with its positions divided by rope_ratio. Such a checkpoint
is patched *on top of* that scaling, as the remote-code adapter patches the source: the positions
keep their 1/ratio unit, the window is max_position_embeddings (or `original_window=`), and the new
factor is relative to it. (Methods that depend on the window see it in the checkpoint's position
units, window / ratio, where the ramp and band formulas were derived.)
"""

from __future__ import annotations

import math
from dataclasses import replace

from torch import nn

from rope_ext.geometry import RotaryGeometry
from rope_ext.method.base import Method
from rope_ext.record import Patch
from rope_ext.rotary import ExtendedRotaryEmbedding

from .llama import LlamaFamily, RotarySite


def position_geometry(geometry: RotaryGeometry, ratio: float) -> RotaryGeometry:
    """The geometry in the checkpoint's position units: a window of L / ratio positions."""
    if ratio == 1:
        return geometry
    window = geometry.original_window / ratio
    return replace(geometry, original_window=int(window) if window.is_integer() else window)


def prescaled_frequencies(method: Method, geometry: RotaryGeometry, factor: float, params: dict, seq_len: int | None, ratio: float):
    """(inv_freq, attention_factor) for `seq_len` tokens of a checkpoint whose positions are divided
    by `ratio`; `geometry` comes from `position_geometry`. Dynamic methods see the length in position
    units, rounded up, so their schedule moves in steps of `ratio` tokens."""
    length = None if seq_len is None else math.ceil(seq_len / ratio)
    inv_freq, scale = method(geometry, length, factor, params)
    return (inv_freq if ratio == 1 else inv_freq / ratio), scale


def checkpoint_position_ratio(rope_parameters: dict) -> float:
    """The position division a checkpoint's own scaling bakes in (linear factor), else 1."""
    if rope_parameters.get("rope_type", "default") == "linear":
        return float(rope_parameters["factor"])
    return 1.0


class PrescaledRotaryEmbedding(ExtendedRotaryEmbedding):
    """ExtendedRotaryEmbedding for a checkpoint trained with positions divided by `position_ratio`."""

    def __init__(self, *args, position_ratio: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.position_ratio = position_ratio
        self.method_geometry = position_geometry(self.geometry, position_ratio)
        inv_freq, self.attention_scaling = prescaled_frequencies(
            self.method, self.method_geometry, self.factor, self.params, None, position_ratio
        )
        self.inv_freq = nn.Buffer(inv_freq.to(self.inv_freq.device), persistent=False)

    def _apply(self, fn, recurse=True):
        # The parent recomputes its fp32 frequencies after a move or cast; redo them in position units.
        super()._apply(fn, recurse)
        inv_freq, _ = prescaled_frequencies(self.method, self.method_geometry, self.factor, self.params, None, self.position_ratio)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def frequencies(self, seq_len: int):
        if not self.dynamic:
            return self.inv_freq, self.attention_scaling
        inv_freq, scale = prescaled_frequencies(self.method, self.method_geometry, self.factor, self.params, seq_len, self.position_ratio)
        return inv_freq.to(self.inv_freq.device), scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, position_ratio={self.position_ratio}"


class GlmFamily(LlamaFamily):
    name = "glm"
    model_types = ("glm", "glm4")
    layout = "interleaved"

    def original_record(self, site: RotarySite, original_window: int | None, saved: Patch | None) -> tuple[dict, bool]:
        fresh = self.installed(site) is None and saved is None
        if fresh and original_window is None and checkpoint_position_ratio(site.config.rope_parameters) != 1:
            original_window = site.config.max_position_embeddings
        return super().original_record(site, original_window, saved)

    def build(self, site: RotarySite, spec: Method, factor: float, params: dict, geometry: RotaryGeometry, record: dict):
        ratio = checkpoint_position_ratio(record["rope_parameters"])
        if ratio == 1:
            return super().build(site, spec, factor, params, geometry, record)
        current = self.installed(site)
        original_cls = current.original_cls if current is not None else type(site.rotary)
        return PrescaledRotaryEmbedding(
            spec, factor, params, geometry, original_cls, record, site.rotary.inv_freq.device, position_ratio=ratio
        )

    def native(self, rotary: ExtendedRotaryEmbedding) -> dict | None:
        if isinstance(rotary, PrescaledRotaryEmbedding):
            return rotary.method.native_over_linear(
                rotary.method_geometry, rotary.factor, rotary.position_ratio, rotary.original["rope_parameters"]
            )
        return super().native(rotary)
