"""What `rope-ext patch` tells the serving engines: for each engine, whether it serves the written
checkpoint as patched (rope_ext.serving), the command that serves it, the override JSON that gives
the same patch on the unmodified checkpoint, and the model card (README.md) that carries all of it
with the checkpoint's lineage.

The commands are those of the releases whose source was read (docs/serving.md, "Serving the
written checkpoint"): vLLM 0.34.0 (`vllm serve MODEL --max-model-len N --hf-overrides JSON`; a
length above the one vLLM derives from config.json needs VLLM_ALLOW_LONG_MAX_MODEL_LEN=1,
vllm/config/model.py `_get_and_verify_max_len`) and SGLang 0.5.23 (`python -m
sglang.launch_server --model-path MODEL --context-length N --json-model-override-args JSON`; a
length above its derived one needs SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1,
srt/configs/model_config.py `_derive_context_length`)."""

from __future__ import annotations

import json
import shlex

from rope_ext import serving
from rope_ext.patching import PatchInfo
from rope_ext.record import CONFIG_KEY

VLLM, SGLANG = "vLLM 0.30-0.34", "SGLang 0.5.23"
LONG_LENGTH_ENV = {VLLM: "VLLM_ALLOW_LONG_MAX_MODEL_LEN", SGLANG: "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"}
ROPE_FIELDS = ("rope_parameters", "max_position_embeddings", "head_dim")


def holder_of(config: dict) -> dict:
    """The part of a config.json dict that holds the patch record: the dict itself, or the
    sub-config a composite's patch wrote (its text config)."""
    if CONFIG_KEY in config:
        return config
    return next((value for value in config.values() if isinstance(value, dict) and CONFIG_KEY in value), config)


def serve_command(engine: str, model: str, length: int, env: bool, overrides: dict | None = None) -> str:
    """The shell command that serves `model` at `length` tokens in `engine`, with `overrides`."""
    prefix = f"{LONG_LENGTH_ENV[engine]}=1 " if env else ""
    if engine == VLLM:
        command = f"vllm serve {shlex.quote(model)} --max-model-len {length}"
        flag = "--hf-overrides"
    else:
        command = f"python -m sglang.launch_server --model-path {shlex.quote(model)} --context-length {length}"
        flag = "--json-model-override-args"
    if overrides is not None:
        command += f" {flag} {shlex.quote(json.dumps(overrides, separators=(',', ':')))}"
    return prefix + command


def overrides_of(changed: dict) -> dict:
    """The engines' override JSON: what the patch changed in config.json, without rope-ext's record,
    which no engine reads."""
    out = {}
    for key, value in changed.items():
        if key == CONFIG_KEY:
            continue
        if isinstance(value, dict) and CONFIG_KEY in value:
            value = {k: v for k, v in value.items() if k != CONFIG_KEY}
        out[key] = value
    return out


def rope_fields(config: dict) -> dict:
    return {key: config[key] for key in ROPE_FIELDS if key in config}


def engines(twin, original, out: str, source: str) -> dict:
    """engine -> {verdict, serve, env, overrides, overrides_exact, overrides_verdict, overrides_serve}
    for the patched `twin` (rope_ext.export.twin.Twin) of the checkpoint whose transformers config is
    `original`, written to `out` from `source` (a folder or a hub id)."""
    info: PatchInfo = twin.info
    native = info.native is not None
    written = holder_of(twin.config)
    applied, rotary = info.patch, twin.rotary
    overrides = overrides_of(twin.changed)
    found = {}
    for engine in (VLLM, SGLANG):
        verdict = serving.verdict(engine, written, applied, rotary, native)
        entry = {"verdict": verdict, "serve": None, "overrides": None}
        if verdict == "as patched":
            served = serving.serve(engine, written)
            env = info.max_length > served.max_length
            entry["serve"] = serve_command(engine, out, info.max_length, env)
            overridden = holder_of(json.loads(serving.OVERRIDDEN[engine](original, overrides).to_json_string(use_diff=False)))
            overridden.pop(CONFIG_KEY, None)
            by_override = serving.verdict(engine, overridden, applied, rotary, native)
            if by_override == "as patched":
                kept = sorted(set(overridden.get("rope_parameters", {})) - set(written.get("rope_parameters", {})))
                entry["overrides"] = overrides
                entry["overrides_kept_keys"] = kept  # SGLang merges rope_parameters over the loaded ones
                entry["overrides_serve"] = serve_command(engine, source, info.max_length, env, overrides)
            else:
                entry["overrides_verdict"] = by_override
        found[engine] = entry
    return found


def rope_ext_load(out: str) -> str:
    return f'python -c "import rope_ext; model = rope_ext.from_pretrained({out!r})"'


def summary(info: PatchInfo) -> dict:
    base = info.starts_from
    return {
        "method": info.method,
        "factor": info.factor,
        "params": info.params,
        "base": base["scaling"] or "the trained frequencies",
        "window": info.original_window,
        "window_source": base["source"],
        "max_length": info.max_length,
        "native_rope_type": None if info.native is None else info.native.get("rope_type"),
    }


def model_card(base_model: str, info: PatchInfo, verdicts: dict, found: dict, out: str, notes: list[str]) -> str:
    """OUT/README.md: front matter with the lineage, then the patch, what each reader serves and
    the commands."""
    facts = summary(info)
    lines = [
        "---",
        f"base_model: {base_model}",
        "tags:",
        "- rope-ext",
        "- context-extension",
        f"- {info.method}",
        "---",
        "",
        f"# {base_model}, {info.method} x{info.factor:g} (rope-ext)",
        "",
        f"Written by `rope-ext patch` from {base_model}: its config with the `{info.method}` patch, the weights unchanged.",
        "",
        "| method | factor | base | window | meant for | rope_type written |",
        "|---|---|---|---|---|---|",
        (
            f"| {info.method} | {info.factor:g} | {facts['base']} | {info.original_window} ({facts['window_source']}) | "
            f"{info.max_length} | {facts['native_rope_type'] or '- (none: rope-ext record only)'} |"
        ),
        "",
        "## What each reader serves from config.json",
        "",
        "| reader | serves |",
        "|---|---|",
        *(f"| {reader} | {verdict} |" for reader, verdict in verdicts.items()),
        "",
        "## Commands",
        "",
        "```bash",
        *commands(found, out),
        "```",
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def commands(found: dict, out: str) -> list[str]:
    """The shell lines that serve the checkpoint: each engine that serves it as patched, its
    override form on the unmodified checkpoint, and rope-ext's own load."""
    lines = []
    for engine, entry in found.items():
        if entry["serve"] is None:
            lines.append(f"# {engine}: {entry['verdict']}")
            continue
        lines.append(f"# {engine}, this folder:")
        lines.append(entry["serve"])
        if entry["overrides"] is not None:
            kept = entry["overrides_kept_keys"]
            also = f" (it keeps the shipped rope keys {', '.join(kept)}, which the written type does not read)" if kept else ""
            lines.append(f"# {engine}, the same patch on the unmodified checkpoint{also}:")
            lines.append(entry["overrides_serve"])
    lines.append("# rope-ext (every method; transformers >= 5.24):")
    lines.append(rope_ext_load(out))
    return lines
