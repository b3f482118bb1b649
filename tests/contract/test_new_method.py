"""A new method is one module and one registry line for the whole repository (issue #52).

HalvedMethod below is one module's worth of a method (a TwoPartMethod: keys past a neighbour window
meet the query at half their distance, SelfExtend with group 2), and the `halved` fixture is its
registry line, added for a test's duration. With nothing else naming it, the command line lists
it, answers its name before torch loads and patches a checkpoint with it; the catalog describes
it; the registry's and the attention-side contract's checks run over it and pass.

The catalog the command line reads without torch is generated from the registry (rope_ext.catalog):
the shipped one is the registry's listing, and with a method added it is not, which it says with
the command that writes it anew; once written, the command line answers from it."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import test_architecture as architecture
import test_attention_methods as attention_contract
import torch

import rope_ext
from rope_ext import catalog, cli, names
from rope_ext.method import REGISTRY
from rope_ext.method.attention_side import TwoPartMethod
from rope_ext.method.base import Param

from helpers import load_llama, logits, random_ids, random_model

NAME = "halved"


@dataclass(frozen=True)
class HalvedMethod(TwoPartMethod):
    """i - j < W: positions (i, j); else (floor(i/2) + W - floor(W/2), floor(j/2))."""

    def distant_query(self, q_pos: torch.Tensor, params: dict) -> torch.Tensor:
        window = params["window"]
        return torch.div(q_pos, 2, rounding_mode="floor") + (window - window // 2)

    def distant_key(self, k_pos: torch.Tensor, params: dict) -> torch.Tensor:
        return torch.div(k_pos, 2, rounding_mode="floor")


METHOD = HalvedMethod(
    NAME,
    "keys past a neighbour window at half their distance",
    "i-j < W: (i, j); else (floor(i/2) + W - floor(W/2), floor(j/2)); one softmax",
    params=(Param("window", 24, "size", lo=1, doc="W: keys within W tokens keep their positions"),),
)


@pytest.fixture
def halved(monkeypatch) -> str:
    """The method's registry line."""
    monkeypatch.setitem(REGISTRY, NAME, METHOD)
    return NAME


@pytest.fixture
def regenerated(halved, monkeypatch) -> str:
    """The registry with the method, and the catalog `python -m rope_ext.catalog` then writes."""
    assert catalog.stale(rope_ext.methods()).endswith(f"run `{catalog.REGENERATE}`")
    written = json.loads(catalog.rendered(rope_ext.methods()))
    monkeypatch.setattr(names, "catalog", lambda: written)
    return halved


def test_the_shipped_catalog_is_the_registry_s_listing():
    assert (why := catalog.stale(rope_ext.methods())) is None, why


def test_the_command_line_lists_and_knows_the_new_method(regenerated, capsys):
    assert cli.main(["methods"]) == 0
    assert f"\n{NAME:13} dynamic  keys past a neighbour window" in "\n" + capsys.readouterr().out
    assert cli.main(["methods", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert list(listed) == [*names.registered()] and listed[NAME]["params"] == {"factor": None, "window": 24}
    assert names.unknown_method(NAME) is None
    assert "did you mean 'halved'" in names.unknown_method("halvd")


def test_the_command_line_patches_a_checkpoint_with_the_new_method(regenerated, tmp_path, capsys):
    """`rope-ext patch` writes the patch into a checkpoint's config, which rope_ext.from_pretrained
    reloads as the patched model; a misspelt name is answered before the model loads."""
    random_model().save_pretrained(tmp_path / "src")
    argv = ["patch", str(tmp_path / "src"), str(tmp_path / "out"), "--factor", "4"]
    assert cli.main([*argv, "--method", "halvd"]) == 2
    assert "did you mean 'halved'" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert cli.main([*argv, "--method", NAME]) == 0
    assert "unpatched" in capsys.readouterr().out  # no engine has it
    x = random_ids(150, seed=1)
    reloaded = rope_ext.from_pretrained(tmp_path / "out").eval()
    patched = random_model()
    rope_ext.patch(patched, NAME, factor=4)
    assert reloaded.config.rope_ext["method"] == NAME
    assert torch.equal(logits(reloaded, x), logits(patched, x))


def test_the_registry_s_contract_holds_over_the_new_method(halved):
    architecture.test_every_registered_method_is_a_method_with_the_declared_parts()
    architecture.test_one_check_decides_whether_a_method_runs_on_a_model()


def test_the_attention_side_contract_refuses_what_the_new_method_cannot_run_on(halved):
    row = attention_contract.row_of(NAME)
    assert (row.inside, row.unpadded) == ([{"factor": 4}], False)
    attention_contract.test_other_backends_are_refused(NAME)
    attention_contract.test_a_static_cache_is_refused(NAME)
    attention_contract.test_a_missing_factor_changes_nothing(NAME)
    attention_contract.test_an_unknown_parameter_changes_nothing(NAME)


def test_the_attention_side_contract_holds_over_the_new_method(halved, tiny_path, heldout_ids, tmp_path, monkeypatch):
    """Each case of tests/contract/test_attention_methods.py on the tiny trained model, as its
    parametrization would run it for a registered method without a row."""
    contract, row = attention_contract, attention_contract.row_of(NAME)
    ids = heldout_ids[None, : contract.LENGTH]
    for params in row.inside:
        contract.test_inside_the_window_it_is_the_unpatched_model_bit_for_bit(load_llama(tiny_path), ids, NAME, params, "sdpa")
        contract.test_decoding_inside_the_window_is_the_unpatched_models_bit_for_bit(load_llama(tiny_path), ids, NAME, params)
    for params in row.cached:
        contract.test_chunked_prefill_and_decoding_equal_one_forward(load_llama(tiny_path), ids, NAME, params, "sdpa")
    for params in row.decode_step:
        contract.test_a_decode_step_past_the_window_rotates_only_its_new_keys(
            load_llama(tiny_path), heldout_ids, monkeypatch, NAME, params, "sdpa"
        )
    for params in row.saved:
        contract.test_save_reload_and_unpatch(load_llama(tiny_path), ids, tmp_path / "saved", NAME, params)
    contract.test_switching_to_a_backend_it_cannot_run_on_is_refused_and_nothing_changes(load_llama(tiny_path), ids, NAME)
    for end in (90, 300):
        contract.test_kept_rotated_keys_follow_crops_copies_reorders_and_repeats(
            load_llama(tiny_path), heldout_ids, NAME, {"factor": 4}, end
        )
