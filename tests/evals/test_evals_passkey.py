"""Passkey retrieval: prompts fit their length with the key at its depth, an oracle scores 1.0,
a random model ~0, and bad lengths fail before any trial runs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rope_ext
from rope_ext import cli
from rope_ext.evals import passkey


@pytest.mark.parametrize("length", [160, 400])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_fits_its_length_with_the_key_at_its_depth(tiny_tokenizer, length, depth):
    p = passkey.build_prompt(tiny_tokenizer, length, depth, 31337)
    assert len(p.ids) <= length
    one_more = passkey.prompt_text(31337, p.filler_sentences + 1, depth)
    assert len(tiny_tokenizer(one_more)["input_ids"]) > length  # the longest prompt that fits
    assert p.text.startswith(passkey.TASK) and p.text.endswith(passkey.QUESTION)
    key_line = passkey.KEY_LINE.format(key=31337)
    filler = p.text[len(passkey.TASK) : -len(passkey.QUESTION)]
    where = filler.index(key_line) / (len(filler) - len(key_line))
    assert where == pytest.approx(depth, abs=0.1)


def test_too_small_a_length_fails_before_any_trial(tiny_tokenizer):
    asked = []
    with pytest.raises(ValueError, match="passkey length 40 is too small"):
        passkey.run_trials(lambda p: asked.append(p) or "", tiny_tokenizer, [40, 300], progress=False)
    assert asked == []
    assert passkey.minimum_length(tiny_tokenizer) > 40


def test_keys_are_seeded_per_cell():
    assert passkey.trial_key(0, 512, 0.5, 1) == passkey.trial_key(0, 512, 0.5, 1)
    keys = {passkey.trial_key(s, 512, 0.5, t) for s in range(3) for t in range(5)}
    assert len(keys) == 15 and all(1 <= k <= 50000 for k in keys)


def test_an_oracle_scores_one(tiny_tokenizer):
    def oracle(prompt):  # reads the key where the prompt put it
        return " " + prompt.text.split("The pass key is ")[1].split(".")[0] + ". Remember"

    result = passkey.run_trials(oracle, tiny_tokenizer, [200, 400], [0.2, 0.8], trials=3, seeds=(0, 1), progress=False)
    assert result["accuracy_overall"] == 1.0
    assert result["accuracy"] == {200: {0.2: 1.0, 0.8: 1.0}, 400: {0.2: 1.0, 0.8: 1.0}}
    assert len(result["trials"]) == 24 and {t["seed"] for t in result["trials"]} == {0, 1}


def test_the_default_grid_is_dense_over_depths_and_seeds(tiny_tokenizer):
    asked = []
    result = passkey.run_trials(lambda p: asked.append(p) or "", tiny_tokenizer, [300], progress=False)
    depths = sorted({p.depth for p in asked})
    assert len(depths) >= 19 and depths[0] <= 0.05 and depths[-1] >= 0.95
    assert max(b - a for a, b in zip(depths, depths[1:])) <= 0.05 + 1e-9  # no gap a blind band could hide in
    assert {(t["depth"], t["seed"]) for t in result["trials"]} == {(d, s) for d in depths for s in (0, 1)}
    assert len({p.key for p in asked}) > 30  # each seed draws its own keys


def test_a_random_model_scores_about_zero(tiny_tokenizer):
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    answer = passkey.model_answerer(model, tiny_tokenizer, max_new_tokens=8)
    result = passkey.run_trials(answer, tiny_tokenizer, [200, 300], [0.5], trials=4, seeds=(0,), progress=False)
    assert result["accuracy_overall"] <= 0.125
    assert all(len(r["answer"]) > 0 for r in result["trials"])  # it did generate


def test_the_markdown_lists_each_missed_key_with_its_answer():
    def trial(depth, seed, correct, answer):
        return {"length": 256, "depth": depth, "seed": seed, "trial": 0, "key": 4242, "answer": answer, "correct": correct}

    trials = [trial(0.9, 0, False, " a key | that opens\nmore"), trial(0.5, 1, True, " 4242."), trial(0.5, 0, False, "\n")]
    assert passkey.misses(trials).splitlines()[1:] == [
        "Missed keys (2), the answer's first line:",
        "",
        "| length | depth | seed | trial | key | answer |",
        "|---|---|---|---|---|---|",
        "| 256 | 0.5 | 0 | 0 | 4242 | (nothing) |",
        "| 256 | 0.9 | 0 | 0 | 4242 | `a key \\| that opens` |",
    ]
    assert passkey.misses(trials[1:2]) == ""


def test_first_integer():
    assert passkey.first_integer(" 4217. Remember it.") == 4217
    assert passkey.first_integer("no digits") is None


def test_cli_writes_json_table_and_heatmap(tiny_path, tmp_path):
    out = tmp_path / "pk"
    argv = [
        "--model",
        str(tiny_path),
        "--lengths",
        "150",
        "256",
        "--depths",
        "0.5",
        "--trials",
        "2",
        "--limit",
        "3",
        "--output",
        str(out),
        "--no-progress",
    ]
    with pytest.warns(UserWarning, match="meant for 128"):
        assert cli.call(["eval", "passkey"] + argv) == 0
    saved = json.loads((out / "passkey.json").read_text())
    assert len(saved["trials"]) == 3  # --limit: both lengths first, then the second trial of the shortest
    assert {t["length"] for t in saved["trials"]} == {150, 256}
    assert set(saved["accuracy"]) == {"150", "256"}
    assert (out / "passkey.png").stat().st_size > 1000
    assert "| length \\ depth |" in (out / "passkey.md").read_text()
    assert not (out / passkey.PARTIAL).exists()  # the finished run leaves its results only
    with pytest.raises(ValueError, match="too small"):
        cli.call(
            ["eval", "passkey"] + ["--model", str(tiny_path), "--lengths", "30", "--output", str(tmp_path / "x"), "--no-progress"]
        )
    assert not (tmp_path / "x").exists()


def test_a_stopped_run_keeps_the_trials_it_answered(tiny_path, tmp_path, monkeypatch):
    def answerer(*args, **kwargs):
        asked = []

        def answer(prompt):
            if len(asked) == 2:
                raise KeyboardInterrupt
            asked.append(prompt)
            return f" {prompt.key}."

        return answer

    monkeypatch.setattr(passkey, "model_answerer", answerer)
    out = tmp_path / "pk"
    with pytest.raises(KeyboardInterrupt):
        cli.call(
            ["eval", "passkey"]
            + [
                "--model",
                str(tiny_path),
                "--lengths",
                "120",
                "--depths",
                "0.2",
                "0.8",
                "--trials",
                "2",
                "--seeds",
                "0",
                "--max-new-tokens",
                "4",
                "--output",
                str(out),
                "--no-progress",
            ]
        )
    kept = json.loads((out / passkey.PARTIAL).read_text())
    assert [(t["depth"], t["trial"]) for t in kept["trials"]] == [(0.8, 0), (0.8, 1)]  # the deepest key is asked first
    assert kept["accuracy"] == {"120": {"0.8": 1.0}} and kept["setup"]["seconds"] >= 0
    assert not (out / "passkey.json").exists()


def test_a_resumed_run_asks_only_the_rest_and_equals_an_unstopped_one(tiny_path, tmp_path, monkeypatch):
    asked = []

    def answerer(*args, stop_after=None, **kwargs):
        def answer(prompt):
            if len(asked) == stop_after:
                raise KeyboardInterrupt
            asked.append((prompt.depth, prompt.key))
            return f" {prompt.key}." if prompt.depth > 0.5 else " 7."

        return answer

    argv = [
        "--model",
        str(tiny_path),
        "--lengths",
        "120",
        "--depths",
        "0.2",
        "0.8",
        "--trials",
        "2",
        "--seeds",
        "0",
        "--max-new-tokens",
        "4",
        "--no-progress",
    ]
    monkeypatch.setattr(passkey, "model_answerer", answerer)
    assert cli.call(["eval", "passkey"] + argv + ["--output", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "passkey.json").read_text())

    out = tmp_path / "pk"
    monkeypatch.setattr(passkey, "model_answerer", lambda *a, **k: answerer(stop_after=len(asked) + 3))
    with pytest.raises(KeyboardInterrupt):
        cli.call(["eval", "passkey"] + argv + ["--output", str(out)])
    stopped = (out / passkey.PARTIAL).read_text()
    assert len(json.loads(stopped)["trials"]) == 3

    with pytest.raises(ValueError, match="another setup \\(seeds differ"):  # checked before any trial; the partial file stays
        cli.call(["eval", "passkey"] + argv + ["--output", str(out), "--resume", "--seeds", "0", "1"])
    assert (out / passkey.PARTIAL).read_text() == stopped

    monkeypatch.setattr(passkey, "model_answerer", answerer)
    before = len(asked)
    assert cli.call(["eval", "passkey"] + argv + ["--output", str(out), "--resume"]) == 0
    last = next(t for t in whole["trials"] if (t["depth"], t["trial"]) == (0.2, 1))
    assert asked[before:] == [(0.2, last["key"])]  # only the trial the stopped run did not reach
    resumed = json.loads((out / "passkey.json").read_text())
    assert resumed["trials"] == whole["trials"] and resumed["accuracy"] == whole["accuracy"] == {"120": {"0.2": 0.0, "0.8": 1.0}}
    assert resumed["setup"]["seconds"] >= json.loads(stopped)["setup"]["seconds"]
    assert not (out / passkey.PARTIAL).exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cli.call(["eval", "passkey"] + argv + ["--output", str(tmp_path / "none"), "--resume"])


def test_kept_trials_from_another_seed_are_refused():
    key = passkey.trial_key(3, 120, 0.5, 0)
    record = {
        "length": 120,
        "depth": 0.5,
        "seed": 3,
        "trial": 0,
        "key": key,
        "answer": f" {key}.",
        "predicted": key,
        "correct": True,
    }
    assert passkey.kept_trials([record], [(120, 0.5, 3, 0)]) == {(120, 0.5, 3, 0): record}
    assert passkey.kept_trials([record], [(120, 0.2, 3, 0), (120, 0.5, 0, 0)]) == {}  # not in this grid: left out
    with pytest.raises(ValueError, match="not seed 0's"):
        passkey.kept_trials([{**record, "seed": 0}], [(120, 0.5, 0, 0)])


def test_generation_is_greedy_and_deterministic(tiny_model, tiny_tokenizer):
    answer = passkey.model_answerer(tiny_model, tiny_tokenizer, max_new_tokens=6)
    prompt = passkey.build_prompt(tiny_tokenizer, 120, 0.5, 123)
    first = answer(prompt)
    assert first == answer(prompt)
    ids = torch.tensor([prompt.ids])
    with torch.no_grad():  # the same six tokens by argmax over full forwards, without a cache
        for _ in range(6):
            ids = torch.cat((ids, tiny_model(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
            if ids[0, -1] == tiny_tokenizer.eos_token_id:
                break
    assert first == tiny_tokenizer.decode(ids[0, len(prompt.ids) :], skip_special_tokens=True)


def test_answers_prefilled_in_chunks_are_the_same(tiny_model, tiny_tokenizer):
    rope_ext.patch(tiny_model, "sink_window", factor=4, sinks=2, window=60)
    prompt = passkey.build_prompt(tiny_tokenizer, 400, 0.5, 123)
    whole = passkey.model_answerer(tiny_model, tiny_tokenizer, max_new_tokens=6)(prompt)
    assert passkey.model_answerer(tiny_model, tiny_tokenizer, max_new_tokens=6, chunk_size=64)(prompt) == whole


@pytest.mark.integration
@pytest.mark.parametrize("method", ["yarn", "self_extend"])
def test_shared_prefixes_give_the_same_answers_from_fewer_prefilled_tokens(tiny_model, tiny_tokenizer, method):
    rope_ext.patch(tiny_model, method, factor=4)
    prefilled = []
    hook = tiny_model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: prefilled.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    grid = dict(lengths=[300, 500], depths=[0.1, 0.5, 0.9], trials=2, seeds=(0,))
    try:
        alone = passkey.run_trials(
            passkey.model_answerer(tiny_model, tiny_tokenizer, max_new_tokens=6), tiny_tokenizer, **grid, progress=False
        )
        whole = sum(n for n in prefilled if n > 1)
        prefilled.clear()
        shared = passkey.run_trials(
            passkey.model_answerer(tiny_model, tiny_tokenizer, max_new_tokens=6, share_prefix=True),
            tiny_tokenizer,
            **grid,
            progress=False,
        )
    finally:
        hook.remove()
    assert [t["answer"] for t in shared["trials"]] == [t["answer"] for t in alone["trials"]]
    cells = [(t["length"], t["depth"], t["seed"], t["trial"]) for t in shared["trials"]]
    assert cells == passkey.grid([300, 500], [0.1, 0.5, 0.9], 2)
    # per length: the deepest key's prompt whole, then each other one from where it leaves that one
    expected = 0
    for length in (300, 500):
        heads = [
            passkey.build_prompt(tiny_tokenizer, length, d, passkey.trial_key(0, length, d, t)).ids[:-1]
            for d, t in sorted(((d, t) for d in (0.1, 0.5, 0.9) for t in range(2)), key=lambda c: (-c[0], c[1]))
        ]
        expected += len(heads[0]) + sum(len(h) - passkey.shared_prefix(heads[0], h) for h in heads[1:])
    assert sum(n for n in prefilled if n > 1) == expected < 0.7 * whole


def test_share_prefix_is_refused_for_a_cache_that_lets_keys_go(tiny_model, tiny_tokenizer):
    rope_ext.patch(tiny_model, "sink_window", factor=4, sinks=2, window=60)
    with pytest.raises(ValueError, match="keeps every key"):
        passkey.model_answerer(tiny_model, tiny_tokenizer, share_prefix=True)


# --resume reads a file a person may have moved, edited or cut short (issue #29).


def _stopped_run(tiny_path, out, monkeypatch, model=None, stop_after: int = 2, extra=()) -> list:
    """Run the 4-trial grid on `model` (default: the tiny model) with an oracle answerer stopped
    after `stop_after` trials (None: not stopped); the prompts it was asked."""
    asked = []

    def answerer(*args, **kwargs):
        def answer(prompt):
            if len(asked) == stop_after:
                raise KeyboardInterrupt
            asked.append(prompt)
            return f" {prompt.key}."

        return answer

    monkeypatch.setattr(passkey, "model_answerer", answerer)
    argv = [
        "--model",
        str(model or tiny_path),
        "--lengths",
        "120",
        "--depths",
        "0.2",
        "0.8",
        "--trials",
        "2",
        "--seeds",
        "0",
        "--max-new-tokens",
        "4",
        "--output",
        str(out),
        "--no-progress",
        *extra,
    ]
    if stop_after is None:
        assert cli.call(["eval", "passkey"] + argv) == 0
    else:
        with pytest.raises(KeyboardInterrupt):
            cli.call(["eval", "passkey"] + argv)
    return asked


def _copy_of_tiny(tiny_path, folder, perturb: bool = False, **config):
    """The tiny checkpoint saved again under `folder` (a folder named `model`), one norm weight
    perturbed with `perturb`, config values changed with `config`."""
    from helpers import load_llama
    from transformers import AutoTokenizer

    model = load_llama(tiny_path)
    if perturb:
        with torch.no_grad():
            model.model.norm.weight[0] += 0.01
    for key, value in config.items():
        setattr(model.config, key, value)
    path = folder / "model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(path)
    return path


@pytest.mark.parametrize("change", [{"perturb": True}, {"rms_norm_eps": 1e-3}], ids=["weights", "config"])
def test_resume_refuses_the_partial_file_of_another_checkpoint_of_the_same_name(tiny_path, tmp_path, monkeypatch, change):
    first = _copy_of_tiny(tiny_path, tmp_path / "a")
    other = _copy_of_tiny(tiny_path, tmp_path / "b", **change)
    out = tmp_path / "pk"
    _stopped_run(tiny_path, out, monkeypatch, model=first)
    stopped = (out / passkey.PARTIAL).read_text()
    with pytest.raises(ValueError, match="checkpoint_sha256 differ \\(another checkpoint"):
        _stopped_run(tiny_path, out, monkeypatch, model=other, stop_after=None, extra=["--resume"])
    assert (out / passkey.PARTIAL).read_text() == stopped and not (out / "passkey.json").exists()
    _stopped_run(tiny_path, out, monkeypatch, model=first, stop_after=None, extra=["--resume"])  # its own checkpoint resumes
    assert len(json.loads((out / "passkey.json").read_text())["trials"]) == 4


def test_resume_scores_kept_trials_from_their_answer_and_key(tiny_path, tmp_path, monkeypatch):
    out = tmp_path / "pk"
    _stopped_run(tiny_path, out, monkeypatch)
    stopped = json.loads((out / passkey.PARTIAL).read_text())
    stopped["trials"][0]["answer"] = " 7."  # edited by hand: the answer no longer holds the key, `correct` still says so
    (out / passkey.PARTIAL).write_text(json.dumps(stopped))
    _stopped_run(tiny_path, out, monkeypatch, stop_after=None, extra=["--resume"])
    result = json.loads((out / "passkey.json").read_text())
    edited = next(t for t in result["trials"] if (t["depth"], t["trial"]) == (stopped["trials"][0]["depth"], 0))
    assert edited["predicted"] == 7 and edited["correct"] is False
    assert result["accuracy_overall"] == 0.75


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda text: "", "is empty"),
        (lambda text: text[: len(text) // 2], "is not valid JSON, cut short or edited"),
        (lambda text: json.dumps({"trials": []}), "holds no 'setup' object and 'trials' list"),
        (
            lambda text: json.dumps(
                {**json.loads(text), "trials": [{k: v for k, v in t.items() if k != "key"} for t in json.loads(text)["trials"]]}
            ),
            "trial 0 has no valid key",
        ),
    ],
    ids=["empty", "truncated", "no-setup", "no-key"],
)
def test_resume_names_the_file_and_what_is_wrong_before_the_model_loads(tiny_path, tmp_path, monkeypatch, capsys, damage, words):
    from helpers import cli_error_line

    out = tmp_path / "pk"
    _stopped_run(tiny_path, out, monkeypatch)
    path = out / passkey.PARTIAL
    path.write_text(damage(path.read_text()))
    monkeypatch.setattr(passkey.loading, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    capsys.readouterr()
    line = cli_error_line(["eval", "passkey", "--lengths", "120", "--output", str(out), "--resume"], capsys)
    assert f"--resume: {path}" in line and words in line and "without --resume" in line


def test_longrope_takes_its_factor_lists_from_the_command_line_and_resumes(tiny_path, tmp_path, monkeypatch):
    """`--param long_factor=[...]`: a list value reaches the patch, the results record it, and a
    stopped run resumes (the lists compare equal after the partial file's JSON round trip)."""
    asked = []

    def answerer(*args, stop_after=None, **kwargs):
        def answer(prompt):
            if len(asked) == stop_after:
                raise KeyboardInterrupt
            asked.append(prompt.depth)
            return f" {prompt.key}."

        return answer

    short, long = [1.0 + 0.02 * i for i in range(16)], [1.0 + 0.4 * i for i in range(16)]
    argv = [
        "--model",
        str(tiny_path),
        "--method",
        "longrope",
        "--factor",
        "4",
        "--param",
        f"short_factor={short}",
        "--param",
        f"long_factor={long}".replace(" ", ""),
        "--lengths",
        "256",
        "--depths",
        "0.2",
        "0.8",
        "--trials",
        "1",
        "--seeds",
        "0",
        "--no-progress",
        "--output",
        str(tmp_path / "pk"),
    ]
    monkeypatch.setattr(passkey, "model_answerer", lambda *a, **k: answerer(stop_after=1))
    with pytest.raises(KeyboardInterrupt):
        cli.call(["eval", "passkey"] + argv)
    monkeypatch.setattr(passkey, "model_answerer", answerer)
    assert cli.call(["eval", "passkey"] + argv + ["--resume"]) == 0
    assert sorted(asked) == [0.2, 0.8]  # each trial asked once: the resumed run only the one not kept
    setup = json.loads((tmp_path / "pk" / "passkey.json").read_text())["setup"]
    assert (setup["method"], setup["params"]["short_factor"], setup["params"]["long_factor"]) == ("longrope", short, long)
