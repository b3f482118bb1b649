"""The keys kept rotated between the forwards of a decode (`RotatedKeys`): a step rotates only its
new keys."""

from __future__ import annotations

import threading
import weakref


class RotatedKeys:
    """Each KV cache's keys (by the cache object's identity, weakly, as rotary.KeyPositions) rotated
    to one position map, per layer and map, kept between the forwards of a decode: a step rotates
    only its new keys. A map is named by what fixes each key's angles for the cache's life (a
    dynamic method's scaling; an attention-side method's own or grouped positions), so a name
    never serves other angles. Each map kept takes as much memory as the key cache again, and up
    to a quarter more (room for the next steps' keys).

    A layer's rotated keys hold while the layer's key tensor is the one they were rotated from:
    transformers' DynamicLayer replaces that tensor on every change (update, crop, reorder_cache,
    batch_repeat_interleave, batch_select_indices), so a cache changed between forwards is rotated
    again in full, never served stale, and a map a forward did not use is let go before the next.
    Other cache layers (which may write in place) are always rotated in full. A copy of the model
    (deepcopy, pickle) copies no store: its rotator makes its own, empty (rope_ext.attention.Rotator)."""

    def __init__(self):
        self._caches: list[tuple[weakref.ref, dict]] = []
        self._lock = threading.Lock()  # threads running the model at once, each with its own cache

    def entries(self, cache) -> dict:
        """{(layer index, map name): (number of keys, (B, H, D), rotated keys in a buffer with room
        for more, weak reference to the key tensor they came from)}."""
        found = next((entries for ref, entries in self._caches if ref() is cache), None)
        if found is None:
            with self._lock:
                found = {}
                self._caches = [(ref, entries) for ref, entries in self._caches if ref() is not None]
                self._caches.append((weakref.ref(cache), found))
        return found

    def check(self, cache) -> dict | None:
        """Before a forward: let go of the entries of `cache` whose layer changed since they were
        rotated; the entries of `cache` (None: a cache without layers, which the store never serves)."""
        cache_layers = getattr(cache, "layers", None)
        if cache_layers is None:
            return None
        entries = self.entries(cache)
        for index, name in list(entries):
            if index >= len(cache_layers) or getattr(cache_layers[index], "keys", None) is not entries[index, name][-1]():
                del entries[index, name]
        return entries


class ForwardEntries(threading.local):
    """The entries (RotatedKeys.entries) of the cache the calling thread's forward extends, found
    once before the forward, read by its layers without a call."""

    kept: dict | None = None
