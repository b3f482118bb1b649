"""Long inputs through the KV cache, one chunk at a time.

    hidden, cache = rope_ext.chunked_forward(model, ids, chunk_size=4096)
    nll = rope_ext.chunked_nll(model, ids, chunk_size=4096)        # -log p(ids[t+1] | ids[:t+1])
    out = rope_ext.chunked_generate(model, ids, chunk_size=4096, max_new_tokens=32)

A forward over L tokens holds L x L attention scores (or an L x L mask) and, through the LM head,
L x vocab logits. Here the input goes through the model `chunk_size` tokens at a time, each chunk
attending to the cached keys of the chunks before it, and the LM head runs on a bounded number of
rows at a time: peak memory is the KV cache plus one chunk, never L x vocab.

With a dynamic method (dynamic, dynamic_yarn) and self_extend the cache holds keys before
rotation and every query rotates them with its own scaling (rope_ext.rotary), so the result is the
same as one forward and as token-by-token decoding. Under the causal schedule each query uses the
scaling for the length it has seen; patch with `granularity=chunk_size` to give each chunk one
scaling, the length at its end ("dynamic scaling per chunk"), when the chunk size divides the
original window. That is also what keeps it fast: queries with different scalings are attended in
separate groups, one per scaling. With causal=False every query of a forward takes the scaling of
that forward's longest position, so chunks past the trained window would each be scaled for their
own end: such an input is refused (`chunking_refusal`), and one chunk or an input inside the window
is exact. With the
unpatched model or a static method, the chunks give the numbers of a single forward too (the
cached keys carry their final rotation).

The cache is the patch's own where it has one (`new_cache`): sink_window's keeps only the sinks and
its window, so memory stays bounded and time grows linearly with the input; every other cache
holds every key.
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation import GenerationMode

from . import method as methods
from .patching import installed_patch, installed_rotary
from .saving import check_adapter_base

LOGIT_ELEMENTS = 1 << 25  # fp32 logits computed at once: 128 MiB


def _check(input_ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("input_ids must be an integer tensor of token ids")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be [tokens] or [batch, tokens] with at least one token, got shape {tuple(input_ids.shape)}"
        )
    return input_ids


def _patch(model):
    """(method, params) of the patch on `model`, or None (unpatched, or a family rope-ext does not patch)."""
    try:
        applied = installed_patch(model)
    except ValueError:
        return None
    if applied is None:
        return None
    return methods.get(applied.method, applied.params), applied.params


def new_cache(model):
    """The KV cache a long input goes through: the patch's own where it has one (sink_window's
    keeps only the keys later queries see, so memory does not grow with the input), else
    transformers' DynamicCache."""
    patch = _patch(model)
    cache = None if patch is None else patch[0].kv_cache(model.config, patch[1])
    return DynamicCache(config=model.config) if cache is None else cache


def copy_prefix(model, cache, length: int):
    """A new cache holding the first `length` tokens of `cache`, which `model` filled from an empty
    cache without padding. Prefilling the rest of a prompt that shares those tokens from it
    (`chunked_forward(..., cache=copy)`) is a chunked prefill of that whole prompt, with a chunk
    boundary at `length`; `cache` itself is left as it was, to be copied again.

    ValueError for a cache that lets keys go or slides (sink_window's, a sliding-window layer) and
    for a dynamic patch with causal=False, whose queries are scaled for the whole prompt's length:
    a prefix computed inside one prompt is then not that of another."""
    if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(
            f"copy_prefix needs a DynamicCache that keeps every key, got {type(cache).__name__} "
            f"with {sorted({type(layer).__name__ for layer in getattr(cache, 'layers', [])})}"
        )
    patch = _patch(model)
    if patch is not None and patch[0].dynamic and patch[1].get("causal", True) is False:
        raise ValueError(
            f"copy_prefix: {patch[0].name} with causal=False scales every query for the whole input's "
            "length, so a prompt's prefix is not computed as it would be inside another prompt"
        )
    held = cache.get_seq_length()
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= held:
        raise ValueError(f"length must be an int in [0, {held}] (the tokens the cache holds), got {length!r}")
    copy = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        if layer.is_initialized:
            copy.update(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone(), index)
    rotary = installed_rotary(model) if patch is not None else None
    if rotary is not None:
        rotary.copy_positions(cache, copy, length)
    return copy


def chunking_refusal(method, params: dict) -> str | None:
    """Why an input split across forwards past the trained window (chunks, a prefill apart from
    the last prompt token) cannot give the numbers of one forward under the method `method` bound
    to `params`, or None."""
    if (what := method.by_forward(params)) is not None:
        return (
            f"{method.name} with causal=False {what}, so an input split into chunks past the trained window is "
            "computed for each chunk's end, not for the whole input; run it in one forward, or patch with "
            "causal=True (the default), whose chunks are exact"
        )
    return None


def _refuse_split(model, end: int) -> None:
    """ValueError when the patch's scaling cannot be split across forwards (chunking_refusal) and
    the `end` positions of the input reach past the trained window."""
    patch = _patch(model)
    reason = None if patch is None else chunking_refusal(*patch)
    if reason is not None and end > installed_patch(model).original_window:
        raise ValueError(reason)


def _warn_slow_schedule(model, chunk_size: int) -> None:
    """A dynamic method re-scaled more often than once per chunk attends each chunk in many groups."""
    patch = _patch(model)
    if patch is None or "granularity" not in patch[0].schedule:  # longrope's two sets need no groups
        return
    method, params = patch
    if params.get("causal", True) and params["granularity"] < chunk_size:
        warnings.warn(
            f"rope_ext: {method.name} re-scales every {params['granularity']} token(s), so each "
            f"{chunk_size}-token chunk past the window is attended in up to {chunk_size // params['granularity']} "
            f"groups; patch with granularity={chunk_size} for one scaling per chunk",
            stacklevel=4,
        )


@torch.no_grad()
def chunked_forward(
    model,
    input_ids: torch.Tensor,
    chunk_size: int,
    *,
    attention_mask: torch.Tensor | None = None,
    cache=None,
    keep_hidden: bool = True,
    on_chunk=None,
    progress: bool = False,
):
    """Run `input_ids` [B, T] (or [T]) through the model body `chunk_size` tokens at a time.

    Returns (hidden, cache): the final hidden states [B, T, hidden] (the LM head's input; None with
    keep_hidden=False) and the KV cache of the T tokens, ready for decoding (every key, or with a
    patch that lets keys go, sink_window, the keys later queries can see). `attention_mask`
    [B, T] marks padding (left padding, as for generate); positions then count real tokens only.
    `cache` continues an earlier cache filled by this model without padding (default: a new one,
    `new_cache`). `on_chunk(start, hidden_chunk)` is called after each chunk, e.g. to score it and
    let it go (chunked_nll)."""
    input_ids = _check(input_ids, chunk_size)
    check_adapter_base(model)
    batch, length = input_ids.shape
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    cache = new_cache(model) if cache is None else cache
    past = cache.get_seq_length()
    if past or length > chunk_size:
        _refuse_split(model, past + length)
    _warn_slow_schedule(model, chunk_size)
    decoder = model.get_decoder()
    device = model.get_input_embeddings().weight.device
    if attention_mask is not None:
        if past:
            raise ValueError("attention_mask (padding) is supported from an empty cache only")
        attention_mask = attention_mask.to(device)
        # as generate() does: positions count real tokens, padding sits at position 1
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
    else:
        positions = torch.arange(past, past + length, device=device)[None].expand(batch, -1)
    kept = []
    bar = tqdm(total=length, unit="tok", desc="chunked forward", disable=not progress, file=sys.stderr)
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        out = decoder(
            input_ids=input_ids[:, start:end].to(device),
            attention_mask=None if attention_mask is None else attention_mask[:, :end],
            position_ids=positions[:, start:end],
            cache=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state
        if on_chunk is not None:
            on_chunk(start, hidden)
        if keep_hidden:
            kept.append(hidden)
        bar.update(end - start)
    bar.close()
    return (torch.cat(kept, dim=1) if keep_hidden else None), cache


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits for hidden states [..., hidden], as its forward computes them
    (including a final logit soft-cap), in fp32."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} exposes no output embeddings (LM head)")
    logits = head(hidden).float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def token_nll(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) for each row of hidden states [T, hidden], float64 on the CPU: the LM head
    runs on LOGIT_ELEMENTS logits at a time, so memory never holds T x vocab."""
    rows = max(1, LOGIT_ELEMENTS // model.get_output_embeddings().weight.shape[0])
    targets = targets.to(hidden.device)
    parts = [
        F.cross_entropy(lm_logits(model, hidden[lo : lo + rows]), targets[lo : lo + rows], reduction="none").double().cpu()
        for lo in range(0, targets.numel(), rows)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


@torch.no_grad()
def chunked_nll(model, input_ids: torch.Tensor, chunk_size: int, *, progress: bool = False) -> torch.Tensor:
    """-log p(ids[t + 1] | ids[: t + 1]) for t = 0 .. T-2, float64 on the CPU, from one pass through
    the KV cache in chunks: logits are computed for a bounded number of rows at a time and dropped,
    so memory holds the cache, one chunk and LOGIT_ELEMENTS logits. One sequence ([T] or [1, T])."""
    input_ids = _check(input_ids, chunk_size)
    if input_ids.shape[0] != 1:
        raise ValueError(f"chunked_nll scores one sequence at a time, got a batch of {input_ids.shape[0]}")
    ids = input_ids[0]
    parts = []

    def score(start: int, hidden: torch.Tensor) -> None:
        targets = ids[start + 1 : start + 1 + hidden.shape[1]]  # the last chunk's last row has no target
        parts.append(token_nll(model, hidden[0, : targets.numel()], targets))

    chunked_forward(model, ids, chunk_size, keep_hidden=False, on_chunk=score, progress=progress)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _generation(model, generate_kwargs: dict) -> tuple[GenerationMode, int]:
    """The mode generate will run for these arguments and the rows it makes of each prompt row
    (beams, returned sequences), read from the generation config as generate reads it."""
    config = copy.deepcopy(generate_kwargs.get("generation_config") or model.generation_config)
    config.update(**{key: value for key, value in generate_kwargs.items() if key != "generation_config"})
    mode = config.get_generation_mode(generate_kwargs.get("assistant_model"))
    return mode, max(config.num_beams or 1, config.num_return_sequences or 1)


@torch.no_grad()
def chunked_generate(
    model,
    input_ids: torch.Tensor,
    chunk_size: int,
    *,
    attention_mask: torch.Tensor | None = None,
    progress: bool = False,
    **generate_kwargs,
) -> torch.Tensor:
    """`model.generate` for a long prompt: all but its last token are prefilled through the KV
    cache in chunks (chunked_forward), then generate continues from that cache, with any of its
    options (`max_new_tokens`, `do_sample`, `num_beams`, ...). Returns what generate returns
    (prompt included).

    Beam search and several returned sequences get the cache repeated for each row generate makes
    of a prompt row. Assisted decoding (`assistant_model`, `prompt_lookup_num_tokens`, ...) is
    refused: generate's first assisted forward runs over the whole prompt on top of the cache it
    is given, so a prefilled prompt would be read twice."""
    input_ids = _check(input_ids, chunk_size)
    check_adapter_base(model)
    if "cache" in generate_kwargs or "past_key_values" in generate_kwargs:
        raise ValueError("chunked_generate builds its own cache; do not pass one")
    mode, rows = _generation(model, generate_kwargs)
    if mode == GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            "chunked_generate does not run assisted decoding (assistant_model, prompt_lookup_num_tokens, "
            "assistant_early_exit, use_mtp): transformers' first assisted forward runs over the whole prompt on top "
            "of the cache it is given, so the prefilled prompt would be read twice; call model.generate for it"
        )
    cache = None
    if input_ids.shape[1] > 1:
        _refuse_split(model, input_ids.shape[1])  # the last prompt token is generate's first forward
        head_mask = None if attention_mask is None else attention_mask[:, :-1]
        _, cache = chunked_forward(
            model, input_ids[:, :-1], chunk_size, attention_mask=head_mask, keep_hidden=False, progress=progress
        )
        if rows > 1:  # generate repeats each prompt row (input_ids, mask) but not a cache it is given
            cache.batch_repeat_interleave(rows)  # the key positions follow (rope_ext.rotary.KeyPositions)
    return model.generate(input_ids, attention_mask=attention_mask, cache=cache, **generate_kwargs)
