"""What a result file records of the model it measured: the positions the model is meant for, its
label, the model-and-method setup and a digest of its weights."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

from rope_ext.loading import PLAIN, patched


def capacity(model) -> tuple[int, str]:
    """(positions the model is meant for, a phrase saying why): a patch's max_length, else the
    config's max_position_embeddings."""
    applied = patched(model)
    if applied is not None:
        return applied.max_length, f"{applied.method} x{applied.factor:g} of its {applied.original_window}-token window"
    config = model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "seq_length", None)
    if limit is None:
        raise ValueError(f"{type(model).__name__}: the config states no max_position_embeddings")
    return int(limit), "unpatched"


def warn_beyond_capacity(model, positions: int, what: str) -> bool:
    """Warn when `positions` exceed what the model is meant for; True when it did."""
    limit, why = capacity(model)
    if positions <= limit:
        return False
    remedy = "patch it with a method and a factor" if patched(model) is None else "raise the factor"
    warnings.warn(
        f"{what} needs {positions} positions but the model ({why}) is meant for {limit}: "
        f"results past that point may break ({remedy})",
        stacklevel=2,
    )
    return True


def model_label(model) -> str:
    """A short name for tables and plots: the checkpoint folder's name or the hub id."""
    return name_label(getattr(model.config, "_name_or_path", None) or type(model).__name__)


def name_label(name: str) -> str:
    """model_label of a model loaded from `name`."""
    return Path(name).name if Path(name).is_absolute() else name


def describe_setup(model, info, method: str, params: dict, chunk_size: int | None = None) -> dict:
    """The model-and-method record every result file carries. With `method` None (the model as
    loaded), the patch the checkpoint came with, if any (`patch` then holds rope_ext.describe's
    record, with its original_window and "as_loaded": true)."""
    limit, why = capacity(model)
    patch = None if info is None else info.to_dict()
    factor = None if info is None else info.factor
    params = params if info is None else dict(info.params)
    if method is None:
        applied = patched(model)
        method = PLAIN if applied is None else applied.method
        if applied is not None:
            factor, params = applied.factor, dict(applied.params)
            patch = {**applied.described(), "original_window": applied.original_window, "as_loaded": True}
    return {
        "model": model_label(model),
        "method": method,
        "factor": factor,
        "params": params,
        "patch": patch,
        "capacity": limit,
        "capacity_note": why,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "chunk_size": chunk_size,
    }


def checkpoint_digest(model) -> str:
    """The first 16 hex digits of a sha256 over the model's config (without the path it was
    loaded from and the transformers version) and every parameter's name, dtype, shape and bytes:
    what tells two checkpoints apart when their folders share a name. The same checkpoint, dtype
    and patch give the same digest on any device."""
    import torch

    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version"):
        config.pop(volatile, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode("utf-8"))
    for name, parameter in model.named_parameters():
        digest.update(f"{name}:{parameter.dtype}:{tuple(parameter.shape)}".encode("utf-8"))
        data = parameter.detach().reshape(-1).contiguous().cpu()
        digest.update(data.view(torch.uint8).numpy().data)
    return digest.hexdigest()[:16]
