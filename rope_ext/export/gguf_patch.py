"""`rope-ext patch MODEL.gguf OUT.gguf --method M --factor F`: a GGUF file patched for llama.cpp.
The patch is computed by rope-ext on a twin of the model (one layer, the file's rotary geometry and
shipped scaling), written as llama.cpp's rope metadata and, where its own types do not express the
frequencies, the `rope_freqs` tensor (rope_ext.export.gguf_rope, restated from llama.cpp's source); every
other tensor is copied byte for byte. Before anything is written, the frequencies and attention
factor llama.cpp computes from the new metadata are checked against the patch's."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rope_ext import method as registry
from rope_ext import serving
from rope_ext.export import gguf_rope
from rope_ext.loading import apply_method, parse_params
from rope_ext.extras import require
from rope_ext.method.base import as_size
from rope_ext.patching import installed_rotary

FEATURE = "rope-ext patch of a GGUF file"


@dataclass(frozen=True)
class Plan:
    """What the command writes: the metadata under {arch}., the rope_freqs values (None: none), and
    the patch's description."""

    arch: str
    metadata: dict
    freqs: np.ndarray | None
    info: object  # the twin's PatchInfo


def refusal(method) -> str | None:
    """Why llama.cpp cannot run `method` (a registered Method), or None."""
    if method.needs_attention_interface:
        return (
            f"{method.name} changes attention itself; llama.cpp computes attention from q and k rotated by "
            "ggml_rope_ext alone (src/models/llama.cpp), so only a method that sets the frequencies can be written"
        )
    if method.follows_length and not method.window_step:
        return (
            f"{method.name}'s frequencies follow the length read so far; llama.cpp computes one set for the "
            "whole context from the file's metadata"
        )
    return None


def check(args: argparse.Namespace) -> Plan:
    """Every argument, the file, the method on its twin and llama.cpp's reading of the result,
    before anything is written."""
    require("gguf", FEATURE)
    source, out = Path(args.model), Path(args.out)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new file")
    if out.suffix.lower() != ".gguf":
        raise ValueError(f"OUT must be a .gguf file for a GGUF model, got {out}")
    if not source.is_file():
        raise FileNotFoundError(f"no GGUF file at {source}")
    method, factor, params = registry.check(args.method, args.factor, parse_params(args.param))
    reason = refusal(method)
    if reason:
        raise ValueError(f"llama.cpp cannot run {args.method}: {reason}")
    if args.original_window is not None:
        as_size(args.original_window, "--original-window")
    return plan(source, args.method, factor, params, args.original_window, args.allow_shrink)


def read_file(source: Path):
    """(reader, {key: value} of every metadata field, the architecture)."""
    import gguf

    try:
        reader = gguf.GGUFReader(source)
    except ValueError as err:
        raise ValueError(f"{source} is not a GGUF file the gguf package reads: {err}") from None
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arch = fields.get("general.architecture")
    if arch not in gguf_rope.ARCHITECTURES:
        raise ValueError(
            f"{source} is a {arch!r} model; llama.cpp runs it with its own graph, which rope-ext has not read "
            f"(it writes the rope of the {', '.join(gguf_rope.ARCHITECTURES)} architecture)"
        )
    return reader, fields, arch


def file_rope(reader, fields: dict, arch: str) -> gguf_rope.LlamaCppRope:
    """The file's rope as llama.cpp reads it."""
    head = (
        fields.get(f"{arch}.attention.key_length") or fields[f"{arch}.embedding_length"] // fields[f"{arch}.attention.head_count"]
    )
    dims = int(fields.get(f"{arch}.rope.dimension_count", head))
    if dims != head:
        # src/models/llama.cpp: GGML_ASSERT(n_embd_head == n_rot)
        raise ValueError(f"the file rotates {dims} of {head} channels per head; llama.cpp's llama graph rotates all of them")
    tensors = {t.name: t for t in reader.tensors}
    freqs = np.array(tensors[gguf_rope.ROPE_FREQS].data, dtype=np.float32) if gguf_rope.ROPE_FREQS in tensors else None
    return gguf_rope.read(fields, arch, freqs, dims)


def twin(rope: gguf_rope.LlamaCppRope):
    """A one-layer LLaMA with the file's rotary geometry and shipped scaling, in fp32: what rope-ext
    patches in place of the file's weights, which the frequencies do not depend on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=rope.dims,
        max_position_embeddings=rope.context,
        rope_parameters=gguf_rope.shipped_parameters(rope),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    rotary = model.model.rotary_emb
    read_freq, read_scale = rope.computed()
    if not torch.allclose(rotary.inv_freq, read_freq, rtol=1e-6, atol=0) or not math.isclose(
        rotary.attention_scaling, read_scale, rel_tol=1e-6
    ):
        raise ValueError(
            "transformers does not rotate this file's shipped scaling as llama.cpp does; rope-ext cannot start from it"
        )
    return model


def static_frequencies(model, info) -> tuple:
    """The patch's (inv_freq, attention factor), the same in every row of a forward of the window,
    one past it and the length it is meant for; a ValueError where they differ."""
    rotary = installed_rotary(model)
    first = serving.patched_at(rotary, 0, 1)
    for length in (info.original_window, info.original_window + 1, info.max_length):
        for row in (0, length - 1):
            inv_freq, attention = serving.patched_at(rotary, row, length)
            if not torch.equal(inv_freq.cpu(), first[0].cpu()) or attention != first[1]:
                raise ValueError(
                    f"llama.cpp cannot run this {info.method} patch: its frequencies differ between positions "
                    f"(row {row} of {length} tokens); llama.cpp computes one set for the whole context"
                    + (" (longrope: give short_factor equal to long_factor)" if info.method == "longrope" else "")
                )
    return first[0].detach().cpu(), float(first[1])


def plan(source: Path, method: str, factor: float | None, params: dict, original_window: int | None, allow_shrink: bool) -> Plan:
    """The patch computed on the file's twin and expressed for llama.cpp, checked by llama.cpp's
    reading of the metadata it writes."""
    reader, fields, arch = read_file(source)
    rope = file_rope(reader, fields, arch)
    model = twin(rope)
    if original_window is None and gguf_rope.shipped_parameters(rope)["rope_type"] == "default":
        # the trained context the file states ({arch}.context_length, llama.cpp's n_ctx_train)
        original_window = rope.context
    info = apply_method(model, method, factor, params, original_window, allow_shrink)
    inv_freq, attention = static_frequencies(model, info)
    metadata, freqs = gguf_rope.expressed(
        info.native, inv_freq, attention, rope.base, rope.dims, info.original_window, info.max_length
    )
    written = gguf_rope.read({f"{arch}.{k}": v for k, v in metadata.items()}, arch, freqs, rope.dims)
    computed, scale = written.computed()
    if not torch.allclose(computed, inv_freq, rtol=1e-6, atol=0) or not math.isclose(scale, attention, rel_tol=1e-6):
        raise ValueError(f"the metadata rope-ext would write does not give llama.cpp this {method} patch; nothing written")
    return Plan(arch, metadata, freqs, info)


def value_type(value):
    import gguf

    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.FLOAT32


def write(source: Path, out: Path, plan: Plan) -> int:
    """OUT: the source's metadata with the rope keys of `plan`, its tensors byte for byte (its
    rope_freqs replaced or dropped), written to a partial file renamed once complete. Returns the
    number of tensors copied."""
    import gguf

    reader = gguf.GGUFReader(source)
    replaced = {f"{plan.arch}.{key}" for key in plan.metadata}
    prefixes = tuple(f"{plan.arch}.{p}" for p in gguf_rope.REPLACED_PREFIXES)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, plan.arch, endianess=reader.endianess)
    writer.data_alignment = reader.alignment
    try:
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
                continue  # written by GGUFWriter itself
            if field.name in replaced or field.name.startswith(prefixes):
                continue
            kind = field.types[0]
            sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
        for key, value in plan.metadata.items():
            writer.add_key_value(f"{plan.arch}.{key}", value, value_type(value))
        tensors = [t for t in reader.tensors if t.name != gguf_rope.ROPE_FREQS]
        for t in tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        if plan.freqs is not None:
            freqs = plan.freqs
            writer.add_tensor_info(gguf_rope.ROPE_FREQS, freqs.shape, freqs.dtype, freqs.nbytes, gguf.GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        if plan.freqs is not None:
            writer.write_tensor_data(plan.freqs)
        writer.close()
        partial.rename(out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return len(tensors)


def run(args: argparse.Namespace, plan: Plan) -> int:
    out = Path(args.out)
    copied = write(Path(args.model), out, plan)
    info = plan.info
    base = info.starts_from
    scaling = f"its shipped {base['scaling']} scaling" if base["scaling"] else "the trained frequencies"
    keys = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in plan.metadata.items())
    print(
        f"{info.method} x{info.factor:g}: {scaling} over a {info.original_window}-token window, meant for {info.max_length} tokens"
    )
    print(f"wrote {out}: {plan.arch}.{{{keys}}}")
    tensor = f"a {gguf_rope.ROPE_FREQS} tensor of {len(plan.freqs)} per-pair factors and " if plan.freqs is not None else ""
    print(f"with {tensor}{copied} tensors copied byte for byte")
    print(f"llama.cpp computes the patch's frequencies and attention factor from it ({gguf_rope.LLAMA_CPP})")
    print(f"run: llama-cli -m {out} -c {info.max_length}   or   llama_cpp.Llama('{out}', n_ctx={info.max_length})")
    return 0
