"""Small GGUF files for the tests of `rope-ext patch MODEL.gguf`: a transformers LLaMA written in
llama.cpp's layout (fp32 tensors named by the gguf package's tensor map, q and k rows reordered
from transformers' rotated halves to llama.cpp's adjacent pairs), with no tokenizer
(`tokenizer.ggml.model` "none": llama.cpp then reads token ids only, src/llama-vocab.cpp)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def adjacent_pairs(weight: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows per head from (x_j, x_j+d/2) pairs, transformers' rotate_half, to (x_2j, x_2j+1),
    llama.cpp's LLAMA_ROPE_TYPE_NORM."""
    rows, columns = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, columns).transpose(0, 2, 1, 3).reshape(rows, columns)


def write_llama_gguf(model, path: Path, rope: dict | None = None, rope_freqs: np.ndarray | None = None) -> Path:
    """`model` (a LlamaForCausalLM) as a GGUF file at `path`; `rope`: extra {key under llama.: value}."""
    import gguf

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("none")
    for key, value in (rope or {}).items():
        kind = gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.get_type(value)
        writer.add_key_value(f"llama.{key}", value, gguf.GGUFValueType.UINT32 if kind == gguf.GGUFValueType.INT32 else kind)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            array = adjacent_pairs(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = adjacent_pairs(array, config.num_key_value_heads)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(array))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
