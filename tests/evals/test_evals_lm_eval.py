"""lm-eval: the rope_ext model type patches and sets max_length, and bad --model_args end in one
line; both shipped tasks run through lm-eval's own command line on the tiny trained model, and the
long-text perplexity it reports equals ours under the same windows."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch

import rope_ext
from rope_ext.evals import perplexity
from rope_ext.evals.data import Document
from rope_ext.evals.lm_eval_model import RopeExtLM, main


def test_model_type_patches_and_sets_max_length(tiny_path):
    plain = RopeExtLM(pretrained=str(tiny_path))
    assert plain.max_length == 128 and rope_ext.describe(plain.model) is None
    lm = RopeExtLM(pretrained=str(tiny_path), method="yarn", factor=2, beta_fast=16)
    assert lm.max_length == 256
    described = rope_ext.describe(lm.model)
    assert described["method"] == "yarn" and described["params"]["beta_fast"] == 16
    with pytest.raises(ValueError, match="needs a factor"):
        RopeExtLM(pretrained=str(tiny_path), method="ntk")


def test_model_args_take_longrope_factor_lists(tiny_path):
    """lm-eval's KEY=VALUE parser keeps a bracketed list whole: longrope's factors fit in --model_args."""
    short, long = [1.0 + 0.02 * i for i in range(16)], [1.0 + 0.4 * i for i in range(16)]
    text = f"pretrained={tiny_path},method=longrope,factor=4,short_factor={short},long_factor={long}".replace(" ", "")
    lm = RopeExtLM.create_from_arg_string(text)
    described = rope_ext.describe(lm.model)
    assert (described["method"], described["params"]["short_factor"], described["params"]["long_factor"]) == (
        "longrope",
        short,
        long,
    )


# Bad --model_args: one line that names the key, exit status 2, and nothing loaded or run.


@pytest.mark.integration
@pytest.mark.parametrize(
    "model_args, message",
    [
        (
            "method=nope,factor=2",
            "model_args: unknown method 'nope' (did you mean 'longrope' or 'rerope'?); valid methods: linear",
        ),
        ("method=yarn", "model_args: method 'yarn' needs a factor (the scale relative to the original window, > 1)"),
        ("method=yarn,factor=abc", "model_args: factor must be a finite number > 1 and <= 1048576, got 'abc'"),
        ("factor=2", "model_args factor=2 needs a method=<"),
        (
            "method=yarn,factor=2,beta_fst=16",
            "model_args key 'beta_fst' is not an argument of the rope_ext model type "
            "(method, factor, original_window, max_length, and yarn's ",
        ),
        ("bogus=1", "model_args key 'bogus' is not an argument"),
        ("max_length=0", "model_args max_length must be an int in [1, "),
        ("method=yarn,factor=2,original_window=abc", "model_args original_window must be an int in [1, "),
        ("dtype=nope", "model_args dtype='nope' is not a torch dtype"),
        ("attn_implementation=bogus", 'model_args: Specified `attn_implementation="bogus"` is not supported'),
    ],
)
def test_bad_model_args_end_in_one_line(tiny_path, capsys, model_args, message):
    rc = main(
        [
            "run",
            "--model",
            "rope_ext",
            "--model_args",
            f"pretrained={tiny_path},{model_args}",
            "--tasks",
            "rope_ext_passkey",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith(f"rope-ext lm-eval: error: {message}")
    assert "ModelArgsError" not in "\n".join(err)  # the error's traceback would name its class


def test_bad_model_args_from_python(tiny_path):
    with pytest.raises(ValueError, match=r"^model_args key 'beta_fst' is not an argument .*beta_fast"):
        RopeExtLM(pretrained=str(tiny_path), method="yarn", factor=2, beta_fst=16)
    assert RopeExtLM(pretrained=str(tiny_path), method="yarn", factor="2").max_length == 256


def full_windows_excerpt(tokenizer, text: str, n_tokens: int) -> str:
    """An excerpt of exactly n_tokens tokens that tokenizes back to the same tokens. lm-eval
    gives a document's last, partial window the full max_length of context; with whole windows
    only, its rolling windows are exactly non-overlapping chunks."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for start in range(200):
        piece = tokenizer.decode(ids[start : start + n_tokens])
        if tokenizer(piece, add_special_tokens=False)["input_ids"] == ids[start : start + n_tokens]:
            return piece
    raise AssertionError("no excerpt tokenizes back to itself")


@pytest.mark.integration
def test_tasks_run_through_lm_eval(tiny_path, tiny_tokenizer, tmp_path):
    from rope_ext.defaults import gutenberg_documents

    text = full_windows_excerpt(tiny_tokenizer, gutenberg_documents()["macbeth_gut"][30000:40000], 10 * 256)  # held out
    source = tmp_path / "long.txt"
    source.write_text(text)
    metadata = {"passkey_lengths": [128, 256], "passkey_depths": [0.5], "passkey_trials": 2, "longppl_path": str(source)}
    out = tmp_path / "lm_eval"
    main(
        [
            "run",
            "--model",
            "rope_ext",
            "--model_args",
            f"pretrained={tiny_path},method=yarn,factor=2",
            "--tasks",
            "rope_ext_passkey,rope_ext_longppl",
            "--metadata",
            json.dumps(metadata),
            "--output_path",
            str(out),
            "--log_samples",
        ]
    )
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]

    passkey = results["rope_ext_passkey"]
    for metric in ("exact_match", "acc_128", "acc_256"):
        assert 0.0 <= passkey[f"{metric},first_integer"] <= 1.0
    assert "acc_512,first_integer" not in passkey
    (samples_file,) = out.rglob("samples_rope_ext_passkey_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 4
    for s in samples:  # the regex filter keeps the first integer of the answer, or "[invalid]"
        (filtered,) = s["filtered_resps"]
        assert filtered == "[invalid]" or filtered.isdigit()

    # lm-eval's rolling windows: BOS + the tokens, non-overlapping max_length-token inputs, each
    # predicting the next max_length tokens: our protocol on [BOS] + ids with W = 257, S = 256.
    assert len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) == 2560
    ids = torch.tensor(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    stream = torch.cat((torch.tensor([tiny_tokenizer.bos_token_id]), ids))
    model = rope_ext.from_pretrained(tiny_path).eval()
    rope_ext.patch(model, "yarn", factor=2)
    ours = perplexity.evaluate(model, [Document("long", stream)], [257], stride=256, progress=False)[257]
    assert ours["tokens"] == len(ids)
    token_ppl = results["rope_ext_longppl"]["token_perplexity,none"]
    assert token_ppl == pytest.approx(ours["ppl"], rel=1e-4)
    assert 10 < token_ppl < 200  # a trained model on held-out text
    word_ppl = results["rope_ext_longppl"]["word_perplexity,none"]
    assert math.log(word_ppl) == pytest.approx(ours["nll"] * len(ids) / len(re.split(r"\s+", text)), rel=1e-4)


@pytest.mark.integration
def test_python_route_builds_the_tasks_for_the_evaluated_model(tiny_path, tiny_tokenizer, caplog, monkeypatch):
    """simple_evaluate with the tasks folder on a TaskManager that holds no model_args: the prompts
    follow the tiny model's tokenizer and patched max_length (256), not SmolLM2's 8192 window, and
    the per-length metrics raise no "not scored on the same number of documents" warning."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from rope_ext.evals import passkey as passkey_mod
    from rope_ext.evals.lm_eval_model import TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), metadata={"passkey_depths": [0.5], "passkey_trials": 1})
    monkeypatch.setattr(logging.getLogger("lm_eval"), "propagate", True)  # lm-eval's setup_logging turns it off
    with caplog.at_level(logging.WARNING):
        out = lm_eval.simple_evaluate(
            model="rope_ext",
            model_args=f"pretrained={tiny_path},method=yarn,factor=2",
            tasks=["rope_ext_passkey"],
            task_manager=manager,
            log_samples=True,
        )
    shortest = passkey_mod.minimum_length(tiny_tokenizer) + 10
    expected = [n for n in (64, 128, 256) if n >= shortest]
    passkey = out["results"]["rope_ext_passkey"]
    assert sorted(int(k.split(",")[0][4:]) for k in passkey if re.fullmatch(r"acc_\d+,first_integer", k)) == expected
    samples = out["samples"]["rope_ext_passkey"]
    assert [s["doc"]["length"] for s in samples] == expected
    for s in samples:
        assert len(tiny_tokenizer(s["doc"]["prompt"])["input_ids"]) <= s["doc"]["length"] - 10
    assert not [r for r in caplog.records if "not scored on the same number" in r.getMessage()]


def test_tasks_refuse_without_a_rope_ext_model(monkeypatch):
    from rope_ext.evals import lm_eval_tasks

    monkeypatch.setattr(lm_eval_tasks, "_evaluated", None)
    with pytest.raises(ValueError, match="rope_ext_passkey: .* no rope_ext model has been built"):
        lm_eval_tasks.passkey_dataset(passkey_lengths=[128])


def test_tasks_do_not_serve_a_model_built_after_the_rope_ext_one(tiny_path):
    """One process: a rope_ext model (yarn x2, max_length 256) evaluated and let go, then lm-eval's
    own hf type (max_length 128). The tasks must not build their documents for the first model."""
    from lm_eval.models.huggingface import HFLM

    from rope_ext.evals import lm_eval_tasks

    options = dict(passkey_depths=[0.5], passkey_trials=1)
    lm = RopeExtLM(pretrained=str(tiny_path), method="yarn", factor=2)
    assert lm_eval_tasks.passkey_dataset(**options)["test"]["length"][-1] == 256
    del lm
    hf = HFLM(pretrained=str(tiny_path), device="cpu")
    assert hf.max_length == 128
    with pytest.raises(ValueError, match="rope_ext_passkey: .* no rope_ext model"):
        lm_eval_tasks.passkey_dataset(**options)


@pytest.mark.integration
def test_an_hf_run_after_a_rope_ext_run_is_refused(tiny_path, tmp_path, capsys):
    """Two `rope-ext lm-eval` runs in one process, the second with lm-eval's hf type: one error
    line, not passkey prompts built for the first run's model."""
    common = ["--tasks", "rope_ext_passkey", "--metadata", json.dumps({"passkey_depths": [0.5], "passkey_trials": 1})]
    assert main(["run", "--model", "rope_ext", "--model_args", f"pretrained={tiny_path},method=yarn,factor=2", *common]) == 0
    capsys.readouterr()
    assert main(["run", "--model", "hf", "--model_args", f"pretrained={tiny_path}", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rope-ext lm-eval: error: rope_ext_passkey: ") and "no rope_ext model" in err[-1]


def test_a_length_without_documents_scores_none():
    from rope_ext.evals import lm_eval_tasks

    assert lm_eval_tasks.scored_mean([1.0, None, 0.0]) == 0.5
    assert lm_eval_tasks.scored_mean([None, None]) is None  # --limit stopped before this length


@pytest.mark.integration
def test_limit_below_the_number_of_lengths(tiny_path, tmp_path):
    """--limit 2 over three lengths: the first two lengths are scored, the third reports None."""
    metadata = {"passkey_lengths": [128, 256, 512], "passkey_depths": [0.5], "passkey_trials": 1}
    out = tmp_path / "lm_eval"
    argv = ["run", "--model", "rope_ext", "--model_args", f"pretrained={tiny_path},method=yarn,factor=4"]
    argv += ["--tasks", "rope_ext_passkey", "--limit", "2", "--metadata", json.dumps(metadata), "--output_path", str(out)]
    assert main(argv) == 0
    (results_file,) = out.rglob("results_*.json")
    passkey = json.loads(results_file.read_text())["results"]["rope_ext_passkey"]
    assert 0.0 <= passkey["acc_128,first_integer"] <= 1.0 and 0.0 <= passkey["acc_256,first_integer"] <= 1.0
    assert passkey["acc_512,first_integer"] is None


@pytest.mark.parametrize(
    "model_args, message",
    [
        ({"method": "yarn", "factor": 2, "original_window": "abc"}, "model_args original_window must be an int"),
        ({"max_length": "abc"}, "model_args max_length must be an int"),
        ({"max_length": 0}, "model_args max_length must be an int"),
        ({"dtype": "nope"}, "model_args dtype='nope' is not a torch dtype"),
        ({"device": "nope"}, "model_args device='nope' is not a device"),
        ({"batch_size": "x"}, "model_args batch_size='x' must be a whole number >= 1 or auto"),
        ({"pretrained": "/nonexistent/checkpoint"}, "model_args pretrained='/nonexistent/checkpoint': no such folder"),
    ],
)
def test_bad_model_args_are_refused_before_the_model_loads(tiny_path, monkeypatch, model_args, message):
    from lm_eval.models.huggingface import HFLM

    from rope_ext.evals.lm_eval_model import ModelArgsError

    monkeypatch.setattr(HFLM, "__init__", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ModelArgsError, match=f"^{re.escape(message)}"):
        RopeExtLM(**{"pretrained": str(tiny_path), **model_args})


@pytest.mark.parametrize("method", ["dca", "sink_window"])
def test_a_method_that_takes_one_sequence_refuses_a_batch_size_above_one(tiny_path, method):
    """lm-eval left-pads the prompts of a generation batch; these methods run one unpadded
    sequence, so batch_size > 1 would crash at the first padded batch, after the model loaded and
    the tasks were built."""
    from rope_ext.evals.lm_eval_model import ModelArgsError

    with pytest.raises(ModelArgsError, match=f"^model_args batch_size=2: {method}: positions must be those of one unpadded"):
        RopeExtLM(pretrained=str(tiny_path), method=method, factor=4, batch_size=2)
    assert RopeExtLM(pretrained=str(tiny_path), method=method, factor=4, batch_size=1).batch_size == 1
    assert RopeExtLM(pretrained=str(tiny_path), method="yarn", factor=4, batch_size=2).batch_size == 2
