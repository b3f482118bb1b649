"""dca: Dual Chunk Attention (An et al. 2024, "Training-Free Long-Context Scaling of Large
Language Models"), training-free, as the released code runs it: HKUNLP/ChunkLlama's
`chunkllama_attn_replace.py` and the engines that serve Qwen2.5-1M with it (vLLM 0.10.2
vllm/attention/backends/dual_chunk_flash_attn.py with
vllm/model_executor/layers/rotary_embedding/dual_chunk_rope.py; SGLang 0.5.2
sglang/srt/layers/attention/dual_chunk_flashattention_backend.py with DualChunkRotaryEmbedding in
sglang/srt/layers/rotary_embedding.py).

The sequence is cut into chunks of s = chunk_size - local_size tokens. Keys sit at j mod s; a query
at position i in chunk n = i // s attends, with c = chunk_size,

    keys of its own chunk           with query position  i mod s                  (intra-chunk)
    keys of the chunk before        with query position  min(i mod s + s, c)      (successive-chunk)
    keys of every earlier chunk     with query position  min(2s - 1, c)           (inter-chunk)

the three parts in one softmax (the paper's Fig. 2 clamps at c - 1; the code and both engines at c).
A query below min(c + 1, 2s) meets every key at its true distance and attends as the unpatched
model. `temperature` is the engines' length temperature, logits times t(n)^2 with t(n) =
max(1, 0.1 ln(n / L) + 1); `causal` says whether n is the length each query has seen (True) or the
forward's (the engines' prefill). Qwen2.5-1M's `dual_chunk_attention_config` gives the sizes and
turns the temperature on (rope_ext.method.stated). Parameters and measurements: docs/dca.md; how it
runs: docs/concepts.md, "How the attention-side methods run".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rope_ext.attention import KeyMaps, RotatingTransform, attend_one_row, attend_with_lse, exact_rows, merge_by_lse
from rope_ext.geometry import RotaryGeometry
from rope_ext.rotation import rotate_prepared

from .attention_side import AttentionMethod
from .base import ModelFacts, Param
from .stated import CONFIG_KEY, stated_sizes

NAME = "dca"
SUMMARY = "Dual Chunk Attention: intra-, successive- and inter-chunk positions in one softmax, Qwen's length temperature"
FORMULA = (
    "keys at j mod s; query at i mod s (same chunk), min(i mod s + s, c) (previous chunk), min(2s-1, c) (earlier); "
    "s = c - local; temperature: logits x max(1, 0.1 ln(n/L) + 1)^2"
)
LOCAL_FRACTION = 16  # local_size defaults to c / 16, ChunkLlama's choice (Qwen's configs state c / 32)
# chunk_size >= 2: local_size >= 1 and a chunk of chunk_size - local_size >= 1 tokens
PARAMS = (
    Param("chunk_size", None, "size", lo=2, doc="c: the chunk, at most the trained window"),
    Param("local_size", None, "size", lo=1, doc="local: c - local is the chunk's stride s"),
    Param("temperature", None, "bool", doc="Qwen's length temperature; None: as the checkpoint's config states"),
)


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


@dataclass
class ChunkStep:
    """What the layers of a forward share in DualChunkAttention (`shared`): the position of key
    index 0 (`first`), the rows attended at their own positions (`exact`) and the others' chunks,
    the prepared (cos, sin) of the exact rows, of the keys they see where not every row is exact
    and of each chunk's rows, and the kept key map with the forward's new keys' (cos, sin)
    (KeyMaps: the keys' positions [1, kv_len])."""

    first: int
    exact: int
    chunks: list
    queries: tuple | None
    own_keys: tuple | None
    chunk_queries: list
    keys: KeyMaps


class DualChunkAttention(RotatingTransform):
    """Rotates queries and keys itself, with its rotator. Queries below chunk_size attend through
    the backend with their own positions; the others attend their chunk, the chunk before and the earlier chunks as calls
    merged by log-sum-exp. Positions must be those of one unpadded sequence (the same in every row). The keys
    are kept rotated to their place in their chunk (one copy of the key cache, RotatedKeys), and to
    their own positions while every query is below min(c + 1, 2s) (a second copy, of at most that
    many keys, let go once the queries pass it). With `temperature` on, the queries carry t(n)^2
    (scale_queries)."""

    def scale_queries(self, query: torch.Tensor) -> torch.Tensor:
        """The rotator's scale_queries (logn), then t(n)^2 where `temperature` is on."""
        query = self.rotator.scale_queries(query)
        if not self.rotator.params["temperature"]:
            return query
        # a factor on the queries reaches every part they are attended in, as the engines' factor on
        # the softmax scale and the keys does
        scale = self.rotator.per_forward(("temperature", query.dtype), lambda: self._temperature(query.dtype))
        return query if scale is None else query * scale

    def _temperature(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[B, 1, Sq, 1]: t(n)^2 for each query row, n the length it has seen (causal) or the
        forward's (the engines' prefill); None where every n is at most the trained window L."""
        q_pos, window = self.rotator.frame.q_pos, self.rotator.geometry.original_window
        seen = q_pos + 1 if self.rotator.params["causal"] else (q_pos.amax(-1, keepdim=True) + 1).expand_as(q_pos)
        if not bool((seen > window).any()):
            return None
        t = (0.1 * torch.log(seen.double() / window) + 1.0).clamp(min=1.0)
        return (t * t)[:, None, :, None].to(dtype)

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        rotator = self.rotator
        query = self.scale_queries(query)
        kv_len, q_len = key.shape[-2], query.shape[-2]
        step = self.step("chunks", query, key, attention_mask)
        # every key at its own position while every query is below min(c + 1, 2s), else at its place
        # in its chunk: rotated once and kept between forwards
        keys = rotator.keys_at(module, key, step.keys)[:, :, 0]
        exact, pairing = step.exact, rotator.pairing
        outputs = []
        offset = kv_len - q_len
        if exact:
            q_own = rotator.temper(rotate_prepared(query[:, :, :exact].unsqueeze(2), *step.queries, *pairing), 0, exact)[:, :, 0]
            k_own = (
                keys
                if exact == q_len
                else rotate_prepared(key[:, :, : offset + exact].unsqueeze(2), *step.own_keys, *pairing)[:, :, 0]
            )
            outputs.append(exact_rows(module, q_own, k_own, value, attention_mask, attend, offset, exact, kwargs))
        if exact < q_len:
            scaling = kwargs.get("scaling")
            for rows, factors in zip(step.chunks, step.chunk_queries):
                outputs.append(self._chunk_rows(query[:, :, rows.lo : rows.hi], keys, value, rows, factors, step.first, scaling))
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None

    def shared(self, q_len: int, kv_len: int, q_dtype, k_dtype, attention_mask) -> ChunkStep:
        """What every layer of a forward with these lengths, dtypes and mask shares: computed by the
        first such layer, in this one call, and read by the others."""
        rotator = self.rotator
        k_pos = rotator.key_positions(kv_len)[:1]
        first = rotator.one_sequence(attention_mask, kv_len, q_len, rotator.method.name)
        chunk, local = rotator.params["chunk_size"], rotator.params["local_size"]
        span = chunk - local  # s: the chunk length
        frame = rotator.frame
        inv_freq, scale = frame.angles(rotator.geometry.original_window)
        positions = frame.q_pos[:1]  # [1, Sq]
        exact, chunks = self._rows(positions[0], span, chunk)
        if exact == q_len:
            names, key_map = ("own",), (lambda at: at)
        else:
            names, key_map = ("in chunk",), (lambda at: at % span)
        held, end = kv_len - q_len, kv_len - q_len + exact
        return ChunkStep(
            first=first,
            exact=exact,
            chunks=chunks,
            queries=rotator.factors([positions[:, :exact]], inv_freq, scale, q_dtype) if exact else None,
            own_keys=rotator.factors([k_pos[:, :end]], inv_freq, scale, k_dtype) if 0 < exact < q_len else None,
            # the rows of chunk n: n names their positions
            chunk_queries=[rotator.factors([r.within, r.successive, r.inter], inv_freq, scale, q_dtype) for r in chunks],
            keys=rotator.key_maps(names, k_pos, (key_map,), (inv_freq, scale), k_dtype, held),
        )

    @staticmethod
    def _rows(positions: torch.Tensor, span: int, chunk: int) -> tuple[int, list]:
        """(the number of rows whose every key is in their chunk or the one before at its true
        distance: positions are consecutive, so the first rows; a ChunkRows for each chunk the
        other rows are in). They follow from the positions alone: once per forward."""
        exact = int((positions < min(chunk + 1, 2 * span)).sum())
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
                    torch.clamp(within + span, max=chunk),
                    torch.full_like(within, min(2 * span - 1, chunk)),
                )
            )
        return exact, found

    def _chunk_rows(self, query, keys, value, rows: ChunkRows, factors, first, scaling):
        """The rows of one chunk n: [B, rows, H, D] from the intra-, successive- and inter-chunk parts,
        each a call without a mask (masked calls of the CPU kernel are slower, and a mask is a [rows,
        keys] tensor). Key index k holds position first + k: keys before `first` (a forward whose
        positions do not start at 0, without the cache of the earlier ones) are not there to attend."""
        n, span = rows.n, self.rotator.params["chunk_size"] - self.rotator.params["local_size"]
        start = max(0, n * span - first)  # key index where chunk n begins
        previous = max(0, (n - 1) * span - first)  # key index where chunk n - 1 begins
        lo = rows.position - first  # key index of the first row; row r is key lo + r
        end = lo + query.shape[-2]
        queries = rotate_prepared(query.unsqueeze(2), *factors, *self.rotator.pairing)
        q_intra, q_succ, q_inter = self.rotator.temper(queries, rows.lo, rows.hi).unbind(2)
        # (query, first key, end, causal) of each part: a single row (a decode step) sees every key of
        # its chunk up to its own; more rows, their causal square and the keys of the chunk before
        # their first row in this forward, which every row sees
        single = end - lo == 1
        spans = [(q_intra, start, end, False)] if single else [(q_intra, lo, end, True)]
        if lo > start and not single:
            spans.append((q_intra, start, lo, False))
        if start > previous:
            spans.append((q_succ, previous, start, False))
        if previous > 0:
            spans.append((q_inter, 0, previous, False))
        parts = []
        for q, a, b, causal in spans:
            keys_seen, values_seen = keys[:, :, a:b], value[:, :, a:b]
            if single:
                parts.append((q, keys_seen, values_seen))
            else:
                parts.append((*attend_with_lse(q, keys_seen, values_seen, causal=causal, scale=scaling), None))
        return attend_one_row(parts, scaling) if single else merge_by_lse(parts).transpose(1, 2)


@dataclass(frozen=True)
class DualChunkMethod(AttentionMethod):
    """dca as an AttentionMethod: chunk_size c and local_size, from the call, the checkpoint's
    dual_chunk_attention_config, or their defaults; `temperature` from the call or, as the engines
    decide it, whether that config states original_max_position_embeddings; the attention is
    `DualChunkAttention`."""

    takes_query_scales: bool = True
    # `causal` chooses the length n of the temperature; with it off, n plays no part
    switches: str | None = "Qwen's length temperature"
    transform: ClassVar[type] = DualChunkAttention
    chooses_keys: ClassVar[bool] = True

    def by_forward(self, params: dict) -> str | None:
        # without the temperature (False; None is decided by the model's config) n plays no part
        if params.get("causal", True) is False and params.get("temperature") is not False:
            return "takes n, the length of Qwen's temperature, from each forward (the engines' prefill takes the whole prompt's)"
        return None

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float, params: dict) -> tuple[float, dict]:
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
                f"{self.name}: {source['chunk_size']} {chunk} exceeds the trained window {trained}: the distances reach "
                "chunk_size, which must stay within what was trained"
            )
        if not 0 < local < chunk:
            raise ValueError(
                f"{self.name}: {source['local_size']} must be between 1 and chunk_size - 1 ({chunk - 1}), got {local}"
            )
        temperature = params["temperature"]
        if temperature is None:
            temperature = "original_max_position_embeddings" in stated
        return factor, {**params, "chunk_size": int(chunk), "local_size": int(local), "temperature": temperature}


METHOD = DualChunkMethod(NAME, SUMMARY, FORMULA, params=PARAMS)
