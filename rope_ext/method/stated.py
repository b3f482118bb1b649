"""What a checkpoint's config.json states for a method, in keys transformers does not read:
Qwen2.5-1M's `dual_chunk_attention_config` (chunk_size, local_size, original_max_position_embeddings),
read by dca for its sizes and by the family adapter for the trained window (docs/dca.md). It holds
no method, so adapters may read it (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Mapping

from .base import as_size

CONFIG_KEY = "dual_chunk_attention_config"  # Qwen2.5-1M's config.json
# The keys of CONFIG_KEY that rope-ext reads, with their smallest values; its other keys (Qwen's
# settings of vLLM's sparse attention) configure nothing here.
STATED = {"chunk_size": 2, "local_size": 1, "original_max_position_embeddings": 2}


def stated_sizes(stated) -> dict:
    """The sizes a config's `dual_chunk_attention_config` (`stated`, None when it has none)
    states: {key: int} for the keys of STATED it sets; ValueError naming config.json and the key
    for a value that is not a mapping, a size that is not an int in range, or sizes that do not
    fit together."""
    if stated is None:
        return {}
    if not isinstance(stated, Mapping):
        raise ValueError(
            f"config.json: {CONFIG_KEY} must be a mapping (chunk_size, local_size, original_max_position_embeddings), "
            f"got {stated!r}"
        )
    sizes = {
        key: as_size(stated[key], f"config.json: {CONFIG_KEY}.{key}", minimum)
        for key, minimum in STATED.items()
        if stated.get(key) is not None
    }
    chunk, local, window = (sizes.get(key) for key in STATED)
    if chunk is not None and local is not None and local >= chunk:
        raise ValueError(f"config.json: {CONFIG_KEY}.local_size ({local}) must be below {CONFIG_KEY}.chunk_size ({chunk})")
    if chunk is not None and window is not None and chunk > window:
        raise ValueError(
            f"config.json: {CONFIG_KEY}.chunk_size ({chunk}) exceeds {CONFIG_KEY}.original_max_position_embeddings "
            f"({window}): distances up to chunk_size - 1 must have been trained"
        )
    return sizes
