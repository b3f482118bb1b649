"""The contract every attention-side method meets (rope_ext/method: the methods whose transform runs
inside attention), checked on the tiny trained model (window 128) for each row of METHODS:

- inside the trained window it is the unpatched model, bit for bit, on either backend;
- one forward, chunked prefill and token-by-token decoding give the same logits;
- a decode step past the window rotates only its query and its new key (the cached keys are kept
  rotated, RotatedKeys) and attends its parts in calls without a mask, merged by log-sum-exp;
- the kept rotated keys follow the cache: crops, copies of the cache and of the model, beam
  reorders and repeats (and a store that did not follow them is caught);
- it saves and reloads exactly, a plain reload is the unpatched model, and unpatch restores it;
- what it cannot run on is refused: another backend (at patch time, and a switch to one later,
  which changes nothing), a static cache, a padded batch where it needs one unpadded sequence; so
  is a missing factor or an unknown parameter, and a refused patch changes nothing.

Every registered method that computes attention itself runs each case: a method without a row of
METHODS (a new one) with factor 4 (`row_of`), a row adding the parameters that matter to it. Each
method's own maths (against its definition written out)
and its parameter rules live in its own module (test_self_extend.py, test_dca.py, ...).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache, StaticCache

import rope_ext
import rope_ext.rotation
from rope_ext.attention.keys import RotatedKeys

from helpers import (
    WINDOW,
    CountCalls,
    computes_attention,
    leaves_the_trained_window,
    assert_kept_keys_follow_the_cache,
    assert_refused_unchanged,
    assert_refuses_other_backends,
    assert_refuses_padded_batches,
    assert_saves_reloads_and_unpatches,
    cached_logits,
    count_lse_calls,
    random_ids,
    random_model,
    registered,
    set_chain,
)

TRAINED = 128  # the tiny model's window
LENGTH = 400  # past the window, within every row's reach
BACKENDS = ["sdpa", "eager"]


@dataclass(frozen=True)
class Row:
    """One attention-side method and the parameters each contract case patches it with."""

    name: str
    inside: list[dict]  # inside the trained window it is the unpatched model
    cached: list[dict]  # one forward == chunked prefill == decoding after a prefill
    decoded: list[dict]  # one forward == decoding every token from an empty cache (slow: marked integration)
    decode_step: list[dict]  # a decode step past the window rotates only its new keys, in `decode_parts` calls per layer
    saved: list[dict]  # save, reload and unpatch
    unpadded: bool  # it needs one unpadded sequence: padded batches are refused
    needs_factor: bool = True  # without a factor (or the parameters that imply one) it is refused
    decode_parts: int = 2  # the attention calls of a decode step past the window, per layer


METHODS = [
    Row(
        "self_extend",
        inside=[{"factor": 4}],
        cached=[{"group": 4, "window": 32}, {"factor": 4, "logn": True}],
        decoded=[{"factor": 4, "logn": True}],
        decode_step=[{"group": 3, "window": 32}],  # 32 % 3 != 0: distance 32 is grouped differently
        saved=[{"group": 4, "window": 32}, {"factor": 4, "logn": True}],
        unpadded=False,
    ),
    Row(
        "dca",
        inside=[{"factor": 4}],
        cached=[{"factor": 4}, {"factor": 4, "logn": True}, {"factor": 4, "temperature": True, "attn_scale": 0.1}],
        decoded=[{"factor": 4}, {"factor": 4, "logn": True}, {"factor": 4, "temperature": True}],
        decode_step=[{"factor": 4, "chunk_size": 96, "local_size": 16}],  # s = 80: steps in chunk 4, keys in 0 .. 4
        saved=[{"factor": 4, "local_size": 8}, {"factor": 4, "logn": True}],
        unpadded=True,
        decode_parts=3,  # its chunk, the chunk before, the earlier chunks
    ),
    Row(
        "rerope",
        inside=[{"factor": 4}, {"factor": 4, "leak": "auto"}, {"leak": 4.5, "window": 24}, {"factor": 4, "causal": False}],
        cached=[{"factor": 4}, {"factor": 4, "leak": "auto"}, {"leak": 4.5, "window": 24}],
        decoded=[{"factor": 4, "leak": "auto"}],
        decode_step=[{"factor": 4, "leak": "auto"}],
        saved=[{"factor": 4}, {"factor": 4, "leak": "auto"}, {"leak": 4.5, "window": 24, "causal": False}],
        unpadded=False,
    ),
    Row(
        "sink_window",
        inside=[{"factor": 4}],
        cached=[{"factor": 4}, {"factor": 4, "sinks": 2, "window": 50}],
        decoded=[{"factor": 4}, {"factor": 4, "sinks": 2, "window": 50}],
        decode_step=[{"factor": 4}],  # the sinks and the window
        saved=[{"factor": 4, "sinks": 2, "window": 30}],
        unpadded=True,
    ),
    Row(
        "string",
        inside=[],  # it acts inside the window, from its shift on: bit for bit below it (test_string.py)
        cached=[{"factor": 4, "local": 16}, {"shift": 90, "local": 16}],
        decoded=[{"factor": 4, "local": 16}],
        decode_step=[{"factor": 4, "local": 16}],
        saved=[{"factor": 4, "local": 16}, {"shift": 90, "local": 16, "temperature": True}],
        unpadded=False,
        needs_factor=False,
    ),
    Row(
        "dpe",
        inside=[{"factor": 4}, {"factor": 4, "scales": "llama3-8b-instruct"}],
        cached=[{"factor": 4}, {"factor": 4, "scales": [2, 3, 4, 8, 8, 16, 32, 64], "inside_window": True}],
        decoded=[{"factor": 4, "scales": [2, 3, 4, 8, 8, 16, 32, 64]}],
        decode_step=[{"factor": 4, "scales": [2, 3, 4, 8, 8, 16, 32, 64], "window": 24}],  # 24 % 16 != 0
        saved=[{"factor": 4, "scales": [2, 3, 4, 8, 8, 16, 32, 64]}, {"factor": 4, "window": 24, "inside_window": True}],
        unpadded=False,
    ),
]


def row_of(name: str) -> Row:
    """`name`'s row of METHODS, or for a registered method without one: factor 4 in every case
    (inside the window where it leaves a LLaMA's trained window as it was), one unpadded sequence
    where it chooses the keys each query attends by their positions."""
    from rope_ext.method import REGISTRY

    given = next((row for row in METHODS if row.name == name), None)
    if given is not None:
        return given
    case = [{"factor": 4}]
    inside = case if leaves_the_trained_window(name) else []
    unpadded = REGISTRY[name].requires.keys_by_position
    return Row(name, inside=inside, cached=case, decoded=case, decode_step=case, saved=case, unpadded=unpadded)


def every_row() -> list[Row]:
    return [row_of(name) for name in registered(computes_attention)]


def test_every_row_is_a_registered_method_that_computes_attention():
    assert {row.name for row in METHODS} <= set(registered(computes_attention))


def cases(case: str, backends: list[str] | None = None, integration_on: tuple[str, ...] = ()) -> list:
    """pytest params (method, params[, backend]) for each row's parameters for `case`, on each backend;
    those on a backend in `integration_on` marked integration."""
    out = []
    for row in every_row():
        for params in getattr(row, case):
            name = "-".join([row.name, ",".join(f"{k}={v}" for k, v in params.items())])
            if backends is None:
                out.append(pytest.param(row.name, params, id=name))
            for attn in backends or []:
                marks = [pytest.mark.integration] if attn in integration_on else []
                out.append(pytest.param(row.name, params, attn, id=f"{name}-{attn}", marks=marks))
    return out


def rows(where=lambda row: True) -> list:
    return [pytest.param(row.name, id=row.name) for row in every_row() if where(row)]


@pytest.fixture
def ids(heldout_ids):
    return heldout_ids[None, :LENGTH]


# Inside the trained window: the unpatched model, bit for bit.


@pytest.mark.parametrize("method, params, attn", cases("inside", BACKENDS))
def test_inside_the_window_it_is_the_unpatched_model_bit_for_bit(tiny_model, ids, method, params, attn):
    tiny_model.set_attn_implementation(attn)
    lengths = (TRAINED, TRAINED - 37, 1)
    with torch.no_grad():
        plain = [tiny_model(ids[:, :n]).logits for n in lengths]
        plain_long = tiny_model(ids).logits
        rope_ext.patch(tiny_model, method, **params)
        patched = [tiny_model(ids[:, :n]).logits for n in lengths]
        patched_long = tiny_model(ids).logits
    for before, after in zip(plain, patched):
        assert torch.equal(before, after)
    if params.get("causal", True):
        # the rows of a longer forward that have seen at most L tokens, too (causal=False treats
        # every row of a forward past the window alike)
        assert torch.equal(plain_long[:, :TRAINED], patched_long[:, :TRAINED])
    assert (plain_long[:, TRAINED:] - patched_long[:, TRAINED:]).abs().max() > 1.0  # past the window it acts


@pytest.mark.parametrize("window", [40, 60, 100])
def test_inside_any_window_it_is_the_unpatched_forward_over_those_tokens_bit_for_bit(window):
    """Windows that are not multiples of 16 (issue #51 item 8): every exact-inside method's rows that
    have seen at most L tokens are the unpatched model's forward over those L tokens, bit for bit,
    which is what docs/concepts.md promises (the unpatched model's rows of a longer forward differ
    from those by 1e-7 under sdpa at some windows)."""
    from pathlib import Path

    from helpers import random_ids, random_model

    promise = (Path(__file__).resolve().parents[2] / "docs" / "concepts.md").read_text()
    assert "bit for bit, those of the\nunpatched model's forward over those tokens alone" in promise
    x = random_ids(3 * window, seed=1)
    for method in (*(row.name for row in every_row() if row.inside), "dynamic", "dynamic_yarn"):
        model = random_model(max_position_embeddings=window)
        with torch.no_grad():
            alone = model(x[:, :window]).logits
            rope_ext.patch(model, method, factor=4)
            assert torch.equal(model(x).logits[:, :window], alone), method


# One forward, chunked prefill and token-by-token decoding.


# a second or two each: the inner loop (-m "not integration") runs them on sdpa only
@pytest.mark.parametrize("method, params, attn", cases("cached", BACKENDS, integration_on=("eager",)))
def test_chunked_prefill_and_decoding_equal_one_forward(tiny_model, ids, method, params, attn):
    """Chunks of 37 and of L - 3 tokens (rope_ext.chunked_forward, through the patch's own cache),
    then decoding after a prefill: across the window's edge, and the last tokens after a prefill
    past it."""
    tiny_model.set_attn_implementation(attn)
    rope_ext.patch(tiny_model, method, **params)
    with torch.no_grad():
        full = tiny_model(ids).logits
        for chunk_size in (37, TRAINED - 3):
            hidden, _ = rope_ext.chunked_forward(tiny_model, ids, chunk_size=chunk_size)
            assert (tiny_model.lm_head(hidden) - full).abs().max() <= 1e-4, chunk_size
    across = cached_logits(tiny_model, ids[:, : TRAINED + 40], 1, prefill=TRAINED - 4)
    assert (across - full[:, TRAINED - 4 : TRAINED + 40]).abs().max() <= 1e-4
    last = cached_logits(tiny_model, ids, 1, prefill=LENGTH - 6)
    assert (last - full[:, -6:]).abs().max() <= 1e-4


@pytest.mark.integration
@pytest.mark.parametrize("method, params", cases("decoded"))
def test_decoding_every_token_from_an_empty_cache_equals_one_forward(tiny_model, ids, method, params):
    rope_ext.patch(tiny_model, method, **params)
    with torch.no_grad():
        full = tiny_model(ids).logits
    assert (cached_logits(tiny_model, ids, 1) - full).abs().max() <= 1e-4


@pytest.mark.parametrize("method, params, attn", cases("decode_step", BACKENDS))
def test_a_decode_step_past_the_window_rotates_only_its_new_keys(tiny_model, heldout_ids, monkeypatch, method, params, attn):
    """The cached keys stay rotated between steps: a step rotates its query (at each position the
    method gives it) and its new key (at each of its positions), at most 4 rows per layer, not the
    ~400 keys of the cache; and its parts are calls without a mask that give their log-sum-exp,
    none through the backend."""
    tiny_model.set_attn_implementation(attn)
    info = rope_ext.patch(tiny_model, method, **params)
    ids = heldout_ids[None, : min(LENGTH, info.max_length)]  # at most the longest input the patch is meant for
    parts = row_of(method).decode_parts
    layers = tiny_model.config.num_hidden_layers
    counter = CountCalls()
    set_chain(tiny_model, [*tiny_model.model.layers[0].self_attn.rope_ext_attention.transforms, counter])
    lse = count_lse_calls(monkeypatch)
    with torch.no_grad():
        full = tiny_model(ids).logits
        cache = DynamicCache(config=tiny_model.config)
        tiny_model(ids[:, :-5], cache=cache, use_cache=True)
        counter.calls = lse["calls"] = 0
        rotated = count_rotated_rows(monkeypatch)
        steps = torch.cat(
            [tiny_model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1] - 5, ids.shape[1])],
            dim=1,
        )
    assert (counter.calls, lse["calls"]) == (0, 5 * layers * parts)
    assert 0 < rotated["rows"] <= 5 * layers * 4
    assert (steps - full[:, -5:]).abs().max() <= 1e-4


def count_rotated_rows(monkeypatch) -> dict:
    """Counts the rows (tokens) rope_ext's attention rotates, queries and keys, once for each position
    a row is rotated to, in {"rows": n}."""
    counted = {"rows": 0}
    for function in (rope_ext.rotation.apply_rotary, rope_ext.rotation.rotate_prepared):

        def counting(x, *args, original=function, **kwargs):
            out = original(x, *args, **kwargs)
            counted["rows"] += out.shape[-2] * (out.shape[-3] if original is rope_ext.rotation.rotate_prepared else 1)
            return out

        for name, module in list(sys.modules.items()):
            if name.startswith("rope_ext") and getattr(module, function.__name__, None) is function:
                monkeypatch.setattr(module, function.__name__, counting)
    return counted


# The kept rotated keys follow the cache.

# every attention-side method, past the window (and string past its shift, dca past its second chunk);
# one without a case here at factor 4
KEPT = [
    ("self_extend", {"factor": 4}),
    ("rerope", {"factor": 4}),
    ("rerope", {"factor": 4, "leak": "auto"}),
    ("string", {"factor": 4, "local": 16}),
    ("dpe", {"factor": 4, "scales": "llama3-8b-instruct"}),
    ("dca", {"factor": 4}),
    ("sink_window", {"factor": 4, "sinks": 2, "window": 50}),
]
KEPT += [(name, {"factor": 4}) for name in registered(computes_attention) if name not in {kept for kept, _ in KEPT}]


@pytest.mark.parametrize("end", [90, 300])  # inside the 128-token window, and past it
@pytest.mark.parametrize("method, params", KEPT)
def test_kept_rotated_keys_follow_crops_copies_reorders_and_repeats(tiny_model, heldout_ids, method, params, end):
    rope_ext.patch(tiny_model, method, **params)
    assert_kept_keys_follow_the_cache(tiny_model, torch.stack((heldout_ids[:400], heldout_ids[500:900])), end)


@pytest.mark.parametrize("method, params", [KEPT[0], KEPT[5], KEPT[6]])
def test_a_store_that_does_not_follow_the_cache_is_caught(tiny_model, heldout_ids, monkeypatch, method, params):
    """The test above fails on a store that keeps its rotated keys through a change of the cache."""
    rope_ext.patch(tiny_model, method, **params)
    monkeypatch.setattr(RotatedKeys, "check", lambda store, cache: None)
    with pytest.raises(AssertionError):
        assert_kept_keys_follow_the_cache(tiny_model, torch.stack((heldout_ids[:400], heldout_ids[500:900])), 300)


@pytest.mark.parametrize("method, params", cases("inside"))
def test_decoding_inside_the_window_is_the_unpatched_models_bit_for_bit(tiny_model, ids, method, params):
    """A prefill and token-by-token steps inside the window: the kept rotated keys give the
    unpatched model's decoding logits, bit for bit."""
    with torch.no_grad():
        plain = cached_logits(tiny_model, ids[:, :TRAINED], 1, prefill=TRAINED - 20)
        rope_ext.patch(tiny_model, method, **params)
        patched = cached_logits(tiny_model, ids[:, :TRAINED], 1, prefill=TRAINED - 20)
    assert torch.equal(plain, patched)


# Saving, reloading, unpatching.


@pytest.mark.parametrize("method, params", cases("saved"))
def test_save_reload_and_unpatch(tiny_model, ids, tmp_path, method, params):
    assert_saves_reloads_and_unpatches(tiny_model, method, params, ids[:, : 3 * TRAINED], tmp_path)


# What it cannot run on: refused, and nothing changes.


@pytest.mark.parametrize("method", rows())
def test_other_backends_are_refused(method):
    assert_refuses_other_backends(method)


@pytest.mark.parametrize("method", rows())
def test_switching_to_a_backend_it_cannot_run_on_is_refused_and_nothing_changes(tiny_model, ids, method):
    rope_ext.patch(tiny_model, method, factor=4)
    with torch.no_grad():
        before = tiny_model(ids).logits
    with pytest.raises(ValueError, match=f"attention stays 'sdpa' under the rope_ext patch: {method} runs on the eager or sdpa"):
        tiny_model.set_attn_implementation("flex_attention")
    assert tiny_model.config._attn_implementation == "rope_ext_sdpa"
    with torch.no_grad():
        assert torch.equal(tiny_model(ids).logits, before)


@pytest.mark.parametrize("method", rows(lambda row: row.unpadded))
def test_padded_batches_are_refused(method):
    assert_refuses_padded_batches(method)


@pytest.mark.parametrize("method", rows(lambda row: row.unpadded))
@pytest.mark.parametrize(
    "model_type, overrides",
    [("mistral", {"sliding_window": 32}), ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1})],
)
def test_a_sliding_window_model_is_refused_at_patch(method, model_type, overrides):
    """A method that chooses the keys each query attends cannot keep a sliding window: refused
    with the reason when patched, not at every forward."""
    model = random_model(model_type, **overrides)
    assert_refused_unchanged(
        method, {"factor": 4}, f"{method}: the model's layers attend through a sliding window of 32", model=model
    )


@pytest.mark.parametrize("method", rows(lambda row: row.unpadded))
def test_a_sliding_window_longer_than_the_patch_is_kept_until_it_hides_a_key(method):
    """Phi-3.5-mini ships sliding_window 262144 over a 4096-token window: no key is hidden up to
    the patch's length, so the patch is taken (exact there, tests/patches/test_checkpoint_shapes.py); a
    sequence past the window is refused when its mask hides a key."""
    model = random_model("mistral", sliding_window=4 * WINDOW)
    rope_ext.patch(model, method, factor=4)
    with torch.no_grad():
        model(random_ids(4 * WINDOW))
        with pytest.raises(ValueError, match=f"{method}: positions must be those of one unpadded sequence"):
            model(random_ids(4 * WINDOW + 1))


@pytest.mark.parametrize("method", rows())
def test_a_static_cache_is_refused(method):
    model = random_model()
    rope_ext.patch(model, method, factor=4)
    cache = StaticCache(config=model.config, max_cache_len=4 * WINDOW)
    with pytest.raises(ValueError, match=f"{method}: pre-allocated \\(static\\) KV caches are not supported"), torch.no_grad():
        model(random_ids(8), cache=cache, use_cache=True)


@pytest.mark.parametrize("method", rows(lambda row: row.needs_factor))
def test_a_missing_factor_changes_nothing(method):
    assert_refused_unchanged(method, {}, "needs a factor")


@pytest.mark.parametrize("method", rows())
def test_an_unknown_parameter_changes_nothing(method):
    # alibi_hybrid's, a parameter no attention-side method has
    assert_refused_unchanged(method, {"factor": 4, "slope_scale": 4}, r"unknown parameter\(s\) \['slope_scale'\]")


@pytest.mark.parametrize("method, params", KEPT)
def test_chunked_generate_with_beams_scores_what_one_forward_scores(tiny_model, heldout_ids, method, params):
    """Beam search through rope_ext.chunked_generate (the patch's own cache, reordered between
    steps): each returned sequence's score, its new tokens' summed log-probabilities (length
    penalty 0), is what one forward over the whole sequence gives them."""
    rope_ext.patch(tiny_model, method, **params)
    prompt, new = heldout_ids[None, : TRAINED + 100], 6
    with torch.no_grad():
        out = rope_ext.chunked_generate(
            tiny_model,
            prompt,
            chunk_size=64,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            num_beams=3,
            num_return_sequences=2,
            length_penalty=0.0,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        logprobs = torch.log_softmax(tiny_model(out.sequences).logits[:, -new - 1 : -1].float(), dim=-1)
    scored = logprobs.gather(-1, out.sequences[:, -new:, None]).sum(dim=(1, 2))
    torch.testing.assert_close(out.sequences_scores, scored, rtol=0, atol=1e-4)
