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

Both are versioned. A record that is missing a key, has a value of the wrong type, names an
unknown method or another version is refused with one ValueError that names the file and the key.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .geometry import RotaryGeometry
from .method import REGISTRY

CONFIG_KEY = "rope_ext"
CONFIG_VERSION = 1
FINETUNE_FILE = "rope_ext_finetune.json"
FINETUNE_VERSION = 1


@dataclass(frozen=True)
class Patch:
    """One patch. `original` holds the model's values from before it: the family's config values,
    what unpatch restores and the geometry is read from (`original_window` among them), or the
    window alone for a patch read from a fine-tune record, which keeps no more. `geometry` is the
    family's reading of them on a model; None for a patch read from a record, until a model is
    patched with it. `source` names the file a record was read from, for its errors; it is no
    part of the patch, so equality leaves it out."""

    method: str
    factor: float
    params: dict
    original: dict
    geometry: RotaryGeometry | None = None
    source: str | None = field(default=None, compare=False)

    @property
    def original_window(self) -> int:
        """The trained window the factor multiplies."""
        if self.geometry is not None:
            return self.geometry.original_window
        return self.original.get("original_window", self.original.get("max_position_embeddings"))

    @property
    def max_length(self) -> int:
        """The length the patched model is meant for."""
        return math.ceil(self.original_window * self.factor)

    def original_values(self, *keys: str) -> dict:
        """A copy of `original`, after checking that it holds `keys`."""
        for key in keys:
            if key not in self.original:
                raise ValueError(f"{self.source}: key {CONFIG_KEY}.original.{key} is missing")
        return copy.deepcopy(self.original)

    def described(self) -> dict:
        """What `rope_ext.describe` answers for a model carrying this patch."""
        return {
            "method": self.method,
            "factor": self.factor,
            "params": dict(self.params),
            "geometry": self.geometry.to_dict(),
            "max_length": self.max_length,
        }


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
    patch = Patch(method, float(factor), dict(_field(saved, "params", dict, source)), original, source=source)
    window = patch.original_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{source}: key {CONFIG_KEY}.original.original_window must be a positive int, got {window!r}")
    return patch


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
    return base_model, Patch(
        _field(saved, "method", str, source, "patch"),
        float(_field(saved, "factor", (int, float), source, "patch")),
        _field(saved, "params", dict, source, "patch"),
        {"original_window": _field(saved, "original_window", int, source, "patch")},
        source=source,
    )
