"""`rope-ext search` (issue #27, docs/search.md): LongRoPE's evolutionary search of per-pair
factors scored by the answer loss of passkey needles, on the tiny trained model: its result beats
YaRN on held-out needles, its checkpoint is transformers' own longrope and reloads, every
evaluation is logged and a resumed search is the uninterrupted one."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import rope_ext
from rope_ext import cli
from rope_ext.geometry import RotaryGeometry
from rope_ext.tuning.search import BEST, CHECKPOINT, FIGURE, LOG, answer_loss, needles, read_log
from rope_ext.tuning.search_space import build

from helpers import cli_error_line, load_llama


def search(tiny_path, out, *extra) -> list[str]:
    argv = ["search", "--model", str(tiny_path), "--factor", "4", "--output", str(out), "--dtype", "float32"]
    return argv + ["--needle", "words", "--no-progress", *extra]


def logged(out) -> list[dict]:
    return [json.loads(line) for line in (out / LOG).read_text().splitlines()[1:]]


@pytest.mark.integration
def test_the_result_beats_yarn_on_held_out_needles_and_reloads(tiny_path, tiny_tokenizer, tmp_path):
    out = tmp_path / "search"
    argv = search(tiny_path, out, "--budget-minutes", "20", "--generations", "4", "--population", "8", "--samples", "8")
    assert cli.main(argv) == 0
    best = json.loads((out / BEST).read_text())
    records = logged(out)
    assert len(records) == best["evaluations"] and min(r["loss"] for r in records) == best["loss"]
    assert best["loss"] < best["seed_losses"]["yarn"]
    assert best["reload"]["tokens"] == 128 + 64 and best["reload"]["max_abs_delta"] <= 1e-5
    assert best["provenance"]["dtype"] == "float32" and best["provenance"]["model"] == str(tiny_path)
    assert (out / FIGURE).read_bytes().startswith(b"\x89PNG")

    held_out = needles(tiny_tokenizer, 512, 10, seed=1000, needle="words")
    yarn = load_llama(tiny_path)
    rope_ext.patch(yarn, "yarn", factor=4)
    found = rope_ext.from_pretrained(out / CHECKPOINT, dtype=torch.float32).eval()
    assert answer_loss(found, held_out) < answer_loss(yarn, held_out)

    config = json.loads((out / CHECKPOINT / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "longrope"
    assert config["rope_parameters"]["long_factor"] == best["long_factor"]
    assert config["max_position_embeddings"] == 512
    causal, single = load_llama(tiny_path), load_llama(tiny_path)
    rope_ext.patch(causal, "longrope", factor=4, long_factor=best["long_factor"])
    rope_ext.patch(single, "longrope", factor=4, long_factor=best["long_factor"], causal=False)
    plain = AutoModelForCausalLM.from_pretrained(out / CHECKPOINT, dtype=torch.float32).eval()
    ids = held_out[0].ids
    with torch.no_grad():
        assert (found(ids).logits - causal(ids).logits).abs().max() <= 1e-5
        assert (plain(ids).logits - single(ids).logits).abs().max() <= 1e-5


def test_every_evaluation_is_logged_and_a_resumed_search_is_the_uninterrupted_one(tiny_path, tmp_path):
    small = ["--population", "4", "--samples", "1", "--length", "200", "--budget-minutes", "10"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert cli.main(search(tiny_path, whole, *small, "--generations", "3")) == 0
    assert cli.main(search(tiny_path, split, *small, "--generations", "1")) == 0
    assert len(logged(split)) == 4  # yarn, pi, ntk and one mutation of yarn
    assert cli.main(search(tiny_path, split, *small, "--generations", "3", "--resume")) == 0
    strip = lambda records: [{k: v for k, v in r.items() if k != "seconds"} for r in records]  # noqa: E731
    assert strip(logged(split)) == strip(logged(whole))
    assert [r["origin"] for r in logged(whole)[:3]] == ["yarn", "pi", "ntk"]
    assert {r["generation"] for r in logged(whole)} == {0, 1, 2}
    assert json.loads((split / BEST).read_text())["long_factor"] == json.loads((whole / BEST).read_text())["long_factor"]


def test_the_budget_stops_the_search_between_evaluations(tiny_path, tmp_path):
    out = tmp_path / "out"
    argv = search(tiny_path, out, "--population", "4", "--samples", "1", "--length", "200", "--budget-minutes", "0.00001")
    assert cli.main(argv) == 0
    assert len(logged(out)) == 1  # the budget is checked before each evaluation; the first one runs out of it


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--factor", "1"], "factor must be a finite number > 1"),
        (["--budget-minutes", "0"], "--budget-minutes must be a positive number"),
        (["--population", "1"], "--population must be an int in [2,"),
        (["--samples", "0"], "--samples must be an int in [1,"),
        (["--resume"], "search.jsonl does not exist; start the search without --resume"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_loads(no_model, tmp_path, capsys, extra, message):
    argv = ["search", "--model", str(tmp_path), "--factor", "4", "--budget-minutes", "1", "--output", str(tmp_path / "o")]
    (tmp_path / "config.json").write_text("{}")
    assert message in cli_error_line(argv + extra, capsys)


def test_an_existing_log_needs_resume_and_the_same_settings(no_model, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / "o"
    out.mkdir()
    argv = ["search", "--model", str(tmp_path), "--factor", "4", "--budget-minutes", "1", "--output", str(out)]
    setup = {"model": str(tmp_path), "factor": 4.0, "length": None, "samples": 4, "needle": "digits", "seed": 0}
    setup |= {"population": 16, "dtype": "auto", "original_window": None, "depths": "spread"}
    (out / LOG).write_text(json.dumps({"setup": setup}) + "\n")
    assert "exists; pass --resume" in cli_error_line(argv, capsys)
    assert "other settings (seed)" in cli_error_line(argv + ["--resume", "--seed", "3"], capsys)


@pytest.mark.parametrize("earlier", [BEST, CHECKPOINT])
def test_an_earlier_result_without_its_log_is_not_overwritten(no_model, tmp_path, capsys, earlier):
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / "o"
    (out / CHECKPOINT).mkdir(parents=True) if earlier == CHECKPOINT else out.mkdir()
    if earlier == BEST:
        (out / BEST).write_text("{}")
    argv = ["search", "--model", str(tmp_path), "--factor", "4", "--budget-minutes", "1", "--output", str(out)]
    assert f"holds {earlier} of an earlier search but no {LOG} to resume" in cli_error_line(argv, capsys)


def test_a_checkpoint_path_that_is_a_file_is_refused_before_any_evaluation(no_model, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / "o"
    out.mkdir()
    (out / CHECKPOINT).write_text("")
    argv = ["search", "--model", str(tmp_path), "--factor", "4", "--budget-minutes", "1", "--output", str(out)]
    assert "is a file, where the search writes its checkpoint folder" in cli_error_line(argv, capsys)


def test_a_length_inside_the_window_is_refused_before_any_evaluation(tiny_path, tmp_path, capsys):
    """Inside the window longrope uses its short factors: every candidate would score alike."""
    argv = search(tiny_path, tmp_path / "o", "--budget-minutes", "1", "--length", "128")
    assert cli.main(argv) == 1
    assert "is inside the model's 128-token window" in capsys.readouterr().err
    assert not (tmp_path / "o" / LOG).exists()


RECORD = {"evaluation": 0, "generation": 0, "origin": "yarn", "long_factor": [1.0, 2.0], "loss": 0.5}


def test_a_log_cut_mid_write_resumes_from_its_complete_lines(tmp_path):
    log = tmp_path / LOG
    lines = [json.dumps({"setup": {"seed": 0}}), json.dumps(RECORD), json.dumps({**RECORD, "evaluation": 1})]
    log.write_text("\n".join(lines) + "\n" + lines[2][:17])
    with pytest.warns(UserWarning, match="the last line of .* was cut mid-write; resuming from the 2 complete"):
        setup, records = read_log(log)
    # a setup written before spaces is longrope's, scored on needles at DEPTHS in turn
    assert setup == {"seed": 0, "space": "longrope", "temperature": False, "groups": None, "depths": "cycled"}
    assert [r["evaluation"] for r in records] == [0, 1]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("not json at all", "line 2 is not JSON"),
        (json.dumps({k: v for k, v in RECORD.items() if k != "loss"}), "line 2 is not an evaluation (no loss)"),
    ],
)
def test_a_damaged_log_is_refused_naming_the_line(no_model, tmp_path, capsys, damage, message):
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / "o"
    out.mkdir()
    argv = ["search", "--model", str(tmp_path), "--factor", "4", "--budget-minutes", "1", "--output", str(out), "--resume"]
    setup = {"model": str(tmp_path), "factor": 4.0, "length": None, "samples": 4, "needle": "digits", "seed": 0}
    setup = {**setup, "population": 16, "dtype": "auto", "original_window": None}
    (out / LOG).write_text("\n".join([json.dumps({"setup": setup}), damage, json.dumps(RECORD)]) + "\n")
    assert message in cli_error_line(argv, capsys)


def grown(space, rounds: int = 50) -> list[dict]:
    """The seeds of `space` and `rounds` mutations and crossovers of what was found so far."""
    rng = random.Random(0)
    found = list(space.seeds.values())
    for _ in range(rounds):
        found.append(space.mutate(rng.choice(found), rng))
        found.append(space.crossover(rng.choice(found), rng.choice(found), rng))
    return found


def test_candidates_stay_in_the_search_space():
    """Non-decreasing, in [1, 1.25 s], on the 0.01 grid: the seeds, mutations and crossovers."""
    space = build("longrope", RotaryGeometry(64, 10000.0, 8192), 4.0, 32768, temperature=False, groups=8)
    for candidate in grown(space):
        factors = candidate["long_factor"]
        assert len(factors) == 32
        assert all(a <= b for a, b in zip(factors, factors[1:]))
        assert 1.0 <= factors[0] and factors[-1] <= 5.0
        assert all(math.isclose(v * 100, round(v * 100), abs_tol=1e-9) for v in factors)
    start = space.seeds
    assert list(start) == ["yarn", "pi", "ntk"]
    assert start["pi"]["long_factor"] == [4.0] * 32
    assert start["yarn"]["long_factor"][0] == 1.0 and start["yarn"]["long_factor"][-1] == 4.0
    assert space.dimensions[0].legal([0.5, 3.0, 2.0, 9.0]) == [1.0, 3.0, 3.0, 5.0]


def test_the_new_spaces_keep_their_candidates_legal_and_seed_the_published_settings():
    """dpe: 8 powers of two in [1, 4 x the uniform reach scale], in any order; string: whole
    shifts in (local, N/2]; the temperature on its 0.01 grid in [0, 0.5]; each space's first seed
    is the method's default or the published setting."""
    geometry = RotaryGeometry(128, 500000.0, 8192)  # Llama-3-8B's shape
    dpe = build("dpe", geometry, 16.0, 131072, temperature=False, groups=8)
    # at the authors' own length the preset is their published scales, and the uniform one 32
    assert dpe.seeds == {"uniform": {"scales": [32] * 8}, "preset": {"scales": [4, 4, 2, 16, 32, 32, 16, 128]}}
    assert dpe.fixed == {"window": 1024}
    orders = set()
    for candidate in grown(dpe):
        scales = candidate["scales"]
        assert len(scales) == 8 and all(1 <= s <= 128 and s & (s - 1) == 0 for s in scales)
        orders.add(scales == sorted(scales))
    assert orders == {True, False}
    string = build("string", geometry, 4.0, 32768, temperature=False, groups=8)
    assert list(string.seeds.values())[0] == {"shift": int(0.33 * 32768)} and string.fixed == {"local": 128}
    shifts = {c["shift"] for c in grown(string)}
    assert all(isinstance(s, int) and 128 < s <= 16384 for s in shifts) and len(shifts) > 10
    tempered = build("self_extend", geometry, 4.0, 32768, temperature=True, groups=8)
    assert [d.name for d in tempered.dimensions] == ["group", "attn_scale"]
    assert tempered.seeds["authors+scout"]["attn_scale"] == 0.1
    assert all(s["attn_scale"] == 0.0 for name, s in tempered.seeds.items() if name != "authors+scout")
    temperatures = {c["attn_scale"] for c in grown(tempered)}
    assert all(0.0 <= t <= 0.5 and t == round(t, 2) for t in temperatures) and len(temperatures) > 5
    with pytest.raises(ValueError, match="--groups 3 does not divide"):
        build("dpe", geometry, 4.0, 32768, temperature=False, groups=3)


def test_a_dpe_search_writes_a_rope_ext_checkpoint_that_restores_its_logits(tiny_path, tiny_tokenizer, tmp_path):
    out = tmp_path / "dpe"
    argv = search(tiny_path, out, "--space", "dpe", "--budget-minutes", "5", "--generations", "2", "--population", "4")
    assert cli.main(argv + ["--samples", "2"]) == 0
    best = json.loads((out / BEST).read_text())
    records = logged(out)
    assert [r["origin"] for r in records[:2]] == ["uniform", "preset"] and all("scales" in r for r in records)
    assert best["space"] == "dpe" and min(r["loss"] for r in records) == best["loss"]
    assert best["reload"]["loader"] == "rope_ext.from_pretrained" and best["reload"]["max_abs_delta"] == 0
    config = json.loads((out / CHECKPOINT / "config.json").read_text())
    assert config["rope_ext"]["method"] == "dpe" and config["rope_ext"]["params"]["scales"] == best["scales"]
    patched = load_llama(tiny_path)
    rope_ext.patch(patched, "dpe", factor=4, scales=best["scales"], window=16)
    restored = rope_ext.from_pretrained(out / CHECKPOINT, dtype=torch.float32).eval()
    held_out = needles(tiny_tokenizer, 512, 10, seed=1000, needle="words")
    ids = held_out[0].ids
    with torch.no_grad():
        assert torch.equal(restored(ids).logits, patched(ids).logits)
        assert not torch.equal(restored(ids).logits, load_llama(tiny_path)(ids).logits)
    # the held-out check: the searched scales against dpe's default (one group, SelfExtend's reach)
    default = load_llama(tiny_path)
    rope_ext.patch(default, "dpe", factor=4)
    assert answer_loss(restored, held_out) < answer_loss(default, held_out)


def test_a_string_search_resumes_exactly_and_a_tempered_one_records_its_temperature(tiny_path, tmp_path):
    small = ["--population", "4", "--samples", "1", "--length", "200", "--budget-minutes", "10", "--space", "string"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert cli.main(search(tiny_path, whole, *small, "--generations", "3")) == 0
    assert cli.main(search(tiny_path, split, *small, "--generations", "1")) == 0
    assert cli.main(search(tiny_path, split, *small, "--generations", "3", "--resume")) == 0
    strip = lambda records: [{k: v for k, v in r.items() if k != "seconds"} for r in records]  # noqa: E731
    assert strip(logged(split)) == strip(logged(whole)) and {r["generation"] for r in logged(whole)} == {0, 1, 2}
    assert len({r["shift"] for r in logged(whole)}) == len(logged(whole))

    tempered = tmp_path / "tempered"
    argv = ["--population", "4", "--samples", "1", "--length", "200", "--budget-minutes", "10", "--generations", "2"]
    assert cli.main(search(tiny_path, tempered, *argv, "--space", "self_extend", "--temperature")) == 0
    best = json.loads((tempered / BEST).read_text())
    assert {r["attn_scale"] for r in logged(tempered)} > {0.0, 0.1}
    config = json.loads((tempered / CHECKPOINT / "config.json").read_text())
    assert config["rope_ext"]["params"]["attn_scale"] == best["attn_scale"]
    assert config["rope_ext"]["params"]["group"] == best["group"] and best["reload"]["max_abs_delta"] == 0


def test_a_resume_refuses_a_log_of_another_space_and_a_temperature_the_method_does_not_take(no_model, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / "o"
    out.mkdir()
    argv = ["search", "--model", str(tmp_path), "--factor", "4", "--budget-minutes", "1", "--output", str(out)]
    setup = {"model": str(tmp_path), "factor": 4.0, "length": None, "samples": 4, "needle": "digits", "seed": 0}
    setup = {
        **setup,
        "population": 16,
        "dtype": "auto",
        "original_window": None,
        "space": "dpe",
        "temperature": False,
        "depths": "spread",
    }
    (out / LOG).write_text(json.dumps({"setup": {**setup, "groups": 8}}) + "\n")
    before = (out / LOG).read_text()
    assert "is a search of the dpe space, not longrope; give --space dpe" in cli_error_line(argv + ["--resume"], capsys)
    assert "is a search of the dpe space, not string" in cli_error_line(argv + ["--resume", "--space", "string"], capsys)
    assert "other settings (groups)" in cli_error_line(argv + ["--resume", "--space", "dpe", "--groups", "4"], capsys)
    assert (out / LOG).read_text() == before and sorted(p.name for p in out.iterdir()) == [LOG]
    refused = cli_error_line(argv + ["--space", "dpe", "--temperature", "--output", str(tmp_path / "t")], capsys)
    assert "--temperature: dpe does not take the query temperature; the spaces whose method does: self_extend" in refused
    assert not (tmp_path / "t").exists()
    refused = cli_error_line(argv + ["--space", "string", "--groups", "4", "--output", str(tmp_path / "g")], capsys)
    assert "--groups applies to --space dpe (its scales, one per group), not string" in refused
    assert not (tmp_path / "g").exists()


def test_needles_spread_over_the_whole_prompt(tiny_tokenizer):
    """Each of n needles sits in its own n-th of the prompt, so a position map that cannot read
    from one band of the prompt is scored there once the slices are narrower than the band; five
    fixed depths with two samples scored 0.1 and 0.3 only."""
    found = needles(tiny_tokenizer, 600, 8, seed=0, needle="words")
    keys = []
    for index, needle in enumerate(found):
        assert index / 8 < needle.depth < (index + 1) / 8
        text = tiny_tokenizer.decode(needle.ids[0])
        keys.append(text.index("The pass key is") / len(text))
    assert keys == sorted(keys) and keys[0] < 0.2 and keys[-1] > 0.8
    assert max(b - a for a, b in zip(keys, keys[1:])) < 0.15


@pytest.mark.parametrize("method, params", [("dpe", {}), ("self_extend", {}), ("dynamic", {"causal": False})])
def test_the_answer_loss_from_shared_prefixes_is_that_of_whole_prompts(tiny_model, tiny_tokenizer, method, params):
    """The prompts after the deepest key's run from their own key on, from its cache cut there:
    the loss of whole prompts, from fewer tokens; a patch whose cache cannot be cut (a dynamic
    one with causal=False, as longrope is scored) runs every prompt whole."""
    rope_ext.patch(tiny_model, method, factor=4, **params)
    prompts = needles(tiny_tokenizer, 500, 4, seed=0, needle="words")
    ran = []
    hook = tiny_model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: ran.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        shared = answer_loss(tiny_model, prompts)
        alone = sum(answer_loss(tiny_model, [p]) for p in prompts) / len(prompts)
    finally:
        hook.remove()
    assert shared == pytest.approx(alone, rel=1e-5, abs=1e-6)
    whole = sum(p.ids.shape[1] for p in prompts)
    assert sum(ran[: len(prompts)]) == whole if method == "dynamic" else sum(ran[: len(prompts)]) < 0.7 * whole


def test_a_log_scored_on_needles_in_turn_is_not_resumed_with_spread_ones(no_model, tmp_path, capsys):
    """A log written before the needles spread over the prompt scored other prompts: its losses
    do not compare with new ones, so --resume refuses it, naming the setting."""
    out = tmp_path / "search"
    out.mkdir()
    setup = {"model": None, "factor": 4.0, "length": None, "samples": 4, "needle": "digits", "seed": 0, "population": 16}
    setup |= {"dtype": "auto", "original_window": None, "space": "longrope", "temperature": False, "groups": None}
    (out / LOG).write_text(json.dumps({"setup": setup}) + "\n")
    argv = ["search", "--factor", "4", "--budget-minutes", "1", "--output", str(out), "--resume"]
    assert cli.main(argv) == 2
    assert "other settings (depths)" in capsys.readouterr().err
