"""Every results file says where its numbers come from: versions, device, dtype, threads, date and
the checkpoint, whose config hash does not depend on what was patched in memory."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

import rope_ext
from rope_ext.evals import compare, loading, output, passkey, perplexity


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
            perplexity.main(
                [
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
    assert record["transformers"] == transformers.__version__
    assert record["torch"] == torch.__version__
    assert (record["device"], record["dtype"]) == ("cpu", loading.resolve_dtype("auto", "cpu"))
    assert record["threads"] == torch.get_num_threads()
    assert record["model"] == str(tiny_path)
    assert abs(datetime.now(timezone.utc) - datetime.fromisoformat(record["date"])) < timedelta(minutes=10)
    assert len(record["config_sha256"]) == 12
    assert runs["yarn"]["provenance"]["config_sha256"] == record["config_sha256"]
    assert {"setup", "lengths"} <= set(runs["plain"])  # the existing keys stay


def test_config_hash_names_the_checkpoint_not_the_patch(tiny_path, tmp_path):
    model = LlamaForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    before = output.provenance(model, str(tiny_path))["config_sha256"]
    rope_ext.patch(model, "yarn", factor=4)
    assert output.provenance(model, str(tiny_path))["config_sha256"] == before
    model.save_pretrained(tmp_path / "patched")  # a patched checkpoint is another checkpoint
    assert output.config_hash(str(tmp_path / "patched")) != before


def test_passkey_and_compare_results_record_their_provenance(tiny_path, text_file, tmp_path):
    assert (
        passkey.main(
            [
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
        compare.main(
            [
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
