"""The census (issue #26): every causal-LM architecture of the installed transformers that builds as
a tiny random model with a rotary embedding is either patched exactly or refused with a reason
from the probe's fixed list (patches/probe.py REASONS); no type is accepted and then inexact.
Patched exactly means, on fp32 logits:

- yarn x4 equals transformers' natively configured twin (the patched config reloaded by
  transformers alone) bit for bit, past the window, where the patch writes a native form;
- each of self_extend, sink_window and dca refuses at patch() (a REASONS key, or the methods' own
  refusal of sliding-window layers), leaving the model unchanged, or leaves the first window's
  logits bit-equal to the model without the scaling its checkpoint carries (MoE routing may
  amplify the last bit of a changed summation order: MOE_TOLERANCE, where the model routes);
- token-by-token decoding past the window, under yarn and each accepted attention-side method,
  equals the full forward (DECODE_TOLERANCE, the gap of fp32 attention over a cache against one
  call over the whole sequence);
- rope_ext.from_pretrained of a saved patched model, and unpatch, give the same logits bit for bit.

The tiny configs are tests/census_configs.py. The census is built once per session and prints its
counts; docs/families.md lists the refusals and the checks that do not apply to a type (a causal
a model that returns no cache)."""

from __future__ import annotations

import copy
import re
import warnings
from collections import Counter

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

import rope_ext
from rope_ext.patches.probe import REASONS

from census_configs import NOT_BUILT, WINDOW, ids, logits, tiny

pytestmark = pytest.mark.slow  # walks every architecture

# measured with transformers 5.24 (docs/families.md): rotary architectures built, and patched exactly
BUILT = 135
PATCHED = 110
ATTENTION_SIDE = ("self_extend", "sink_window", "dca")
MOE_TOLERANCE = 1e-5
DECODE_TOLERANCE = 1e-4
# The refusal attention-side methods give on their own, besides the probe's REASONS.
METHOD_REASONS = {"sliding-window": "attend through a sliding window", "key-selection": "the model's attention selects keys"}
# patch()'s own refusal of a checkpoint whose scaling records no pretraining window
# (rope_ext.patching): the user gives original_window=, the census has no window to give.
PATCH_REASONS = {"no-window": "does not record the window it was pretrained with"}


def routes(model) -> bool:
    return any("expert" in name or "router" in name or "gate" in name.split(".")[-1] for name, _ in model.named_modules())


@torch.no_grad()
def decode_gap(model, x, prefill):
    """The largest gap between token-by-token decoding, in the model's own KV cache, and one full
    forward (causal: row t of the full forward is the forward of the first t + 1 tokens); None for a
    model whose forward returns no cache to decode in (RecurrentGemma keeps its state inside)."""
    full = model(x).logits[0]
    cache = getattr(model(x[:, :prefill], use_cache=True), "cache", None)
    if cache is None:
        return None
    worst = 0.0
    for t in range(prefill, x.shape[1]):
        # the position of the step, as generate() passes it: bamba counts from 0 in each call otherwise
        out = model(x[:, t : t + 1], position_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
        cache = out.cache
        worst = max(worst, (out.logits[0, -1] - full[t]).abs().max().item())
    return worst


def twin_of(model, config):
    """A model transformers alone builds from `config`, with `model`'s weights (the class of `model`:
    the causal LM of a composite config, emu3 or mllama, runs on a text config no auto class maps)."""
    twin = type(model)(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def unscaled(model):
    """`model` with the RoPE scaling its config carries (yarn, llama3...) taken off: the pretrained
    rotation a patch with original_window= is defined on (rope_ext.patching: such a patch replaces
    the checkpoint's scaling, relative to that window). The other rope_parameters stay, since some models
    read them outside the rotary module (ministral3's llama_4_scaling_beta)."""
    text = rope_config(model.config)
    # nested per layer type: the full-attention entry is the one a patch replaces (patches/probe.py)
    entry = text.rope_parameters.get("full_attention", text.rope_parameters)
    if entry.get("rope_type", "default") == "default":
        return model
    config = copy.deepcopy(model.config)
    text = rope_config(config)
    if "full_attention" in text.rope_parameters:
        text.rope_parameters = {**text.rope_parameters, "full_attention": {**entry, "rope_type": "default"}}
    else:
        text.rope_parameters = {**text.rope_parameters, "rope_type": "default"}
    return twin_of(model, config)


def rope_config(config):
    """The config holding the rope_parameters: `config`, or a composite config's text config."""
    return config if getattr(config, "rope_parameters", None) else config.get_text_config()


def equal_models(a, b) -> bool:
    return a.config.to_dict() == b.config.to_dict() and all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())
    )


def check(model, tmp_path, refusals: dict, **given) -> str | None:
    """None when `model` is patched exactly (every point of the module docstring) by each method
    that does not refuse it at patch(), else what failed; `refusals` gets each attention-side
    method's refusal. `given`: what patch() needs of a checkpoint (original_window= where its
    scaling records no window)."""
    plain = copy.deepcopy(model)
    inside, past = ids(WINDOW), ids(WINDOW + 36, seed=1)
    reference = logits(plain, inside)
    tolerance = MOE_TOLERANCE if routes(model) else 0.0

    patched = copy.deepcopy(plain)
    info = rope_ext.patch(patched, "yarn", factor=4, **given)
    if info.native is not None:
        config = copy.deepcopy(patched.config)
        del rope_config(config).rope_ext
        twin = twin_of(plain, config)
        if not torch.equal(logits(patched, past), logits(twin, past)):
            return f"yarn differs from the native twin by {(logits(patched, past) - logits(twin, past)).abs().max():.2e}"
    decode = past[:, : WINDOW + 8], WINDOW - 4
    if (decode_gap(patched, *decode) or 0.0) > DECODE_TOLERANCE:
        return "yarn: decode differs from the full forward"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched.save_pretrained(tmp_path / "yarn")
    if not torch.equal(logits(rope_ext.from_pretrained(tmp_path / "yarn").eval(), past), logits(patched, past)):
        return "yarn: the reloaded checkpoint differs"
    rope_ext.unpatch(patched)
    if not torch.equal(logits(patched, inside), reference):
        return "yarn: unpatch is not exact"

    # Extending the checkpoint as loaded, attention-side methods leave its logits inside its window;
    # replacing its scaling (original_window=), those of the trained rotation without the scaling.
    trained = logits(unscaled(plain), inside) if "original_window" in given else reference
    for method in ATTENTION_SIDE:
        patched = copy.deepcopy(plain)
        try:
            rope_ext.patch(patched, method, factor=4, **given)
        except ValueError as err:  # the method refused at patch(), before any change
            if not equal_models(patched, plain):
                return f"{method}: a refused patch changed the model"
            refusals[method] = str(err)
            continue
        gap = (logits(patched, inside) - trained).abs().max().item()
        if gap > tolerance:
            return f"{method} changes the first window's logits by {gap:.2e}"
        if (decode_gap(patched, *decode) or 0.0) > DECODE_TOLERANCE:
            return f"{method}: decode differs from the full forward"
        rope_ext.unpatch(patched)
        if not torch.equal(logits(patched, inside), reference):
            return f"{method}: unpatch is not exact"
    assert info.family == "llama" or info.family == "glm"
    return None


def census(tmp_path) -> dict[str, tuple[str, str]]:
    """model_type -> ("patched", ""), ("refused", reason key) or ("failed", what failed)."""
    results = {}
    hf_logging.disable_progress_bar()
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        model = tiny(model_type)
        if model is None:
            continue
        try:
            rope_ext.patch(copy.deepcopy(model), "yarn", factor=4)
        except Exception as err:
            reason = next((key for key, text in {**REASONS, **PATCH_REASONS}.items() if text in str(err)), None)
            listed = isinstance(err, ValueError) and reason
            results[model_type] = ("refused", reason) if listed else ("failed", f"{type(err).__name__}: {err}")
            continue
        refusals = {}
        try:
            failure = check(model, tmp_path / model_type, refusals)
        except Exception as err:  # a patched model that does not run is a failure of the census, listed
            failure = f"{type(err).__name__}: {err}"
        by_reason = {}
        for method, message in refusals.items():
            by_reason.setdefault(method_reason(message), []).append(method)
        refused = "; ".join(f"{', '.join(methods)} refused ({reason})" for reason, methods in by_reason.items())
        results[model_type] = ("failed", failure) if failure else ("patched", refused)
    return results


def method_reason(message: str) -> str:
    """The key of an attention-side method's refusal: the probe's REASONS, or the methods' own
    refusal of sliding-window layers (rope_ext.method.attention_side); else the message."""
    found = next((key for key, text in {**REASONS, **METHOD_REASONS}.items() if text in message), None)
    return found or message


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    return census(tmp_path_factory.mktemp("census"))


def test_every_rotary_causal_lm_is_patched_exactly_or_refused_with_a_listed_reason(results):
    counts = Counter(status for status, _ in results.values())
    reasons = Counter(reason for status, reason in results.values() if status == "refused")
    print(f"\ncensus of {len(results)} tiny rotary causal LMs: {dict(counts)}; refusals: {dict(reasons)}")
    for model_type, (status, detail) in results.items():
        if detail:
            print(f"  {model_type}: {status} ({detail})")
    failed = {t: detail for t, (status, detail) in results.items() if status == "failed"}
    assert not failed, failed  # no type is accepted and then inexact
    partly = {t: detail for t, (status, detail) in results.items() if status == "patched" and detail}
    unlisted = [
        d
        for d in partly.values()
        for reason in re.findall(r"refused \(([^)]*)\)", d)
        if reason not in {**REASONS, **METHOD_REASONS}
    ]
    assert not unlisted, unlisted
    assert counts["patched"] >= PATCHED


def test_the_census_builds_the_rotary_architectures(results):
    """A transformers change that stops a tiny config from building drops the type from the census
    silently: the count shows it. NOT_BUILT (census_configs) lists the rotary types not built."""
    assert len(results) >= BUILT
    assert not set(NOT_BUILT) & set(results)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma", "olmo2", "starcoder2"])
def test_llama_like_types_are_patched(model_type, results):
    assert results[model_type] == ("patched", "")
