"""Native transformers GLM and GLM-4 (`glm`, `glm4`): LLaMA's module layout with a partial rotary
(partial_rotary_factor 0.5: the first half of each head) applied to interleaved pairs.

A GLM checkpoint whose config carries a `linear` scaling is what `rope-ext convert-chatglm` writes
for ChatGLM2-6B-32K, a model fine-tuned with its positions divided by rope_ratio. Such a checkpoint
is patched *on top of* that scaling, as the remote-code adapter patches the source: the positions
keep their 1/ratio unit, the window is max_position_embeddings (or `original_window=`), and the new
factor is relative to it (rope_ext.rotary.with_position_ratio: methods that depend on the window
see it in the checkpoint's position units, window / ratio, where the ramp and band formulas were
derived).
"""

from __future__ import annotations

from rope_ext.method.base import Method
from rope_ext.record import Patch
from rope_ext.rotary import ExtendedRotaryEmbedding, position_geometry, with_position_ratio

from .base import ModelReading
from .llama import LlamaFamily, RotarySite


def checkpoint_position_ratio(rope_parameters: dict) -> float:
    """The position division a checkpoint's own scaling bakes in (linear factor), else 1."""
    if rope_parameters.get("rope_type", "default") == "linear":
        return float(rope_parameters["factor"])
    return 1.0


class GlmFamily(LlamaFamily):
    name = "glm"
    model_types = ("glm", "glm4")

    def original_record(self, site: RotarySite, original_window: int | None, saved: Patch | None) -> tuple[dict, bool]:
        fresh = site.installed is None and saved is None
        if fresh and original_window is None and checkpoint_position_ratio(site.config.rope_parameters) != 1:
            original_window = site.config.max_position_embeddings
        return super().original_record(site, original_window, saved)

    def build(self, reading: ModelReading, spec: Method, factor: float, params: dict):
        ratio = checkpoint_position_ratio(reading.original["rope_parameters"])
        return super().build(reading, with_position_ratio(spec, ratio), factor, params)

    def native(self, rotary: ExtendedRotaryEmbedding) -> dict | None:
        rope = rotary.original["rope_parameters"]
        ratio = checkpoint_position_ratio(rope)
        if ratio != 1:
            return rotary.method.native_over_linear(position_geometry(rotary.geometry, ratio), rotary.factor, ratio, rope)
        return super().native(rotary)
