"""The AttentionMethod base (rope_ext.method.attention_side): the parameters each attention-side
method lists are the ones it takes, and records written when every such method listed the
causal schedule still reload to the same patch."""

import dataclasses

import pytest
import torch

import rope_ext
from rope_ext import record
from rope_ext.method import REGISTRY
from rope_ext.method.attention_side import AttentionMethod, TwoPartMethod

from helpers import random_model

ATTENTION_SIDE = sorted(name for name, method in REGISTRY.items() if isinstance(method, AttentionMethod))
# the causal schedule's parameters as every method that keeps keys before rotation recorded them
OLD_SCHEDULE = {"causal": True, "granularity": 1}


def test_every_attention_side_method_is_registered_through_the_base():
    """Every method that computes attention itself is an AttentionMethod (these six among them, and
    a new one too)."""
    assert ATTENTION_SIDE == sorted(name for name, method in REGISTRY.items() if method.requires.own_attention)
    assert {"dca", "dpe", "rerope", "self_extend", "sink_window", "string"} <= set(ATTENTION_SIDE)
    assert {name for name in ATTENTION_SIDE if isinstance(REGISTRY[name], TwoPartMethod)} >= {
        "dpe",
        "rerope",
        "self_extend",
        "string",
    }
    for name in ATTENTION_SIDE:
        method = REGISTRY[name]
        assert method.dynamic and not method.follows_length and method.needs_attention_interface


@pytest.mark.parametrize(
    "name, causal",
    [("self_extend", True), ("rerope", True), ("dca", True), ("sink_window", False), ("string", False), ("dpe", False)],
)
def test_listed_parameters_are_the_ones_a_method_takes(name, causal):
    listed = rope_ext.methods()[name]["params"]
    assert "granularity" not in listed
    assert ("causal" in listed) is causal


@pytest.mark.parametrize(
    "name, params",
    [
        ("self_extend", {"group": 3, "window": 16, **OLD_SCHEDULE, "logn": False}),
        ("rerope", {"window": 16, "leak": 4, **OLD_SCHEDULE, "logn": False}),
        ("dca", {"chunk_size": 48, "local_size": 4, **OLD_SCHEDULE, "logn": False}),
        ("sink_window", {"sinks": 4, "window": 40, **OLD_SCHEDULE}),
    ],
)
def test_a_record_with_the_old_parameter_set_reloads_to_the_same_patch(tmp_path, name, params):
    ids = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(0))
    model = random_model("llama")
    taken = {k: v for k, v in params.items() if k in rope_ext.methods()[name]["params"]}
    info = rope_ext.patch(model, name, factor=2.5 if name in ("dca", "sink_window") else None, **taken)
    assert set(info.params) == set(rope_ext.methods()[name]["params"]) - {"factor"}
    with torch.no_grad():
        expected = model(ids).logits
    saved = record.read(model.config)
    # the record as written before the base: every old key back in its params
    record.write(model.config, dataclasses.replace(saved, params={**saved.params, **params}))
    model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path)
    assert rope_ext.describe(reloaded)["params"] == info.params
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("dca", {"granularity": 4}, "granularity does not apply"),
        ("sink_window", {"granularity": 4}, "causal and granularity do not apply"),
        ("self_extend", {"group": 3, "granularity": 2}, "granularity does not apply"),
        ("self_extend", {"group": 4, "granularity": 4}, "granularity does not apply"),
        ("rerope", {"granularity": 4}, "granularity does not apply"),
        ("sink_window", {"causal": False}, "causal and granularity do not apply"),
    ],
)
def test_an_old_schedule_parameter_away_from_its_default_is_refused(tmp_path, name, params, message):
    """Read where records are read (rope_ext.record.migrated): a config record and a fine-tune record."""
    model = random_model("llama")
    rope_ext.patch(model, name, factor=2, **{k: v for k, v in params.items() if k in rope_ext.methods()[name]["params"]})
    saved = record.read(model.config)
    record.write(model.config, dataclasses.replace(saved, params={**saved.params, **params}))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"config.json: key rope_ext.params: {name}: {message}"):
        rope_ext.from_pretrained(tmp_path)
    record.write_finetune(tmp_path, "smollm2", dataclasses.replace(saved, params={**saved.params, **params}))
    with pytest.raises(ValueError, match=f"rope_ext_finetune.json: key patch.params: {name}: {message}"):
        record.read_finetune(tmp_path)
    # the patch's own parameters take no schedule they do not apply
    with pytest.raises(ValueError, match="unknown parameter"):
        rope_ext.patch(random_model("llama"), name, factor=2, **params)


def test_a_fine_tune_record_with_the_old_parameter_set_reads_in_todays_terms(tmp_path):
    saved = record.Patch("self_extend", 2.0, {"group": 3, "window": 16, **OLD_SCHEDULE}, {"original_window": 64})
    record.write_finetune(tmp_path, "smollm2", saved)
    assert record.read_finetune(tmp_path)[1].params == {"group": 3, "window": 16, "causal": True}
