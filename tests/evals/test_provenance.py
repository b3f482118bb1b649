"""Every results file says where its numbers come from: versions, the source's git commit (from a
checkout), device, dtype, threads, date and the checkpoint, whose config hash does not depend on
what was patched in memory."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

import rope_ext
from rope_ext import cli, loading
from rope_ext.evals import output

ROOT = Path(__file__).resolve().parents[2]


def git(root: Path, *args: str) -> str:
    command = ["git", "-C", str(root), "-c", "user.name=test", "-c", "user.email=test@example.com", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def text_file(tmp_path):
    from rope_ext.defaults import gutenberg_documents

    path = tmp_path / "macbeth.txt"
    path.write_text(gutenberg_documents()["macbeth_gut"][20000:23000])
    return path


def test_ppl_results_record_their_provenance(tiny_path, text_file, tmp_path):
    runs = {}
    for method in (["--method", "plain"], ["--method", "yarn", "--factor", "2"]):  # two loads, one patched
        out = tmp_path / method[1]
        assert (
            cli.call(
                ["eval", "ppl"]
                + [
                    "--model",
                    str(tiny_path),
                    "--lengths",
                    "64",
                    "--data",
                    str(text_file),
                    "--output",
                    str(out),
                    "--no-progress",
                    *method,
                ]
            )
            == 0
        )
        runs[method[1]] = json.loads((out / "ppl.json").read_text())
        assert output.provenance_line(runs[method[1]]["provenance"]) in (out / "ppl.md").read_text()

    record = runs["plain"]["provenance"]
    assert record["rope_ext"] == rope_ext.__version__
    # the suite runs from the checkout (an editable install): its commit and state are recorded
    assert record["git_commit"] == git(ROOT, "rev-parse", "HEAD")
    assert record["git_dirty"] == bool(git(ROOT, "status", "--porcelain", "--untracked-files=no"))
    assert f"git {record['git_commit'][:12]}" in output.provenance_line(record)
    assert record["transformers"] == transformers.__version__
    assert record["torch"] == torch.__version__
    assert (record["device"], record["dtype"]) == ("cpu", loading.resolve_dtype("auto", "cpu"))
    assert record["threads"] == torch.get_num_threads()
    assert record["model"] == str(tiny_path)
    assert abs(datetime.now(timezone.utc) - datetime.fromisoformat(record["date"])) < timedelta(minutes=10)
    assert len(record["config_sha256"]) == 12
    assert runs["yarn"]["provenance"]["config_sha256"] == record["config_sha256"]
    assert {"setup", "lengths"} <= set(runs["plain"])  # the existing keys stay


def test_a_checkout_gives_its_commit_and_whether_tracked_files_changed(tmp_path):
    assert output.checkout_state(tmp_path) == {}  # not a checkout (an installed package): nothing
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", "code.py")
    git(tmp_path, "commit", "-q", "-m", "first")
    head = git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "results.json").write_text("{}")  # untracked output changes nothing that ran
    assert output.checkout_state(tmp_path) == {"git_commit": head, "git_dirty": False}
    (tmp_path / "code.py").write_text("x = 2\n")
    assert output.checkout_state(tmp_path) == {"git_commit": head, "git_dirty": True}
    line = output.provenance_line({**BASE_RECORD, **output.checkout_state(tmp_path)})
    assert f"rope-ext 0.1.0 (git {head[:12]}, uncommitted changes)," in line
    assert "git" not in output.provenance_line(BASE_RECORD)


BASE_RECORD = {
    "rope_ext": "0.1.0",
    "transformers": "5",
    "torch": "2",
    "device": "cpu",
    "dtype": "float32",
    "threads": 1,
    "date": "2026-01-01T00:00:00+00:00",
    "model": "m",
    "config_sha256": "0" * 12,
}


def test_config_hash_names_the_checkpoint_not_the_patch(tiny_path, tmp_path):
    model = LlamaForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    before = output.provenance(model, str(tiny_path))["config_sha256"]
    rope_ext.patch(model, "yarn", factor=4)
    assert output.provenance(model, str(tiny_path))["config_sha256"] == before
    model.save_pretrained(tmp_path / "patched")  # a patched checkpoint is another checkpoint
    assert output.config_hash(str(tmp_path / "patched")) != before


def test_passkey_and_compare_results_record_their_provenance(tiny_path, text_file, tmp_path):
    assert (
        cli.call(
            ["eval", "passkey"]
            + [
                "--model",
                str(tiny_path),
                "--lengths",
                "118",
                "--depths",
                "0.5",
                "--trials",
                "1",
                "--output",
                str(tmp_path / "pk"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        cli.call(
            ["compare"]
            + [
                "--model",
                str(tiny_path),
                "--methods",
                "plain",
                "--lengths",
                "64",
                "--data",
                str(text_file),
                "--no-passkey",
                "--output",
                str(tmp_path / "cmp"),
                "--no-progress",
            ]
        )
        == 0
    )
    for folder, name in (("pk", "passkey"), ("cmp", "compare")):
        record = json.loads((tmp_path / folder / f"{name}.json").read_text())["provenance"]
        assert record["model"] == str(tiny_path) and record["threads"] == torch.get_num_threads()
        assert output.provenance_line(record) in (tmp_path / folder / f"{name}.md").read_text()


@pytest.mark.parametrize(
    "avx512_bf16, amx, expected", [(False, False, "float32"), (True, False, "bfloat16"), (False, True, "bfloat16")]
)
def test_auto_dtype_is_bf16_only_where_the_cpu_has_it(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert loading.resolve_dtype("auto", "cpu") == expected
    assert loading.resolve_dtype("float32", "cpu") == "float32"  # an explicit dtype wins
    assert loading.resolve_dtype("bfloat16", "cpu") == "bfloat16"


def test_the_embedded_model_is_named_by_its_bytes_not_its_install_time(tmp_path, monkeypatch):
    # Results and --resume compare the model's name: a reinstall of the same GGUF (a new mtime)
    # on another machine must give the same name, or a stopped run cannot be continued there.
    from rope_ext import defaults

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    monkeypatch.setattr(defaults, "smollm2_gguf", lambda: gguf)
    monkeypatch.setattr(defaults, "cache_dir", lambda: tmp_path)
    converted = []
    for mtime in (1_000_000, 2_000_000):
        os.utime(gguf, (mtime, mtime))
        folder = tmp_path / f"smollm2-135m-{defaults.smollm2_key()}"
        converted.append(folder.name)
    assert converted[0] == converted[1]
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 65)
    assert f"smollm2-135m-{defaults.smollm2_key()}" != converted[0]
