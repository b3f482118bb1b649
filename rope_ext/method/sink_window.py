"""sink_window: local attention with attention sinks (StreamingLLM, Xiao et al. 2024, "Efficient
Streaming Language Models with Attention Sinks"; LM-Infinite, Han et al. 2024), training-free.

A query at position i attends the first s keys (the sinks) and the last w keys, j > i - w, and
nothing in between, in one softmax, at StreamingLLM's positions inside its cache:

    window key j (i - j < w):    distance i - j                        (its true distance)
    sink key j (j < s):          distance min(i, s + w - 1) - j         (key at j, query at min(i, s + w - 1))

With s + w at most the trained window L no distance exceeds s + w - 1; a query below s + w attends
as the unpatched model, and tokens outside the sinks and the window are not attended at all.
`SinkWindowCache` keeps only what a later query can see (StreamingLLM's rolling cache), so memory
stays the same at any length. Parameters and measurements: docs/local_attention.md; how it runs:
docs/concepts.md, "How the attention-side methods run".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers.cache_utils import Cache, DynamicLayer

from rope_ext.attention import KeyMaps, RotatingTransform, attend_one_row, attend_with_lse, exact_rows, merge_by_lse, window_parts
from rope_ext.geometry import RotaryGeometry
from rope_ext.rotation import rotate_prepared

from .attention_side import AttentionMethod
from .base import ModelFacts, Param

NAME = "sink_window"
SUMMARY = "local attention with attention sinks: the first s keys and the last w, no distance past s + w - 1"
FORMULA = "keys j < s at distance min(i, s+w-1) - j; keys i-w < j <= i at i - j; others not attended"
PARAMS = (
    Param("sinks", 4, "size", lo=0, doc="the first keys every query attends; 4: StreamingLLM's choice"),
    Param("window", None, "size", lo=1, doc="the last keys a query attends; None: L - sinks"),
)


class SinkWindowLayer(DynamicLayer):
    """One layer's KV cache that keeps the first `sinks` keys and the last `window - 1`: every key
    a later query can see, since a query sees the sinks and the keys less than `window` before it.
    `update` hands attention the kept keys and the new ones; `get_seq_length` counts every key
    written, so positions go on counting past the keys let go."""

    is_croppable = False  # a rolled-back step would need keys that are gone

    def __init__(self, sinks: int, window: int):
        super().__init__()
        self.sinks, self.window = sinks, window
        self.cumulative_length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys, values = torch.cat((self.keys, key_states), dim=-2), torch.cat((self.values, value_states), dim=-2)
        self.keys, self.values = self._kept(keys), self._kept(values)
        return keys, values

    def _kept(self, x: torch.Tensor) -> torch.Tensor:
        held = x.shape[-2]
        if held <= self.sinks + self.window - 1:
            return x
        return torch.cat((x[..., : self.sinks, :], x[..., held - self.window + 1 :, :]), dim=-2)

    def held(self) -> int:
        """Keys in memory (get_seq_length counts every key written)."""
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The keys attention receives; their mask only serves rows at their true positions, which
        # occur before any key is let go (SinkWindowAttention), so it is the one of a DynamicLayer.
        return self.held() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(f"{NAME}: its KV cache cannot be cropped: the keys it let go are not kept")


class SinkWindowCache(Cache):
    """A KV cache of `SinkWindowLayer`s: memory bounded by sinks + window keys per layer.

    The keys it lets go are ones only a model patched with sink_window of the same sizes never
    attends; any other model would attend what is left without a word. So the patch's attention
    marks the cache as served at the start of each forward (`serve`), and an update in a forward
    it does not serve is a ValueError, before the cache changes."""

    def __init__(self, num_layers: int, sinks: int, window: int):
        super().__init__(layers=[SinkWindowLayer(sinks, window) for _ in range(num_layers)])
        self.sinks, self.window = sinks, window
        self.served: tuple[int, int] | None = None  # (sinks, window) of the patch running a forward on it

    def serve(self, sizes: tuple[int, int] | None) -> None:
        self.served = sizes

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.served != (self.sinks, self.window):
            raise ValueError(
                f"SinkWindowCache(sinks={self.sinks}, window={self.window}) serves a model patched with {NAME} "
                f"of these sizes only, whose attention never reaches the keys it lets go; this model is unpatched, "
                "patched with another method or other sizes. Use a DynamicCache, or rope_ext.chunked.new_cache(model)"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@dataclass
class SinkStep:
    """What the layers of a forward share in SinkWindowAttention (`shared`): the positions of the
    keys attention receives [1, kv_len] (past the sinks, those a SinkWindowCache kept), the
    frequencies, the rows at positions below sinks + window (`exact`, attended as the unpatched
    model) and their prepared (cos, sin), those of the other rows at their own positions and at
    sinks + window - 1, and the kept key map, every key at its own position, with the forward's new
    keys' (cos, sin) (KeyMaps)."""

    exact: int
    exact_queries: tuple | None
    queries: tuple | None
    keys: KeyMaps


class SinkWindowAttention(RotatingTransform):
    """Rotates queries and keys itself, with its rotator. The positions must be those of one
    unpadded sequence that starts at 0 (the same in every row). The keys it receives are key index = position, or, from a
    SinkWindowCache that let keys go, the sinks followed by the newest keys. A DynamicCache's keys
    are kept rotated to their own positions (one copy of the key cache, RotatedKeys); a
    SinkWindowCache's (at most sinks + window keys) are rotated at every forward."""

    def __init__(self, rotator):
        super().__init__(rotator)
        self._hooks: list = []

    def attach(self, site) -> None:
        """The rotator's hooks, and around them this transform's, which mark a SinkWindowCache as
        served while the forward runs: hooks run in the order they were registered, so the mark is
        set after the rotator's pre-hook has taken the forward's cache (its `pending_cache`) and
        cleared before its forward hook lets the cache go. Bound methods, as the rotator's: a
        `copy.deepcopy` of the model gets the copy's."""
        after = site.decoder.register_forward_hook(self._after_forward, with_kwargs=True)
        self.rotator.attach(site)
        before = site.decoder.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self._hooks = [before, after]

    def detach(self, site) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.rotator.detach(site)

    def _before_forward(self, module, args, kwargs) -> None:
        cache = self.rotator.pending_cache
        if isinstance(cache, SinkWindowCache):
            cache.serve((self.rotator.params["sinks"], self.rotator.params["window"]))

    def _after_forward(self, module, args, kwargs, output) -> None:
        cache = self.rotator.pending_cache
        if isinstance(cache, SinkWindowCache):
            cache.serve(None)

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        rotator = self.rotator
        kv_len, q_len = key.shape[-2], query.shape[-2]
        step = self.step("sinks and window", query, key, attention_mask)
        pairing, sinks, window = rotator.pairing, rotator.params["sinks"], rotator.params["window"]
        # every key rotated once to its own position, kept between forwards (a DynamicCache's)
        k_all = rotator.keys_at(module, key, step.keys)[:, :, 0]
        exact = step.exact
        offset = kv_len - q_len  # query row r is key index offset + r
        outputs = []
        if exact:  # the cache lets keys go only once a query is past sinks + window: indices are positions
            q_own = rotate_prepared(query[:, :, :exact].unsqueeze(2), *step.exact_queries, *pairing)[:, :, 0]
            outputs.append(exact_rows(module, q_own, k_all, value, attention_mask, attend, offset, exact, kwargs))
        if exact < q_len:
            scaling = kwargs.get("scaling")
            # the rows past the span at their own positions, and at sinks + window - 1 for the sinks
            q_own, q_sinks = rotate_prepared(query[:, :, exact:].unsqueeze(2), *step.queries, *pairing).unbind(2)
            lo_key = offset + exact - window + 1  # the first window key of row `exact`, past the sinks
            k_window, v_window = k_all[:, :, lo_key:], value[:, :, lo_key:]
            if q_len - exact == 1:  # a decode step sees the whole window and the sinks
                parts = [(q_own, k_window, v_window)]
                if sinks:
                    parts.append((q_sinks, k_all[:, :, :sinks], value[:, :, :sinks]))
                outputs.append(attend_one_row(parts, scaling))
            else:  # row r sees window keys r .. r + window - 1: key index window - 1 + r is its own
                if sinks:
                    sink_out, sink_lse = attend_with_lse(q_sinks, k_all[:, :, :sinks], value[:, :, :sinks], scale=scaling)
                for lo, hi, parts in window_parts(q_own, k_window, v_window, window - 1, window, scaling):
                    if sinks:
                        parts.append((sink_out[:, :, lo:hi], sink_lse[:, :, lo:hi], None))
                    outputs.append(merge_by_lse(parts).transpose(1, 2))
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None

    def shared(self, q_len: int, kv_len: int, q_dtype, k_dtype, attention_mask) -> SinkStep:
        """What every layer of a forward with these lengths, dtypes and mask shares: computed by the
        first such layer, in this one call, and read by the others."""
        rotator = self.rotator
        frame, trained = rotator.frame, rotator.geometry.original_window
        rotator.key_positions(kv_len)
        rotator.one_sequence(attention_mask, kv_len, q_len, NAME, from_zero=True)
        written = frame.k_pos.shape[-1]
        let_go = written - kv_len  # keys between the sinks and the window that the cache no longer holds
        sinks, window = rotator.params["sinks"], rotator.params["window"]
        if let_go and kv_len != sinks + window - 1 + q_len:
            raise ValueError(
                f"{NAME}: the KV cache returned {kv_len} of {written} keys, not the sinks and the window a "
                "SinkWindowCache keeps (a sliding-window cache?); use a DynamicCache or rope_ext.chunked's cache"
            )
        inv_freq, scale = frame.angles(trained)
        # the positions of the keys received: past the sinks, indices skip the keys let go
        k_pos = frame.k_pos[:1] if not let_go else torch.cat((frame.k_pos[:1, :sinks], frame.k_pos[:1, sinks + let_go :]), dim=-1)
        span, held, q_pos = sinks + window, kv_len - q_len, frame.q_pos[:1]
        exact = min(q_len, max(0, span - (written - q_len)))  # rows at positions below sinks + window
        # the rows past the span at their own positions and at sinks + window - 1
        past = [q_pos[:, exact:], q_pos.new_full((1, q_len - exact), span - 1)]
        if not exact and q_dtype == k_dtype:
            # the new keys sit at the queries' positions: one computation for both, their own map's once
            queries = rotator.factors(past, inv_freq, scale, q_dtype)
            new_keys = tuple(t[:, :, :1] for t in queries)
        else:
            queries = rotator.factors(past, inv_freq, scale, q_dtype) if exact < q_len else None
            new_keys = rotator.factors([k_pos[:, held:]], inv_freq, scale, k_dtype)
        return SinkStep(
            exact=exact,
            exact_queries=rotator.factors([q_pos[:, :exact]], inv_freq, scale, q_dtype) if exact else None,
            queries=queries,
            keys=KeyMaps(("own",), k_pos, (lambda at: at,), (inv_freq, scale), new=(held, new_keys)),
        )


@dataclass(frozen=True)
class SinkWindowMethod(AttentionMethod):
    """sink_window as an AttentionMethod: `sinks` and `window`; the attention is
    `SinkWindowAttention`, the bounded cache `SinkWindowCache`."""

    transform: ClassVar[type] = SinkWindowAttention
    chooses_keys: ClassVar[bool] = True

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float, params: dict) -> tuple[float, dict]:
        trained, sinks = geometry.original_window, params["sinks"]
        if sinks >= trained:
            raise ValueError(f"{NAME}: sinks must be below the trained window {trained}, got {sinks}")
        window = params["window"] or trained - sinks
        if sinks + window > trained:
            raise ValueError(
                f"{NAME}: sinks + window = {sinks + window} exceeds the trained window {trained}: "
                "distances up to sinks + window - 1 must have been trained"
            )
        return factor, {**params, "window": int(window)}

    def kv_cache(self, config, params: dict) -> Cache:
        return SinkWindowCache(config.get_text_config(decoder=True).num_hidden_layers, params["sinks"], params["window"])


METHOD = SinkWindowMethod(NAME, SUMMARY, FORMULA, params=PARAMS)
