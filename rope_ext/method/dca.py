"""dca: Dual Chunk Attention (An et al. 2024, "Training-Free Long-Context Scaling of Large
Language Models", ChunkLlama), training-free.

The sequence is cut into chunks of s = chunk_size - local_size tokens. Keys sit at their position
within their chunk, j mod s; a query at position i in chunk n = i // s attends

    keys of its own chunk           with query position  i mod s                (intra-chunk)
    keys of the chunk before        with query position  min(i mod s + s, c - 1) (successive-chunk)
    keys of every earlier chunk     with query position  c - 1                   (inter-chunk)

where c = chunk_size, and the three parts share one softmax. No relative distance exceeds c - 1,
so with c at most the trained window L the model never sees a distance it was not trained on;
nearby tokens keep their true distance up to local_size into the next chunk.

A query in the first two chunks at a position below c (i < min(c, 2s)) meets every key at its
true distance through the maps above: such queries attend with their own positions, exactly as the
unpatched model (bit for bit). With local_size > c / 2 (s < c / 2) the queries from 2s to c - 1
already see keys two chunks back at the inter-chunk position c - 1, as the maps say.

The rotary frequencies stay the trained ones (`yarn_dca`: YaRN's, below); the KV cache keeps keys
before rotation (the mechanism of the dynamic methods, rope_ext.rotary), so one forward, chunked
prefill and token-by-token decoding give the same numbers. `logn=True` adds Qwen's log-n scale to the
queries past the trained window (docs/logn.md).

How it runs: each part is an attention call of the model's own head size over the keys it needs,
without a mask (the intra-chunk part: the chunk's keys before the forward's first row in full, then
a causal square), and the parts are merged by their log-sum-exp (rope_ext.attention.merge_by_lse).
No [L, L] tensor is built. A DynamicCache's keys are kept rotated at their place in their chunk
(one copy of the key cache, rope_ext.attention.rotate.RotatedKeys; while every query is below
min(c, 2s), at their own positions instead): a decode step rotates only its query, at its three
positions, and its new key, and attends the three parts in three calls.

Qwen2.5-1M checkpoints carry `dual_chunk_attention_config` in config.json (chunk_size,
local_size, original_max_position_embeddings), which transformers ignores: `rope_ext.patch(model,
"dca", factor=...)` takes chunk_size and local_size from it, and the family adapter takes the
trained window from original_max_position_embeddings (docs/dca.md); `stated_sizes` checks each.

`yarn_dca` is the same attention over YaRN's frequencies and attention temperature at the factor
(rope_ext.method.rope.yarn, with its beta_fast, beta_slow, attention_factor and truncate), as Qwen
runs DCA under a config that states yarn rope_parameters: without a factor it takes the one those
rope_parameters state. With chunk_size = L every query inside the window meets every key at its
true distance, so there the patch is rope-ext's `yarn` at the same factor, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.attention import RotateInAttention, attend_with_lse, exact_rows, merge_by_lse
from rope_ext.geometry import RotaryGeometry

from .attention_side import AttentionMethod
from .base import ModelFacts, as_size, check_factor
from .rope import METHODS as ROPE_METHODS
from .rope import yarn

NAME = "dca"
PARAMS = {"chunk_size": None, "local_size": None}
SUMMARY = "Dual Chunk Attention: intra-, successive- and inter-chunk positions in one softmax"
FORMULA = "keys at j mod s; query at i mod s (same chunk), min(i mod s + s, c-1) (previous chunk), c-1 (earlier); s = c - local"
CONFIG_KEY = "dual_chunk_attention_config"  # Qwen2.5-1M's config.json
LOCAL_FRACTION = 16  # local_size defaults to c / 16, ChunkLlama's choice
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


@dataclass(frozen=True)
class ChunkRows:
    """The query rows [lo, hi) of a forward that are in chunk n: the position of the first, and
    their intra-, successive- and inter-chunk positions [1, rows]."""

    n: int
    lo: int
    hi: int
    position: int
    within: torch.Tensor
    successive: torch.Tensor
    inter: torch.Tensor


class DualChunkAttention(RotateInAttention):
    """Rotates queries and keys itself (in place of RotateInAttention, whose KV-cache tracking it
    keeps). Queries below chunk_size attend through the backend with their own positions; the
    others attend their chunk, the chunk before and the earlier chunks as calls merged by
    log-sum-exp. Positions must be those of one unpadded sequence (the same in every row). The keys
    are kept rotated to their place in their chunk (one copy of the key cache, RotatedKeys), and to
    their own positions while every query is below min(c, 2s) (a second copy, of at most that
    many keys, let go once the queries pass it)."""

    rotates = True

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        query, k_pos = self.received(query, key)
        rotary = self.rotary
        kv_len, q_len = key.shape[-2], query.shape[-2]
        first = self.one_sequence(attention_mask, kv_len, q_len, rotary.method.name)
        chunk, local = rotary.params["chunk_size"], rotary.params["local_size"]
        span = chunk - local  # s: the chunk length
        inv_freq, scale = rotary.frame.angles(rotary.geometry.original_window)  # the method's: trained, or yarn_dca's
        positions = rotary.frame.q_pos[:1]  # [1, Sq]
        exact, chunks = self.per_forward(("rows",), lambda: self._rows(positions[0], span, chunk))
        outputs = []
        offset = kv_len - q_len
        if exact:
            q_own = self.rotate_to(query[:, :, :exact], "own", lambda: (positions[:, :exact],), inv_freq, scale)[:, :, 0]
            if exact == q_len:  # every key below min(c, 2s): kept at its own position while the queries are
                k_own = self.keys_at(module, key, ("own",), k_pos[:1], (lambda at: at,), inv_freq, scale)[:, :, 0]
            else:
                end = offset + exact
                k_own = self.rotate_to(key[:, :, :end], ("own keys", kv_len), lambda: (k_pos[:1, :end],), inv_freq, scale)[
                    :, :, 0
                ]
            outputs.append(exact_rows(module, q_own, k_own, value, attention_mask, attend, offset, exact, kwargs))
        if exact < q_len:
            scaling = kwargs.get("scaling")
            # every key at its place in its chunk, rotated once and kept between forwards
            keys = self.keys_at(module, key, ("in chunk",), k_pos[:1], (lambda at: at % span,), inv_freq, scale)[:, :, 0]
            for rows in chunks:
                outputs.append(
                    self._chunk_rows(query[:, :, rows.lo : rows.hi], keys, value, rows, first, inv_freq, scale, scaling)
                )
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None

    @staticmethod
    def _rows(positions: torch.Tensor, span: int, chunk: int) -> tuple[int, list]:
        """(the number of rows whose every key is in their chunk or the one before at its true
        distance: positions are consecutive, so the first rows; a ChunkRows for each chunk the
        other rows are in). They follow from the positions alone: once per forward."""
        exact = int((positions < min(chunk, 2 * span)).sum())
        rows = positions[exact:]
        chunks = torch.div(rows, span, rounding_mode="floor")
        found = []
        for n in torch.unique_consecutive(chunks).tolist():
            sel = (chunks == n).nonzero()
            lo, hi = int(sel[0]), int(sel[-1]) + 1
            within = rows[None, lo:hi] % span
            found.append(
                ChunkRows(
                    n,
                    exact + lo,
                    exact + hi,
                    int(rows[lo]),
                    within,
                    torch.clamp(within + span, max=chunk - 1),
                    torch.full_like(within, chunk - 1),
                )
            )
        return exact, found

    def _chunk_rows(self, query, keys, value, rows: ChunkRows, first, inv_freq, scale, scaling):
        """The rows of one chunk n: [B, rows, H, D] from the intra-, successive- and inter-chunk parts,
        each a call without a mask (masked calls of the CPU kernel are slower, and a mask is a [rows,
        keys] tensor). Key index k holds position first + k: keys before `first` (a forward whose
        positions do not start at 0, without the cache of the earlier ones) are not there to attend."""
        n, span = rows.n, self.rotary.params["chunk_size"] - self.rotary.params["local_size"]
        start = max(0, n * span - first)  # key index where chunk n begins
        previous = max(0, (n - 1) * span - first)  # key index where chunk n - 1 begins
        lo = rows.position - first  # key index of the first row; row r is key lo + r
        end = lo + query.shape[-2]
        # the rows of chunk n are the same in every layer of the forward: n names their positions
        queries = self.rotate_to(query, ("chunk", n), lambda: (rows.within, rows.successive, rows.inter), inv_freq, scale)
        q_intra, q_succ, q_inter = queries.unbind(2)
        if end - lo == 1:  # a single row (a decode step) sees every key of its chunk up to its own
            parts = [(*attend_with_lse(q_intra, keys[:, :, start:end], value[:, :, start:end], scale=scaling), None)]
        else:
            parts = [(*attend_with_lse(q_intra, keys[:, :, lo:end], value[:, :, lo:end], causal=True, scale=scaling), None)]
            if lo > start:  # keys of the chunk before its first row in this forward: every row sees them
                out, lse = attend_with_lse(q_intra, keys[:, :, start:lo], value[:, :, start:lo], scale=scaling)
                parts.append((out, lse, None))
        if start > previous:
            out, lse = attend_with_lse(q_succ, keys[:, :, previous:start], value[:, :, previous:start], scale=scaling)
            parts.append((out, lse, None))
        if previous > 0:
            out, lse = attend_with_lse(q_inter, keys[:, :, :previous], value[:, :, :previous], scale=scaling)
            parts.append((out, lse, None))
        return merge_by_lse(parts).transpose(1, 2)


@dataclass(frozen=True)
class DualChunkMethod(AttentionMethod):
    """dca as an AttentionMethod: chunk_size c and local_size, from the call, the checkpoint's
    dual_chunk_attention_config, or their defaults; the attention is `DualChunkAttention`."""

    # chunk_size >= 2: local_size >= 1 and a chunk of chunk_size - local_size >= 1 tokens
    sizes: ClassVar[dict] = {"chunk_size": 2, "local_size": 1}
    transform: ClassVar[type] = DualChunkAttention
    chooses_keys: ClassVar[bool] = True

    def derive(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float, params: dict) -> tuple[float, dict]:
        trained = geometry.original_window
        stated = stated_sizes(facts.config.get(CONFIG_KEY))
        chunk = params["chunk_size"] or stated.get("chunk_size") or trained
        local = params["local_size"] or stated.get("local_size") or max(1, chunk // LOCAL_FRACTION)
        source = {
            key: key if params[key] else f"{key} (config.json: {CONFIG_KEY}.{key})" if key in stated else f"{key} (default)"
            for key in ("chunk_size", "local_size")
        }
        if chunk > trained:
            raise ValueError(
                f"{self.name}: {source['chunk_size']} {chunk} exceeds the trained window {trained}: distances up to chunk_size - 1 "
                "must have been trained"
            )
        if not 0 < local < chunk:
            raise ValueError(
                f"{self.name}: {source['local_size']} must be between 1 and chunk_size - 1 ({chunk - 1}), got {local}"
            )
        return factor, {**params, "chunk_size": int(chunk), "local_size": int(local)}


METHOD = DualChunkMethod(NAME, SUMMARY, FORMULA, params=dict(PARAMS), takes_logn=True)

YARN_NAME = "yarn_dca"
YARN = next(m for m in ROPE_METHODS if m.name == "yarn")


def yarn_chunk_frequencies(geom: RotaryGeometry, seq_len=None, *, factor: float, chunk_size, local_size, **ramp):
    """YaRN's frequencies and temperature at `factor`, for every chunk position."""
    return yarn(geom, factor=factor, **ramp)


@dataclass(frozen=True)
class YarnDualChunkMethod(DualChunkMethod):
    """yarn_dca: dca over YaRN's frequencies. The factor is YaRN's s; without one, the one the
    checkpoint's yarn rope_parameters state."""

    def check(self, factor, params: dict) -> dict:
        # YaRN's rules on its own parameters do not involve the factor, which may come from the
        # model's config later (derive): a stand-in s = 2 lets yarn's validate run without one
        ramp = YARN.validate(2.0 if factor is None else factor, {k: params[k] for k in YARN.params})
        return {**params, **ramp}

    def derive(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        if factor is None:
            stated = facts.config.get("rope_parameters") or {}
            if stated.get("rope_type") != "yarn" or stated.get("factor") is None:
                raise ValueError(
                    f"{YARN_NAME} needs a factor (YaRN's s), or a config.json whose rope_parameters state yarn with one"
                )
            try:
                factor = check_factor(stated["factor"])
            except ValueError as err:
                raise ValueError(f"{YARN_NAME}: config.json: rope_parameters.factor: {err}") from None
        return super().derive(facts, geometry, factor, params)


YARN_METHOD = YarnDualChunkMethod(
    YARN_NAME,
    "Dual Chunk Attention over YaRN's frequencies and temperature (Qwen2.5-1M)",
    f"{FORMULA}; frequencies yarn(s)",
    params={**PARAMS, **YARN.params},
    fn=yarn_chunk_frequencies,
    takes_logn=True,
    factor_required=False,
)
