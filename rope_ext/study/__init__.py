"""The position-encoding study (recipes/pe_study.py): six position-encoding families in one
LLaMA-shaped decoder, trained alike and compared past their training window.

`encodings` holds one small class per family (learned absolute, sinusoidal, T5 relative bias,
DeBERTa disentangled attention, ALiBi); `model` builds the decoder for each, with RoPE as
transformers' own LlamaForCausalLM so that `rope_ext.patch` extends it.
"""

from .model import ENCODINGS, CompactDecoder, ModelShape, build_model, count_parameters

__all__ = ["ENCODINGS", "CompactDecoder", "ModelShape", "build_model", "count_parameters"]
