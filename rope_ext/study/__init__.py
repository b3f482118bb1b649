"""The position-encoding study (recipes/pe_study.py): six position-encoding families in one
LLaMA-shaped decoder, trained alike and compared past their training window.

`encodings` holds one small class per family (learned absolute, sinusoidal, T5 relative bias,
DeBERTa disentangled attention, ALiBi); `model` builds the decoder for each, with RoPE as
transformers' own LlamaForCausalLM so that `rope_ext.patch` extends it. The study itself:
`config` (the YAML and its rows), `data`, `train`, `measure` (one model at one length, in a fresh
process), `report` (tables and plot) and `run` (all of it, in order).
"""

from rope_ext.extras import require

require("finetune", "the position-encoding study (rope_ext.study)", ("datasets", "matplotlib", "yaml"))
from .model import ENCODINGS, CompactDecoder, ModelShape, build_model, count_parameters  # noqa: E402

__all__ = ["ENCODINGS", "CompactDecoder", "ModelShape", "build_model", "count_parameters"]
