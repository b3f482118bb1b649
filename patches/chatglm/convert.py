"""Convert a remote-code ChatGLM2 / ChatGLM3 / GLM-4 checkpoint to a native transformers GLM one.

On transformers 5 the remote-code models still build but cannot generate(); the native `glm` model
can, and rope-ext, peft and the trainers treat it like LLaMA. The mapping (docs/references.md,
"ChatGLM rotary conventions"):

    transformer.embedding.word_embeddings       -> model.embed_tokens
    layers.N.input_layernorm / post_attention_layernorm -> same names
    layers.N.self_attention.query_key_value     -> self_attn.q_proj / k_proj / v_proj (split)
    layers.N.self_attention.dense               -> self_attn.o_proj
    layers.N.mlp.dense_h_to_4h / dense_4h_to_h  -> mlp.gate_up_proj / down_proj (same gate|up order)
    transformer.encoder.final_layernorm         -> model.norm
    transformer.output_layer                    -> lm_head
    seq_length -> max_position_embeddings, kv_channels -> head_dim (partial_rotary_factor 0.5),
    multi_query_group_num -> num_key_value_heads

rope_ratio: where it multiplies the base (ChatGLM3-6B-32K, GLM-4) rope_theta = 10000 * rope_ratio;
where it divides positions (ChatGLM2-6B-32K) a linear scaling with factor rope_ratio. Which one a
checkpoint means is in its code, so it is read from a loaded model's rotary module (the same probe
the adapter uses), or from the checkpoint's modeling file without running it, or given explicitly.
Native GLM computes positions in fp32, also where ChatGLM2's code rounds them in fp16.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import unwrap
from .adapter import V1_ERROR, ChatGLMFamily, read_convention

# what rope_ratio does: ChatGLM3-6B-32K and GLM-4 multiply the base by it, ChatGLM2-6B-32K divides positions
MEANINGS = ("base", "positions")
# how messages name the rope_ratio_meaning option: convert_chatglm's keyword, the command's flag
PYTHON_SPELLING = "rope_ratio_meaning={!r}"
CLI_SPELLING = "--rope-ratio-meaning {}"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Files copied beside the weights so the converted folder keeps its tokenizer and generation settings.
COPIED = (
    "tokenizer*",
    "tokenization_*.py",
    "*.model",
    "*.tiktoken",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class Conversion:
    """What `convert_chatglm` wrote."""

    dst: Path
    rope_parameters: dict
    rope_ratio: float
    rope_ratio_meaning: str | None  # None when rope_ratio is 1
    meaning_from: str  # where the meaning was read: the loaded model, the modeling file, the caller
    tensors: int
    copied: list[str]


def ratio_meaning_from_code(source: str) -> str | None:
    """'base' or 'positions' when the code combines `self.rope_ratio` one way only (multiplying, as
    ChatGLM3-32K and GLM-4 do to the base; dividing, as ChatGLM2-32K does to positions), else None."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp):
            operands, op = (node.left, node.right), node.op
        elif isinstance(node, ast.AugAssign):
            operands, op = (node.value,), node.op
        else:
            continue
        if any(isinstance(x, ast.Attribute) and x.attr == "rope_ratio" for x in operands):
            if isinstance(op, ast.Mult):
                found.add("base")
            elif isinstance(op, ast.Div):
                found.add("positions")
    return found.pop() if len(found) == 1 else None


def _modeling_file(src: Path, config: dict) -> Path | None:
    auto_map = config.get("auto_map", {})
    for key in ("AutoModelForCausalLM", "AutoModel"):
        reference = auto_map.get(key)
        if reference and "--" not in reference:  # "repo--module.Class" points into another repository
            path = src / (reference.rsplit(".", 1)[0] + ".py")
            if path.is_file():
                return path
    return None


def _read_weights(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    indexes = [src / name for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json") if (src / name).is_file()]
    if indexes:
        shards = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
    else:
        shards = [name for name in ("model.safetensors", "pytorch_model.bin") if (src / name).is_file()][:1]
        if not shards:
            raise ValueError(f"{src}: no model.safetensors, pytorch_model.bin or shard index found")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        path = src / shard
        if path.suffix == ".safetensors":
            weights.update(load_file(path))
        else:
            weights.update(torch.load(path, map_location="cpu", weights_only=True))
    return weights


def _check_supported(config: dict) -> None:
    if config.get("model_type") != "chatglm":
        raise ValueError(f"not a ChatGLM checkpoint: model_type={config.get('model_type')!r}")
    if config.get("position_encoding_2d"):
        raise ValueError(V1_ERROR)
    expected = {
        "rmsnorm": True,
        "post_layer_norm": True,
        "apply_residual_connection_post_layernorm": False,
        "multi_query_attention": True,
        "add_bias_linear": False,
    }
    differs = {k: config.get(k) for k, v in expected.items() if config.get(k, v) != v}
    if config.get("pre_seq_len"):
        differs["pre_seq_len"] = config["pre_seq_len"]
    if config.get("quantization_bit"):
        differs["quantization_bit"] = config["quantization_bit"]
    if differs:
        raise ValueError(
            f"native GLM has no equivalent for this ChatGLM variant: {differs} "
            f"(convertible checkpoints have {expected}, no P-tuning prefix and no quantization)"
        )


def native_config(config: dict, meaning: str | None, dtype: torch.dtype):
    """The GlmConfig equivalent to a ChatGLM config.json whose rope_ratio has `meaning`."""
    from transformers import GlmConfig

    ratio = float(config.get("rope_ratio", 1))
    rope = {"rope_type": "default", "rope_theta": 10000.0 * (ratio if meaning == "base" else 1.0), "partial_rotary_factor": 0.5}
    if meaning == "positions":
        rope = {**rope, "rope_type": "linear", "factor": ratio}
    return GlmConfig(
        vocab_size=config["padded_vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["ffn_hidden_size"],
        num_hidden_layers=config["num_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["multi_query_group_num"],
        head_dim=config["kv_channels"],
        max_position_embeddings=config["seq_length"],
        rms_norm_eps=config["layernorm_epsilon"],
        attention_bias=bool(config.get("add_qkv_bias", False)),
        attention_dropout=config.get("attention_dropout", 0.0),
        tie_word_embeddings=False,
        rope_parameters=rope,
        pad_token_id=config.get("pad_token_id"),
        eos_token_id=config.get("eos_token_id"),
        bos_token_id=config.get("bos_token_id"),
        dtype=dtype,
    )


def native_weights(weights: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """ChatGLM tensor names -> native GLM names, the fused query_key_value split into q, k, v.
    Raises ValueError on a tensor it does not know, or one the native model needs that is missing."""
    q_size = config["num_attention_heads"] * config["kv_channels"]
    kv_size = config["multi_query_group_num"] * config["kv_channels"]
    renamed = {
        "transformer.embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "transformer.encoder.final_layernorm.weight": "model.norm.weight",
        "transformer.output_layer.weight": "lm_head.weight",
    }
    in_layer = {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.dense.weight": "self_attn.o_proj.weight",
        "mlp.dense_h_to_4h.weight": "mlp.gate_up_proj.weight",
        "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
    }
    out, unknown = {}, []
    prefix = "transformer.encoder.layers."
    for name, tensor in weights.items():
        if name in renamed:
            out[renamed[name]] = tensor
        elif name.endswith("rotary_pos_emb.inv_freq"):
            continue  # recomputed from rope_parameters
        elif name.startswith(prefix):
            index, rest = name[len(prefix) :].split(".", 1)
            target = f"model.layers.{index}."
            if rest in in_layer:
                out[target + in_layer[rest]] = tensor
            elif rest.startswith("self_attention.query_key_value."):
                kind = rest.rsplit(".", 1)[1]
                if tensor.shape[0] != q_size + 2 * kv_size:
                    raise ValueError(f"{name}: {tuple(tensor.shape)} does not split into q {q_size} + k {kv_size} + v {kv_size}")
                q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
                for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    out[f"{target}self_attn.{proj}.{kind}"] = part.clone()
            else:
                unknown.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"no native GLM equivalent for {len(unknown)} tensor(s): {unknown[:8]}")
    return out


def _load_source(src, rope_ratio_meaning: str | None, spelling: str):
    """(config dict, weights, meaning, where the meaning came from, folder to copy files from)."""
    if isinstance(src, nn.Module):
        adapter = ChatGLMFamily()
        model = unwrap(src)
        if getattr(model.config, "model_type", None) not in adapter.model_types:
            raise ValueError(f"not a ChatGLM model: {type(model).__name__}")
        site = adapter.site(model)
        if site.installed is not None:
            raise ValueError("this model is patched by rope_ext; unpatch it before converting")
        config = model.config.to_dict()
        _check_supported(config)
        record = read_convention(site.rotary, model.config, model.config.kv_channels)
        meaning = record["rope_ratio_meaning"]
        if rope_ratio_meaning is not None and meaning is not None and rope_ratio_meaning != meaning:
            raise ValueError(f"{spelling.format(rope_ratio_meaning)}, but the model's rotary module {meaning!r}")
        name = getattr(model.config, "_name_or_path", None)
        folder = Path(name) if name and Path(name).is_dir() else None
        return config, model.state_dict(), meaning, "the loaded model's rotary module", folder
    src = Path(src)
    config, meaning, source = _folder_source(src, rope_ratio_meaning, spelling)
    return config, _read_weights(src), meaning, source, src


def _folder_source(src: Path, rope_ratio_meaning: str | None, spelling: str):
    """(config dict, meaning of rope_ratio, where the meaning came from) of a checkpoint folder,
    without reading its weights; `spelling` formats the rope_ratio_meaning option in messages."""
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{src}: no config.json (not a checkpoint folder)")
    config = json.loads(config_path.read_text())
    _check_supported(config)
    ratio = float(config.get("rope_ratio", 1))
    if ratio == 1:
        return config, None, "rope_ratio is 1"
    if rope_ratio_meaning is not None:
        return config, rope_ratio_meaning, "the caller"
    code = _modeling_file(src, config)
    meaning = ratio_meaning_from_code(code.read_text()) if code else None
    if meaning is None:
        where = f"{code.name} uses self.rope_ratio both ways or not at all" if code else "no local modeling file"
        raise ValueError(
            f"{src}: rope_ratio={ratio:g}, and its meaning cannot be read ({where}); pass {spelling.format('base')} "
            f"(ChatGLM3-6B-32K, GLM-4: base = 10000 * rope_ratio) or {spelling.format('positions')} (ChatGLM2-6B-32K: "
            "positions / rope_ratio), or convert a model loaded with trust_remote_code=True"
        )
    return config, meaning, code.name


def check_destination(dst: Path) -> None:
    """FileExistsError unless `dst` is a new or empty folder."""
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} is a file, not a folder; choose a new folder")
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty; choose a new folder")


def convert_chatglm(
    src,
    dst,
    *,
    rope_ratio_meaning: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
    spelling: str = PYTHON_SPELLING,
) -> Conversion:
    """Write the remote-code ChatGLM checkpoint `src` (a folder, or a model loaded with
    trust_remote_code=True) as a native transformers GLM checkpoint in `dst`.

    rope_ratio_meaning: 'base' or 'positions', needed only for a folder whose modeling file does not
    say. dtype: of the written weights (default: the source's). spelling: how messages name the
    rope_ratio_meaning option (the command line passes its flag). Raises ValueError, writing
    nothing, on anything that has no native equivalent, and FileExistsError when `dst` is a file or
    holds files."""
    from transformers import GlmForCausalLM

    if rope_ratio_meaning not in (None, *MEANINGS):
        raise ValueError(f"rope_ratio_meaning must be one of {MEANINGS}, got {rope_ratio_meaning!r}")
    dst = Path(dst)
    check_destination(dst)
    config, weights, meaning, meaning_from, folder = _load_source(src, rope_ratio_meaning, spelling)
    tensors = native_weights(weights, config)
    source_dtype = tensors["model.embed_tokens.weight"].dtype
    dtype = dtype or source_dtype
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    glm_config = native_config(config, meaning, dtype)
    with torch.device("meta"):
        model = GlmForCausalLM(glm_config)
    model.load_state_dict(tensors, strict=True, assign=True)

    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst, max_shard_size=max_shard_size)
    copied = []
    if folder is not None:
        for pattern in COPIED:
            for path in sorted(folder.glob(pattern)):
                shutil.copy2(path, dst / path.name)
                copied.append(path.name)
    return Conversion(
        dst=dst,
        rope_parameters=dict(glm_config.rope_parameters),
        rope_ratio=float(config.get("rope_ratio", 1)),
        rope_ratio_meaning=meaning,
        meaning_from=meaning_from,
        tensors=len(tensors),
        copied=copied,
    )


def check(args: argparse.Namespace) -> None:
    """The destination, and the source folder up to the meaning of its rope_ratio, before any
    weight is read."""
    check_destination(Path(args.dst))
    _folder_source(Path(args.src), args.rope_ratio_meaning, CLI_SPELLING)


def run(args: argparse.Namespace, plan: None = None) -> int:
    result = convert_chatglm(
        args.src,
        args.dst,
        rope_ratio_meaning=args.rope_ratio_meaning,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        max_shard_size=args.max_shard_size,
        spelling=CLI_SPELLING,
    )
    meaning = {"base": "multiplies the base", "positions": "divides positions", None: "is 1"}[result.rope_ratio_meaning]
    print(f"rope_ratio {result.rope_ratio:g} {meaning} (read from {result.meaning_from})")
    print(f"rope_parameters: {json.dumps(result.rope_parameters)}")
    print(f"wrote {result.tensors} tensors to {result.dst}; copied {', '.join(result.copied) or 'no tokenizer files'}")
    return 0
