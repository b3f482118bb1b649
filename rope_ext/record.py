"""The patch as one value, and the records rope-ext writes of it, with the only code that reads
them back:

- `Patch`: the method with the factor and parameters it resolved on a model, and the model's
  values from before it. `rope_ext.describe`, `rope_ext.PatchInfo` and both records are built
  from it, and both records are read back as one;
- `config.rope_ext` (saved in config.json with the model): which method, factor and parameters
  the model is patched with, and the config values from before the patch, so that a reload
  reproduces the patch and an unpatch restores the original;
- `rope_ext_finetune.json` in a LoRA fine-tune folder: the base checkpoint the adapter belongs
  to and the patch it was trained under.

It also writes the patch in the config's own terms, for what loads a checkpoint without
rope-ext (transformers, vLLM, SGLang; docs/serving.md): `write_native` updates the model's
`rope_parameters` with a method's native form (the scaling keys replaced, every other key kept,
a nested per-layer-type dict written in one layer type's entry), adds the names serving engines
read where transformers' differ, sets `max_position_embeddings` so that no engine accepts more
positions than the patch is meant for, and writes `head_dim` where transformers needs it to build
the scaled frequencies; `config_values` are the values it may change, which `restore` puts back.

Both are versioned. A record that is missing a key, has a value of the wrong type, names an
unknown method or another version is refused with one ValueError that names the file and the key.
Records written by an earlier rope-ext are read here in today's terms (`migrated`), or refused
with the reason where they recorded something a method no longer computes.
"""

from __future__ import annotations

import ast
import copy
import json
import logging
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .geometry import RotaryGeometry
from .method import REGISTRY, check
from .method.base import SCHEDULE_PARAMS, Method
from .method.rope import yarn_mscale
from .names import RETIRED
from .shipped import QUERY_SCALE_KEY, WINDOW_KEYED

CONFIG_KEY = "rope_ext"
CONFIG_VERSION = 1
FINETUNE_FILE = "rope_ext_finetune.json"
FINETUNE_VERSION = 1

# rope_parameters keys that state a RoPE scaling, as transformers' rope types and the serving
# engines read them. A native form replaces them; every other key (partial_rotary_factor,
# original_max_position_embeddings, keys a model reads itself, such as ministral3's
# llama_4_scaling_beta or phimoe's long_mscale, keys no one knows) is the model's and stays.
SCALING_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "factor",
        "attention_factor",
        "attn_factor",
        "extrapolation_factor",
        "apply_yarn_scaling",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "low_freq_factor",
        "high_freq_factor",
        "short_factor",
        "long_factor",
        "alpha",
        "mixed_b",
        "max_trained_positions",
    }
)

# The causal schedule as records written before the attention-side methods had a base of their own
# held it for every one of them, whether it applied or not.
RECORDED_SCHEDULE = {"causal": True, "granularity": 1}
# Why a method's record cannot be re-applied, for records that lack what it records since it
# computes something else: {method: (the parameter a current record holds, the reason)}.
STALE = {
    "dca": (
        "temperature",
        "dca was recorded by a rope-ext that clamped the successive- and inter-chunk query positions at "
        "chunk_size - 1 (the paper's figure); dca now computes the released code's maps (min(i mod s + s, c), "
        "min(2s - 1, c)) and Qwen's temperature, which would change this checkpoint's logits: patch the base "
        "model again with dca (docs/dca.md)",
    )
}

# the rope type whose max_position_embeddings transformers reads as the trained window (a factor
# of its math), not as a length: `dynamic`
WINDOW_AS_INPUT = "dynamic"


@dataclass(frozen=True)
class Patch:
    """One patch. `original` holds the model's values from before it: the family's config values,
    what unpatch restores and the geometry is read from (`original_window` among them), or the
    window alone for a patch read from a fine-tune record, which keeps no more. `geometry` is the
    family's reading of them on a model; None for a patch read from a record, until a model is
    patched with it. `layer_types`, of a model whose rotary frequencies are kept per layer type:
    the types the patch replaces ("patched") and keeps ("kept"); None for one set of frequencies
    or a patch read from a record, which re-derives them on the model. `source` names the file a
    record was read from, for its errors; it is no part of the patch, so equality leaves it out."""

    method: str
    factor: float
    params: dict
    original: dict
    geometry: RotaryGeometry | None = None
    layer_types: dict | None = None
    source: str | None = field(default=None, compare=False)

    @property
    def original_window(self) -> int:
        """The trained window the factor multiplies."""
        if self.geometry is not None:
            return self.geometry.original_window
        return self.original.get("original_window", self.original.get("max_position_embeddings"))

    @property
    def max_length(self) -> int:
        """The length the patched model is meant for: the window times the factor, or for the
        checkpoint's own scaling re-applied, what the checkpoint serves (Llama 3.1's llama3 x8 over
        8192 tokens serves 131072)."""
        length = math.ceil(self.original_window * self.factor)
        shipped = self.original.get("rope_parameters")
        if (
            isinstance(shipped, dict)
            and shipped.get("rope_type") == self.method
            and shipped.get("factor") == self.factor
            and shipped.get("original_max_position_embeddings") == self.original_window
        ):
            return max(length, self.original["max_position_embeddings"])
        return length

    def original_values(self, *keys: str, layer_type: str | None = None) -> dict:
        """A copy of `original`, after checking that it holds `keys` as a config holds them:
        `rope_parameters` an object (nested per layer type: with an object for `layer_type`) whose
        rope_theta is a positive number, `max_position_embeddings` a positive int."""
        prefix = f"{self.source}: key {CONFIG_KEY}.original"
        for key in keys:
            if key not in self.original:
                raise ValueError(f"{prefix}.{key} is missing")
        if "rope_parameters" in keys:
            rope = _field(self.original, "rope_parameters", dict, self.source, f"{CONFIG_KEY}.original")
            name = "rope_parameters"
            if layer_type is not None:
                rope, name = (
                    _field(rope, layer_type, dict, self.source, f"{CONFIG_KEY}.original.rope_parameters"),
                    f"{name}.{layer_type}",
                )
            if "rope_theta" not in rope:
                raise ValueError(f"{prefix}.{name}.rope_theta is missing")
            if not _positive(rope["rope_theta"], (int, float)):
                raise ValueError(f"{prefix}.{name}.rope_theta must be a positive number, got {rope['rope_theta']!r}")
        if "max_position_embeddings" in keys and not _positive(self.original["max_position_embeddings"], int):
            raise ValueError(
                f"{prefix}.max_position_embeddings must be a positive int, got {self.original['max_position_embeddings']!r}"
            )
        return copy.deepcopy(self.original)

    def described(self) -> dict:
        """What `rope_ext.describe` answers for a model carrying this patch (`layer_types` where
        the model keeps frequencies per layer type)."""
        described = {
            "method": self.method,
            "factor": self.factor,
            "params": dict(self.params),
            "geometry": self.geometry.to_dict(),
            "max_length": self.max_length,
        }
        if self.layer_types is not None:
            described["layer_types"] = copy.deepcopy(self.layer_types)
        return described


def config_values(config) -> dict:
    """The config values `write_native` may change, as they are: what `restore` puts back.
    `head_dim` is among them where the config states it as None (Mixtral), since a native form
    then writes it."""
    values = {
        "rope_parameters": copy.deepcopy(config.rope_parameters),
        "max_position_embeddings": config.max_position_embeddings,
    }
    if hasattr(config, "head_dim") and config.head_dim is None:
        values["head_dim"] = None
    return values


def rope_parameters(original: dict, native: dict, layer_type: str | None = None) -> dict:
    """`original` (a model's rope_parameters) with its scaling replaced by `native`, in the entry
    of `layer_type` when the parameters are nested by layer type (gemma3's full_attention and
    sliding_attention), the other entries as they are; `original` itself is left unchanged."""
    rope = copy.deepcopy(original)
    # an entry may be None: a layer type without RoPE
    nested = any(isinstance(value, dict) for value in rope.values()) and all(
        isinstance(value, dict) or value is None for value in rope.values()
    )
    if nested != (layer_type is not None):
        raise ValueError(
            f"rope_parameters {'are' if nested else 'are not'} nested per layer type ({sorted(rope)}); "
            f"got layer_type={layer_type!r}"
        )
    if nested and layer_type not in rope:
        raise ValueError(f"rope_parameters have no entry for layer type {layer_type!r}: {sorted(rope)}")
    target = rope[layer_type] if nested else rope
    for key in SCALING_KEYS - native.keys():
        target.pop(key, None)
    if native.get("rope_type") not in WINDOW_KEYED and QUERY_SCALE_KEY not in target:
        # a pretraining window the written type does not read: transformers logs it as an unknown
        # key at every load and SGLang caps the context at it (ministral3 reads it for its query scale)
        target.pop("original_max_position_embeddings", None)
    target.update(copy.deepcopy(native))
    return rope


# Keys a written rope type needs that transformers' validation of that type (5.25,
# modeling_rope_utils `_validate_*_rope_parameters`) does not list, so that it logs "Unrecognized
# keys" at every load of the config: the engines' temperature for longrope (vLLM and SGLang read
# short_mscale/long_mscale, not attention_factor) and for yarn (SGLang and vLLM <= 0.29 read
# attn_factor), and proportional's factor, which transformers' own `_compute_proportional_parameters`
# reads. No key of either reader expresses the same value, so they stay (docs/serving.md).
UNLISTED_KEYS = {"longrope": {"short_mscale", "long_mscale"}, "yarn": {"attn_factor"}, "proportional": {"factor"}}
_UNRECOGNIZED = re.compile(r"Unrecognized keys in `rope_parameters` for 'rope_type'='(\w+)': (\{.*\})$")


class _UnlistedKeys(logging.Filter):
    """Drops transformers' "Unrecognized keys" record where every key it names is one of UNLISTED_KEYS."""

    def filter(self, entry: logging.LogRecord) -> bool:
        found = _UNRECOGNIZED.match(entry.getMessage())
        return found is None or not ast.literal_eval(found[2]) <= UNLISTED_KEYS.get(found[1], set())


@contextmanager
def unlisted_keys_quiet():
    """Within it, transformers does not log the UNLISTED_KEYS of a config rope-ext wrote, which it
    reads as written (every other warning it logs stays)."""
    logger, quiet = logging.getLogger("transformers.modeling_rope_utils"), _UnlistedKeys()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def served_parameters(native: dict) -> dict:
    """`native` with the names the serving engines read where transformers' differ: for a yarn
    temperature, transformers and vLLM >= 0.30 read `attention_factor`, SGLang and vLLM <= 0.29
    multiply 0.1 ln(s) + 1 by `attn_factor` (transformers ignores that key: UNLISTED_KEYS)."""
    if native.get("rope_type") != "yarn" or native.get("attention_factor") is None:
        return dict(native)
    return {**native, "attn_factor": native["attention_factor"] / yarn_mscale(native["factor"])}


def served_window(rope: dict, max_length: int) -> int:
    """The max_position_embeddings under `rope` (flat) for a patch meant for `max_length`
    positions: the length itself, what transformers, lm-eval's `hf` model and every reader of the
    field take as the longest input. Only transformers' `dynamic` reads it as the trained window, a
    term of its frequencies: there, the largest window its factor does not take past max_length.
    (vLLM and SGLang multiply it by the factor of `linear` and `proportional`: they accept more
    tokens than the patch is meant for, docs/serving.md.)"""
    if rope.get("rope_type") == WINDOW_AS_INPUT:
        return math.floor(max_length / rope["factor"])
    return max_length


def write_native(config, native: dict | None, original: dict, max_length: int, layer_type: str | None = None) -> None:
    """Write the patch in the config's own terms: `native` (a method's transformers
    rope_parameters, None where it has none) over the model's `original` values
    (`config_values`), for a patch meant for `max_length` positions. Without a native form the
    config is the model's own: a plain load is the unpatched model, claiming no more than its
    window."""
    if native is None:
        restore(config, original)
        return
    served = served_parameters(native)
    config.rope_parameters = rope_parameters(original["rope_parameters"], served, layer_type)
    config.max_position_embeddings = served_window(served, max_length)
    if "head_dim" in original:
        # transformers' dynamic and yarn frequencies read config.head_dim without falling back
        config.head_dim = config.hidden_size // config.num_attention_heads


def restore(config, original: dict) -> None:
    """Put back the config values `config_values` read (a patch's `original`)."""
    for key in config_keys(original):
        setattr(config, key, copy.deepcopy(original[key]))


def config_keys(original: dict) -> list[str]:
    """The keys of a patch's `original` that are config fields (the others say where its window
    comes from)."""
    return [key for key in original if key not in ("original_window", "starts_from")]


_ABSENT = object()


def check_stated(config, written: dict, saved: Patch) -> None:
    """ValueError naming the file and the key where `config`, loaded from a checkpoint that records
    the patch `saved`, does not state what that patch writes from the record's original values
    (`written`, the adapter's `config_written`): config.json or the record was edited after the
    save, and neither reading can be trusted."""
    for key, value in written.items():
        found = _difference(getattr(config, key, _ABSENT), value, key)
        if found is not None:
            name, stated, recorded = found
            stated, recorded = ("absent" if v is _ABSENT else repr(v) for v in (stated, recorded))
            raise ValueError(
                f"{saved.source}: key {name} is {stated}, but the patch its {CONFIG_KEY} record holds "
                f"({saved.method} x{saved.factor:g} over the values in {CONFIG_KEY}.original) writes {recorded}: "
                "config.json or its record was edited after the save (or a rope-ext that wrote this key otherwise saved it). "
                "Put the key back as the save wrote it, or load the checkpoint with transformers alone, which reads "
                "config.json and not the record"
            )


def _difference(stated, recorded, key: str):
    """(dotted key, stated, recorded) of the first value where two config values differ, or None."""
    if isinstance(stated, dict) and isinstance(recorded, dict):
        for inner in dict.fromkeys([*stated, *recorded]):
            found = _difference(stated.get(inner, _ABSENT), recorded.get(inner, _ABSENT), f"{key}.{inner}")
            if found is not None:
                return found
        return None
    return None if stated == recorded else (key, stated, recorded)


def config_source(config) -> str:
    name = getattr(config, "_name_or_path", None)
    return f"{Path(name) / 'config.json'}" if name else "the model's config"


def write(config, patch: Patch) -> None:
    setattr(
        config,
        CONFIG_KEY,
        {
            "version": CONFIG_VERSION,
            "method": patch.method,
            "factor": patch.factor,
            "params": patch.params,
            "original": patch.original,
        },
    )


def erase(config) -> None:
    delattr(config, CONFIG_KEY)


def holder(config):
    """The config that holds a patch record: `config`, or the sub-config a patch of a composite
    model wrote it in (its text config, the one the rotary module is built from); `config` when
    none holds one."""
    for name in getattr(config, "sub_configs", None) or {}:
        if getattr(getattr(config, name, None), CONFIG_KEY, None):
            return getattr(config, name)
    return config


def read(config, source: str | None = None) -> Patch | None:
    """The patch recorded in `config`, or None when there is none."""
    saved = getattr(config, CONFIG_KEY, None)
    if not saved:
        return None
    source = source or config_source(config)
    if not isinstance(saved, dict):
        raise ValueError(f"{source}: key {CONFIG_KEY} must be an object, got {type(saved).__name__}")
    version = saved.get("version")
    if version != CONFIG_VERSION:
        raise ValueError(f"{source}: rope_ext config format {version!r} is not supported (expected {CONFIG_VERSION})")
    method = _field(saved, "method", str, source)
    if method in RETIRED:
        raise ValueError(f"{source}: key {CONFIG_KEY}.method: {RETIRED[method]}")
    if method not in REGISTRY:
        raise ValueError(
            f"{source}: key {CONFIG_KEY}.method names unknown method {method!r}; valid methods: {', '.join(REGISTRY)}"
        )
    factor = _field(saved, "factor", (int, float), source)
    try:
        factor = REGISTRY[method].accept_factor(factor)  # > 1, or 1 for a method meant for the trained window too
    except ValueError:
        raise ValueError(f"{source}: key {CONFIG_KEY}.factor must be a finite number > 1, got {factor!r}") from None
    original = _field(saved, "original", dict, source)
    params = dict(_field(saved, "params", dict, source))
    if method in STALE and STALE[method][0] not in params:
        raise ValueError(f"{source}: key {CONFIG_KEY}.params: {STALE[method][1]}")
    try:
        params = migrated(REGISTRY[method], params)
        check(method, factor, params)
    except ValueError as err:
        raise ValueError(f"{source}: key {CONFIG_KEY}.params: {err}") from None
    patch = Patch(method, float(factor), params, original, source=source)
    window = patch.original_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{source}: key {CONFIG_KEY}.original.original_window must be a positive int, got {window!r}")
    return patch


def migrated(method: Method, params: dict) -> dict:
    """A record's `params` for `method` in today's terms: without the causal schedule
    (RECORDED_SCHEDULE) where the method keeps keys before rotation at positions that do not
    follow the length, which such records hold at their defaults; ValueError, with the reason,
    for any other value."""
    if not method.dynamic or method.follows_length:
        return params
    fixed = {k: params[k] for k in SCHEDULE_PARAMS if k not in method.schedule and k in params}
    if any(fixed[k] != RECORDED_SCHEDULE[k] or type(fixed[k]) is not type(RECORDED_SCHEDULE[k]) for k in fixed):
        if method.schedule:
            raise ValueError(
                f"{method.name}: granularity does not apply (a query switches to {method.switches} once it has seen more "
                f"than the trained window); got {fixed['granularity']!r}"
            )
        shown = {**RECORDED_SCHEDULE, **fixed}
        raise ValueError(
            f"{method.name}: causal and granularity do not apply (every query's positions follow from its own "
            f"position); got causal={shown['causal']!r}, granularity={shown['granularity']!r}"
        )
    return {k: v for k, v in params.items() if k not in fixed}


def _positive(value, kind) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _field(record: dict, key: str, kind, source: str, prefix: str = CONFIG_KEY):
    name = f"{prefix}.{key}" if prefix else key
    if key not in record:
        raise ValueError(f"{source}: key {name} is missing")
    value = record[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"{source}: key {name} must be {names}, got {value!r}")
    return value


def write_finetune(out_dir, base_model: str, patch: Patch, extra: dict | None = None) -> Path:
    """Write rope_ext_finetune.json into `out_dir` for a model carrying `patch`. `base_model` is
    what `rope_ext.defaults.resolve_checkpoint` turns back into a loadable checkpoint: "smollm2",
    an absolute local path, or a hub id."""
    record = {
        "version": FINETUNE_VERSION,
        "base_model": base_model,
        "patch": {
            "method": patch.method,
            "factor": patch.factor,
            "params": patch.params,
            "original_window": patch.original_window,
        },
        "max_length": patch.max_length,
        **(extra or {}),
    }
    path = Path(out_dir) / FINETUNE_FILE
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_finetune(path) -> tuple[str, Patch]:
    """(base model, patch) of the rope_ext_finetune.json of fine-tune folder `path`, checked."""
    path = Path(path)
    record_path = path / FINETUNE_FILE
    if not record_path.is_file():
        hint = " (a merged model: use rope_ext.from_pretrained)" if (path / "config.json").is_file() else ""
        raise FileNotFoundError(f"{path} holds no {FINETUNE_FILE}: not a rope-ext LoRA fine-tune folder{hint}")
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{record_path}: not valid JSON ({err})") from None
    if not isinstance(record, dict) or record.get("version") != FINETUNE_VERSION:
        version = record.get("version") if isinstance(record, dict) else None
        raise ValueError(f"{record_path}: format version {version!r} is not supported (expected {FINETUNE_VERSION})")
    source = str(record_path)
    base_model = _field(record, "base_model", str, source, "")
    saved = _field(record, "patch", dict, source, "")
    method = _field(saved, "method", str, source, "patch")
    factor = float(_field(saved, "factor", (int, float), source, "patch"))
    params = _field(saved, "params", dict, source, "patch")
    if method in REGISTRY:  # another name is refused by the patch it names
        try:
            params = migrated(REGISTRY[method], params)
        except ValueError as err:
            raise ValueError(f"{source}: key patch.params: {err}") from None
    return base_model, Patch(
        method,
        factor,
        params,
        {"original_window": _field(saved, "original_window", int, source, "patch")},
        source=source,
    )
