"""A patch of a checkpoint's config without its weights (docs/shipped.md, "Writing the checkpoint").

`patch()` proves a model by running it (rope_ext.patches.probe): where the rotation is applied,
which layers rotate, with which channels, whether attention is plain causal softmax. None of that
depends on the model's width or depth, nor on its weights, so it is proved on a *twin*: the model
transformers builds from the checkpoint's own config with the same rotary geometry (head size,
rope parameters, partial rotation), the same attention (heads, key heads, sliding windows, layer
types) and the same family, but two or a few layers, a vocabulary of 128 and small MLPs and
projections, with random weights. `patch_config` patches the twin with `rope_ext.patch`, so that
every refusal and the probe apply, and writes what the patch changed in the twin's config into the
checkpoint's own config.json, every other field as shipped.

What the twin keeps and what it shrinks:

- layers: the shortest prefix of the layers in which every per-layer list of the config (layer
  types, NoPE layers, MLP kinds, ...) shows each of its values, at least two; a layer keeps its
  index, so rules by index (every n-th layer) read the same;
- heads and key heads as shipped (a method checks head indices against them); the hidden size
  shrinks where the config states the head size apart from it (`head_dim`), else it stays, since
  the head size is hidden_size / heads there;
- every `*intermediate_size`, the expert counts, MLA's low ranks and the vocabulary shrink; token
  ids outside the twin's vocabulary are dropped from its config.

A twin whose head size or rotated width is not the checkpoint's is not its twin: that is checked
on the probe's findings after the patch, and a twin that would hold more than TWIN_PARAMETERS
parameters is not built (ValueError, with the way to patch the loaded model instead)."""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PreTrainedConfig

from rope_ext import record
from rope_ext.patching import PatchInfo, installed_rotary, patch
from rope_ext.saving import causal_lm_class_of

TWIN_VOCAB = 128
TWIN_HIDDEN = 64
TWIN_INTERMEDIATE = 32
TWIN_EXPERTS = 4
TWIN_RANK = 32  # MLA's q_lora_rank / kv_lora_rank: the rotated part of its heads is qk_rope_head_dim
MIN_LAYERS = 2
TWIN_PARAMETERS = 60_000_000  # about 240 MB in fp32: the twin must not grow with the checkpoint
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
RANKS = ("q_lora_rank", "kv_lora_rank")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# keys of a config.json that transformers 5 folds into rope_parameters on load: a config.json that
# states rope_parameters must not keep them beside, or a reader of the old keys (vLLM's
# patch_rope_parameters reads a top-level rope_theta) sees the shipped values
FOLDED_KEYS = ("rope_scaling", "rope_theta")


@dataclass
class Twin:
    """The patched twin (`model`, its config patched), what `patch` returned, the checkpoint's
    config.json with the patch written in (`config`), and what the patch changed in it (`changed`:
    keys and values, a composite's sub-config as a dict of its changed keys)."""

    model: nn.Module
    info: PatchInfo
    config: dict
    changed: dict

    @property
    def rotary(self):
        return installed_rotary(self.model)


def read_config(config_or_folder) -> tuple[dict, PreTrainedConfig]:
    """(config.json as a dict, the transformers config built from it) of a folder, a config.json
    path, a dict or a transformers config. A config whose model type transformers does not know
    (remote code) is refused: rope-ext never turns trust_remote_code on."""
    if isinstance(config_or_folder, PreTrainedConfig):
        written = json.loads(config_or_folder.to_json_string(use_diff=False))
    elif isinstance(config_or_folder, dict):
        written = copy.deepcopy(config_or_folder)
    else:
        path = Path(config_or_folder)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: a checkpoint folder holds a config.json")
        try:
            written = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err})") from None
    model_type = written.get("model_type")
    if model_type not in CONFIG_MAPPING:
        remote = " (its auto_map names remote code, which rope-ext never runs)" if "auto_map" in written else ""
        raise ValueError(
            f"config.json's model_type {model_type!r} is not a transformers model type{remote}: no twin can be built "
            "from it (a remote-code ChatGLM converts to native GLM with `rope-ext convert-chatglm`)"
        )
    with record.unlisted_keys_quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # a legacy `rope_scaling` key, read as transformers reads it
        config = CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(written))
    return written, config


def layer_prefix(config: dict) -> int:
    """The twin's layer count: the shortest prefix of the layers in which every per-layer list of
    `config` shows each of its values, at least MIN_LAYERS."""
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers <= MIN_LAYERS:
        return layers
    per_layer = [value for value in config.values() if isinstance(value, list) and len(value) == layers]
    needed = MIN_LAYERS
    for values in per_layer:
        keys = [json.dumps(v, sort_keys=True) for v in values]
        needed = max(needed, max(keys.index(key) for key in set(keys)) + 1)
    return needed


def shrunk(config: dict, keep_hidden: bool) -> dict:
    """One config's dict (a text config, or a sub-config of a composite) as the twin's."""
    twin = copy.deepcopy(config)
    layers, kept = config.get("num_hidden_layers"), layer_prefix(config)
    if isinstance(layers, int) and kept != layers:
        twin["num_hidden_layers"] = kept
        for key, value in config.items():
            if isinstance(value, list) and len(value) == layers:
                twin[key] = value[:kept]
    heads = config.get("num_attention_heads")
    if not keep_hidden and isinstance(config.get("head_dim"), int) and isinstance(config.get("hidden_size"), int):
        # a multiple of the heads, which some configs require of the hidden size
        twin["hidden_size"] = -(-TWIN_HIDDEN // heads) * heads if isinstance(heads, int) and heads > 0 else TWIN_HIDDEN
    for key, value in config.items():
        if isinstance(value, int) and not isinstance(value, bool) and key.endswith("intermediate_size"):
            twin[key] = min(value, TWIN_INTERMEDIATE)
    for key in EXPERT_COUNTS:
        if isinstance(config.get(key), int):
            twin[key] = min(config[key], TWIN_EXPERTS)
            twin["num_experts_per_tok"] = min(config.get("num_experts_per_tok") or 1, twin[key])
            for group in ("n_group", "topk_group"):
                if group in config:
                    twin[group] = 1
    for key in RANKS:
        if isinstance(config.get(key), int):
            twin[key] = min(config[key], TWIN_RANK)
    if isinstance(config.get("vocab_size"), int):
        twin["vocab_size"] = min(config["vocab_size"], TWIN_VOCAB)
        if isinstance(config.get("vocab_size_per_layer_input"), int):
            twin["vocab_size_per_layer_input"] = twin["vocab_size"]
        for key in TOKEN_IDS:
            given = config.get(key)
            ids = given if isinstance(given, list) else [given]
            if any(isinstance(i, int) and i >= twin["vocab_size"] for i in ids):
                twin[key] = None
    return twin


def twin_config(config: PreTrainedConfig, keep_hidden: bool = False) -> PreTrainedConfig:
    """The twin's transformers config: `config` with each of its configs shrunk (`shrunk`)."""
    given = config.to_dict()
    twin = shrunk(given, keep_hidden)
    for name in getattr(config, "sub_configs", None) or {}:
        if isinstance(given.get(name), dict):
            twin[name] = shrunk(given[name], keep_hidden)
    with record.unlisted_keys_quiet():
        return type(config).from_dict(twin)


def build_twin(config: PreTrainedConfig, keep_hidden: bool) -> nn.Module:
    """The twin model, random weights in the checkpoint's dtype, after checking its size on the
    meta device."""
    twin = twin_config(config, keep_hidden)
    cls = causal_lm_class_of(twin)
    build = cls.from_config if cls is AutoModelForCausalLM else cls._from_config
    with torch.device("meta"):
        size = sum(p.numel() for p in build(twin).parameters())
    if size > TWIN_PARAMETERS:
        raise ValueError(
            f"the small twin of this {config.model_type} config would hold {size / 1e6:.0f}M parameters (its head size "
            f"is hidden_size / heads, so its width stays), more than the {TWIN_PARAMETERS / 1e6:.0f}M rope-ext builds; "
            "patch the loaded model instead: rope_ext.patch(model, ...) then model.save_pretrained(out)"
        )
    dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.float32
    torch.manual_seed(0)
    return build(twin, dtype=dtype).eval()


def head_size(config: dict) -> int | None:
    """The head size the checkpoint states (head_dim, else hidden_size / heads)."""
    heads = config.get("num_attention_heads")
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"]
    if isinstance(config.get("hidden_size"), int) and isinstance(heads, int) and heads:
        return config["hidden_size"] // heads
    return None


def patch_twin(
    config_or_folder,
    method: str,
    factor: float | None = None,
    *,
    original_window: int | None = None,
    allow_shrink: bool = False,
    **params,
) -> Twin:
    """The checkpoint's twin patched with `method` (rope_ext.patch's arguments), and its config.json
    with the patch written in."""
    written, config = read_config(config_or_folder)
    holder_config = config.get_text_config()
    expected = head_size(holder_config.to_dict())
    last = None
    for keep_hidden in (False, True):
        try:
            model = build_twin(config, keep_hidden)
        except (ValueError, StrictDataclassError, TypeError, RuntimeError, AttributeError, IndexError, KeyError) as err:
            last = err  # a config transformers cannot build small (or too large a twin): try the full width
            continue
        before = json.loads(model.config.to_json_string(use_diff=False))
        info = patch(model, method, factor, original_window=original_window, allow_shrink=allow_shrink, **params)
        if expected is None or info.head_dim == expected:
            subs = set(getattr(model.config, "sub_configs", None) or {})
            changed = changes(before, json.loads(model.config.to_json_string(use_diff=False)), subs)
            return Twin(model, info, merged(written, changed, subs), changed)
        last = ValueError(f"the twin's heads are {info.head_dim} wide where the checkpoint's are {expected}")
    raise ValueError(f"no small twin of this {config.model_type} config could be built: {last}")


def changes(before: dict, after: dict, subs) -> dict:
    """What a patch changed in a config (its dicts `before` and `after`): each top-level key whose
    value changed, and of a sub-config in `subs` (a composite's text config) its changed keys."""
    found = {}
    for key, value in after.items():
        if key in subs and isinstance(value, dict) and isinstance(before.get(key), dict):
            inner = {k: copy.deepcopy(v) for k, v in value.items() if before[key].get(k) != v}
            if inner:
                found[key] = inner
        elif before.get(key) != value:
            found[key] = copy.deepcopy(value)
    return found


def merged(written: dict, changed: dict, subs) -> dict:
    """The checkpoint's config.json `written` with the `changed` keys (`changes`) written in, and no
    legacy rope key (FOLDED_KEYS) left beside a written rope_parameters."""
    out = copy.deepcopy(written)
    for key, value in changed.items():
        target, values = (out.setdefault(key, {}), value) if key in subs else (out, {key: value})
        target.update(copy.deepcopy(values))
        if "rope_parameters" in values:
            for folded in FOLDED_KEYS:
                target.pop(folded, None)
    return out


def patch_config(config_or_folder, method: str, factor: float | None = None, **patch_arguments) -> tuple[dict, PatchInfo]:
    """(config.json of the patched checkpoint, PatchInfo) for a checkpoint given by its folder, its
    config.json, a dict of it or a transformers config: what `rope_ext.patch` on the loaded model
    writes to config.json, found without the weights (on the checkpoint's small twin, module
    docstring). `patch_arguments` are patch_twin's (`original_window`, `allow_shrink` and the
    method's parameters). Every other field of the checkpoint's config.json stays as shipped. Raises
    ValueError, writing nothing, where `patch` would, or where no twin can be built."""
    twin = patch_twin(config_or_folder, method, factor, **patch_arguments)
    return twin.config, twin.info
