"""`rope-ext lm-eval` with bad --model_args: one line that names the key, exit status 2, and
nothing loaded or run."""

from __future__ import annotations

import pytest

from rope_ext.evals.lm_eval_model import RopeExtLM, main


@pytest.mark.parametrize("model_args, message", [
    ("method=nope,factor=2", "model_args: unknown method 'nope'; valid methods: linear"),
    ("method=yarn", "model_args: method 'yarn' needs a factor (the scale relative to the original window, > 1)"),
    ("method=yarn,factor=abc", "model_args: factor must be a finite number > 1 and <= 1048576, got 'abc'"),
    ("factor=2", "model_args factor=2 needs a method=<"),
    ("method=yarn,factor=2,beta_fst=16", "model_args key 'beta_fst' is not an argument of the rope_ext model type "
                                         "(method, factor, original_window, max_length, and yarn's "),
    ("bogus=1", "model_args key 'bogus' is not an argument"),
])
def test_bad_model_args_end_in_one_line(tiny_path, capsys, model_args, message):
    rc = main(["run", "--model", "rope_ext", "--model_args", f"pretrained={tiny_path},{model_args}",
               "--tasks", "rope_ext_passkey", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith(f"rope-ext lm-eval: error: {message}")
    assert "ModelArgsError" not in "\n".join(err)  # the error's traceback would name its class


def test_bad_model_args_from_python(tiny_path):
    with pytest.raises(ValueError, match=r"^model_args key 'beta_fst' is not an argument .*beta_fast"):
        RopeExtLM(pretrained=str(tiny_path), method="yarn", factor=2, beta_fst=16)
    assert RopeExtLM(pretrained=str(tiny_path), method="yarn", factor="2").max_length == 256
