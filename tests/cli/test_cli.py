"""The command lines' conventions (issue #16): --version and env, exit codes, imports only for the
command that runs, --no-progress, every argument checked before a model loads (issue #15), and the
fine-tune recipe's flags and defaults."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import transformers
from transformers.utils import logging as transformers_logging

import rope_ext
from rope_ext import cli
from rope_ext.commands import env
from rope_ext import loading
from rope_ext.training.config import DEFAULTS, FLAGS, parse_args
from rope_ext.training.distributed import choose_precision

from helpers import cli_error_line


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"rope-ext {env.version('rope-ext')}"


def test_env_names_versions_device_and_threads(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for name in env.PACKAGES:
        assert name in out
    assert torch.__version__ in out and transformers.__version__ in out
    assert f"threads       {torch.get_num_threads()}" in out
    assert "avx512-bf16" in out and ("cuda:0" in out if torch.cuda.is_available() else "cuda          not available" in out)


def test_usage_errors_exit_2_and_failures_exit_1(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval", "ppl"])  # argparse: --lengths is required
    assert exit_.value.code == 2
    assert cli.main(["eval", "ppl", "--lengths", "64", "--method", "nope", "--output", str(tmp_path / "a")]) == 2
    assert "rope-ext eval ppl: error: unknown method 'nope'" in capsys.readouterr().err

    def fails(*args, **kwargs):
        raise ValueError("the hub is unreachable")

    monkeypatch.setattr(loading, "load_model", fails)
    assert cli.main(["eval", "ppl", "--lengths", "64", "--output", str(tmp_path / "b")]) == 1
    assert capsys.readouterr().err.strip() == "rope-ext eval ppl: failed: the hub is unreachable"


@pytest.mark.slow  # spawns an interpreter
@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_help_answers_without_torch(command):
    code = (
        "import sys\nfrom rope_ext import cli\n"
        f"try:\n    cli.main({command.split() + ['--help']!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'lm_eval', 'peft')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage: rope-ext" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow  # spawns an interpreter
@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_top_level_help_and_version_start_without_torch(argv):
    code = (
        "import sys\nfrom rope_ext import cli\n"
        f"try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False False"


@pytest.mark.slow  # spawns an interpreter
@pytest.mark.parametrize("argv", [["methods"], ["methods", "--json"]])
def test_methods_answers_without_torch(argv):
    code = (
        "import sys\nfrom rope_ext import cli\n"
        f"cli.main({argv!r})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
    if "--json" in argv:
        import json

        assert json.loads(out[: out.rindex("\n[]")]) == json.loads(json.dumps(rope_ext.methods()))
    else:
        assert re.search(r"^yarn +static +YaRN", out, flags=re.MULTILINE)


def test_the_shipped_catalog_is_the_registry_s_listing():
    """rope_ext/catalog.json, which `rope-ext methods` reads without torch: after a change to a
    method, `python -m rope_ext.catalog` writes it anew."""
    import json

    from rope_ext import catalog

    assert catalog.read() == json.loads(json.dumps(rope_ext.methods()))


def test_no_progress_quiets_transformers_too(tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise ValueError("stop here")

    monkeypatch.setattr(loading, "load_model", fails)
    try:
        assert cli.main(["eval", "ppl", "--lengths", "64", "--no-progress", "--output", str(tmp_path / "p")]) == 1
        assert not transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()


# Late validation (issue #15): every spec and argument is checked before a model loads, and a bad
# one is one clear line.


def test_compare_rejects_a_bad_spec_before_computing_the_good_ones(no_model, tmp_path, capsys):
    line = cli_error_line(["compare", "--methods", "plain", "ntk", "yarn:beta_fast=x", "--output", str(tmp_path / "c")], capsys)
    assert "beta_fast" in line and "'x'" in line and "number" in line
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--factor", "1"], "factor"),
        (["--methods", "plain,nope"], "unknown method 'nope'"),
        (["--length", "1"], "--length"),
    ],
)
def test_demo_checks_everything_before_the_plain_row(no_model, tmp_path, capsys, argv, words):
    assert words in cli_error_line(["demo", *argv, "--output", str(tmp_path / "d")], capsys)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--method", "yarn", "--factor", "4", "--param", "beta_fast=x"], "beta_fast"),
        (["--method", "yarn", "--factor", "4", "--original-window", "0"], "--original-window"),
        (["--bucket", "0"], "--bucket"),
        (["--data", "missing.txt"], "no such file"),
        (["--min-tokens", "-1"], "--min-tokens"),
    ],
)
def test_ppl_checks_everything_before_the_model_loads(no_model, tmp_path, capsys, argv, words, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert words in cli_error_line(["eval", "ppl", "--lengths", "64", *argv, "--output", str(tmp_path / "p")], capsys)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--depths", "1.5"], "--depths"),
        (["--trials", "0"], "--trials"),
        (["--method", "dynamic", "--factor", "2", "--param", "granularity=0"], "granularity"),
        (["--resume"], "passkey.partial.json does not exist"),
    ],
)
def test_passkey_checks_everything_before_the_model_loads(no_model, tmp_path, capsys, argv, words):
    assert words in cli_error_line(["eval", "passkey", *argv, "--output", str(tmp_path / "k")], capsys)


def test_an_existing_result_is_found_before_the_model_loads(no_model, tmp_path, capsys):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "ppl.json").write_text("{}")
    assert "--overwrite" in cli_error_line(["eval", "ppl", "--lengths", "64", "--output", str(tmp_path / "p")], capsys)


def test_ppl_refuses_a_binary_data_file_before_the_model_loads(no_model, tmp_path, capsys):
    path = tmp_path / "model.txt"
    path.write_bytes(b"\x00" * 64)
    assert "binary" in cli_error_line(
        ["eval", "ppl", "--lengths", "64", "--data", str(path), "--output", str(tmp_path / "p")], capsys
    )


# The fine-tune recipe's command line.


def test_every_yaml_key_has_a_flag():
    flagged = {key for _, key, _, _ in FLAGS}
    keys = {f"{section}.{name}" for section, values in DEFAULTS.items() for name in values}
    assert keys - flagged == {"patch.params"}  # --param KEY=VALUE, repeatable
    cfg, _ = parse_args(
        [
            "--exclude",
            "a,b",
            "--eval-source",
            "gutenberg",
            "--eval-include",
            "c",
            "--eval-split",
            "test",
            "--eval-text-field",
            "body",
        ]
    )
    assert cfg["data"]["exclude"] == ["a", "b"]
    assert (cfg["eval"]["source"], cfg["eval"]["include"], cfg["eval"]["split"], cfg["eval"]["text_field"]) == (
        "gutenberg",
        ["c"],
        "test",
        "body",
    )


def test_the_recipe_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "LoRA rank (default: 8)" in text
    assert "peak learning rate (default: 0.0002)" in text
    assert "(default: unset)" in text  # --precision: accelerate's own setting


def test_precision_defers_to_accelerate_unless_set():
    cfg, _ = parse_args([])
    assert cfg["training"]["precision"] is None
    assert choose_precision(cfg["training"]["precision"]) is None  # Accelerator(mixed_precision=None) reads accelerate's
    cfg, _ = parse_args(["--precision", "bf16"])
    assert choose_precision(cfg["training"]["precision"]) == "bf16"
    cfg, _ = parse_args(["--precision", "auto"])
    assert choose_precision(cfg["training"]["precision"]) in ("bf16", "fp16", "no")


# Late failures (issue #29): found by `check`, before a model loads.

COMMANDS_WITH_OUTPUT = [
    ["eval", "ppl", "--lengths", "64"],
    ["eval", "passkey"],
    ["compare", "--methods", "plain"],
    ["demo"],
]


@pytest.mark.parametrize("argv", COMMANDS_WITH_OUTPUT, ids=["ppl", "passkey", "compare", "demo"])
def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(no_model, tmp_path, capsys, argv):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = cli_error_line([*argv, "--output", str(blocker / "results")], capsys)
    assert str(blocker) in line and "not a folder" in line
    line = cli_error_line([*argv, "--output", "/proc/rope-ext-results"], capsys)  # no file can be made there, even by root
    assert "cannot write in /proc" in line


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--method", "sink_window", "--factor", "4"], "sink_window lets keys go"),
        (["--method", "dynamic", "--factor", "4", "--param", "causal=false"], "causal=False"),
    ],
)
def test_passkey_share_prefix_refuses_a_method_that_cannot_share_before_the_model_loads(no_model, tmp_path, capsys, argv, words):
    line = cli_error_line(["eval", "passkey", "--share-prefix", *argv, "--output", str(tmp_path / "k")], capsys)
    assert "--share-prefix" in line and words in line


def test_compare_checks_the_chunk_size_before_the_model_loads(no_model, tmp_path, capsys):
    assert "--chunk-size" in cli_error_line(["compare", "--chunk-size", "0", "--output", str(tmp_path / "c")], capsys)


# A typo in a method name is answered before torch, transformers or lm-eval load (issue #29).


def test_the_choices_a_parser_names_without_torch_are_the_ones_that_run():
    """`rope-ext search --space` and `rope-ext convert-chatglm --rope-ratio-meaning` name their choices
    before torch loads; the search's spaces and the converter's meanings are what they choose from."""
    from rope_ext.commands import convert_chatglm, search
    from rope_ext.patches.chatglm.convert import MEANINGS
    from rope_ext.tuning.search_space import SPACES

    assert search.SEARCH_SPACES == tuple(SPACES)
    assert convert_chatglm.ROPE_RATIO_MEANINGS == MEANINGS


@pytest.mark.slow  # spawns an interpreter
@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "passkey", "--method", "yran", "--factor", "4"],
        ["eval", "ppl", "--lengths", "64", "--method", "yran", "--factor", "4"],
        ["compare", "--methods", "plain", "yran:beta_fast=16"],
        ["demo", "--methods", "plain,yran"],
        ["lm-eval", "run", "--model", "rope_ext", "--model_args", "method=yran,factor=4", "--tasks", "rope_ext_passkey"],
    ],
    ids=["passkey", "ppl", "compare", "demo", "lm-eval"],
)
def test_a_misspelt_method_is_answered_before_torch_loads(argv):
    code = (
        "import sys\nfrom rope_ext import cli\n"
        f"code = cli.main({argv!r})\n"
        "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'lm_eval', 'peft'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "2 []"
    command = "lm-eval" if argv[0] == "lm-eval" else " ".join(argv[: 2 if argv[0] == "eval" else 1])
    assert done.stderr.strip() == (
        f"rope-ext {command}: error: unknown method 'yran' (did you mean 'yarn'?); valid methods: "
        + ", ".join(rope_ext.methods())
    )


# A fine-tune run folder whose files were cut short or lost (issue #29): one error before the model
# loads, naming the file.


def _run_folder(tmp_path, steps=(2, 4)):
    """A run folder as the recipe leaves it (one process): run_config.json and complete checkpoints."""
    import json

    from rope_ext.training.checkpoints import TRAINED_STATE
    from rope_ext.training.config import config_digest

    cfg, _ = parse_args([])
    out = tmp_path / "run"
    out.mkdir()
    record = {"config": cfg, "config_digest": config_digest(cfg), "data_parallel_size": 1, "checkpoint_layout": "replicated"}
    (out / "run_config.json").write_text(json.dumps(record, default=str))
    for step in steps:
        folder = out / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        state = {"step": step, "config_digest": config_digest(cfg), "evals": [], "history": []}
        (folder / "trainer_state.json").write_text(json.dumps(state))
        (folder / TRAINED_STATE).write_bytes(b"")
    return cfg, out


def _cut_short(path):
    path.write_text(path.read_text()[:20])


@pytest.mark.parametrize(
    "damage, resume, words",
    [
        (lambda out: _cut_short(out / "run_config.json"), "latest", "run_config.json is not valid JSON"),
        (lambda out: (out / "run_config.json").write_text("{}"), "latest", "run_config.json has no valid config"),
        (
            lambda out: _cut_short(out / "checkpoints/step-4/trainer_state.json"),
            "latest",
            "step-4/trainer_state.json is not valid JSON",
        ),
        (lambda out: (out / "checkpoints/step-4/trainer_state.json").write_text("[]"), "latest", "has no valid step"),
        (
            lambda out: _cut_short(out / "checkpoints/step-4/trainer_state.json"),
            "step-4",
            "step-4/trainer_state.json is not valid JSON",
        ),
        (
            lambda out: (out / "checkpoints/step-4/trained_state.safetensors").unlink(),
            "latest",
            "step-4 holds no trained_state.safetensors",
        ),
    ],
    ids=["run-config-cut", "run-config-empty", "state-cut", "state-not-a-record", "named-state-cut", "weights-lost"],
)
def test_a_damaged_run_folder_is_one_error_before_the_model_loads(tmp_path, damage, resume, words):
    from rope_ext.training.checkpoints import checkpoint_to_resume
    from rope_ext.training.config import ConfigError

    cfg, out = _run_folder(tmp_path)
    assert checkpoint_to_resume(out, "latest", cfg, 1, "replicated") == out / "checkpoints" / "step-4"
    damage(out)
    with pytest.raises(ConfigError, match=re.escape(words)) as refused:
        checkpoint_to_resume(out, str(out / "checkpoints" / resume) if resume != "latest" else resume, cfg, 1, "replicated")
    if "step-4" in words:
        assert f"--resume {out / 'checkpoints' / 'step-2'}" in str(refused.value)  # the complete one before it


def test_passkey_share_prefix_reads_the_patch_a_checkpoint_was_saved_with_before_it_loads(no_model, tiny_path, tmp_path, capsys):
    import rope_ext

    from helpers import load_llama

    model = load_llama(tiny_path)
    rope_ext.patch(model, "sink_window", factor=4)
    with pytest.warns(UserWarning):
        model.save_pretrained(tmp_path / "ckpt")
    capsys.readouterr()
    argv = ["eval", "passkey", "--model", str(tmp_path / "ckpt"), "--share-prefix", "--output", str(tmp_path / "k")]
    assert "--share-prefix: sink_window lets keys go" in cli_error_line(argv, capsys)


def test_patch_writes_a_checkpoint_and_says_what_each_engine_serves(tmp_path, capsys):
    """`rope-ext patch` on a Llama-3.1-shaped checkpoint: extended from its llama3 scaling, written as
    one longrope that transformers and the engines read as the patch; an attention-side method is
    served unpatched; the weights are the source's, bit for bit."""
    import json

    from safetensors.torch import load_file
    from test_checkpoint_shapes import model_of

    model_of("llama-3.1").save_pretrained(tmp_path / "src")
    assert cli.main(["patch", str(tmp_path / "src"), str(tmp_path / "yarn"), "--method", "yarn", "--factor", "4"]) == 0
    out = capsys.readouterr().out
    assert "its shipped llama3 scaling over a 1024-token window" in out and "meant for 4096 tokens" in out
    assert re.search(r"vLLM 0.30-0.34 +as patched", out) and re.search(r"SGLang 0.5.23 +as patched", out)
    config = json.loads((tmp_path / "yarn" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "longrope" and config["max_position_embeddings"] == 4096
    source, written = (load_file(tmp_path / name / "model.safetensors") for name in ("src", "yarn"))
    assert source.keys() == written.keys() and all(torch.equal(source[k], written[k]) for k in source)

    assert cli.main(["patch", str(tmp_path / "src"), str(tmp_path / "se"), "--method", "self_extend", "--factor", "2"]) == 0
    assert re.search(r"vLLM 0.30-0.34 +unpatched", capsys.readouterr().out)


def test_patch_refuses_an_occupied_folder_and_a_shrink_before_writing(tmp_path, capsys):
    from test_checkpoint_shapes import model_of

    model_of("llama-3.1").save_pretrained(tmp_path / "src")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert cli.main(["patch", str(tmp_path / "src"), str(tmp_path / "full"), "--method", "yarn", "--factor", "4"]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    argv = ["patch", str(tmp_path / "src"), str(tmp_path / "short"), "--method", "yarn", "--factor", "2"]
    assert cli.main([*argv, "--original-window", "64"]) == 1
    assert "fewer than the 1024 this checkpoint serves" in capsys.readouterr().err and not (tmp_path / "short").exists()
