"""`rope-ext compare` on the tiny trained model: one table, one plot, the window's break visible."""

from __future__ import annotations

import json

import pytest

from rope_ext import cli
from rope_ext.evals import compare


def test_compare_methods_by_length(tiny_path, tmp_path):
    from rope_ext.defaults import gutenberg_documents

    source = tmp_path / "heldout.txt"
    source.write_text(gutenberg_documents()["tempest_gut"][10000:40000])  # a held-out play
    out = tmp_path / "cmp"
    argv = [
        "--model",
        str(tiny_path),
        "--methods",
        "plain",
        "yarn",
        "dynamic",
        "dynamic:causal=false",
        "--lengths",
        "128",
        "512",
        "--param",
        "dynamic:granularity=64",
        "--data",
        str(source),
        "--bucket",
        "128",
        "--passkey-depths",
        "0.5",
        "--passkey-lengths",
        "128",
        "--output",
        str(out),
        "--no-progress",
    ]
    with pytest.warns(UserWarning, match="plain at length 512"):
        assert cli.call(["compare"] + argv) == 0
    assert {p.name for p in out.iterdir()} == {"compare.json", "compare.md", "compare.png"}
    report = json.loads((out / "compare.json").read_text())
    assert report["setup"]["factor"] == 4  # 512 / 128
    ppl = {m["label"]: {n: r["ppl"] for n, r in m["ppl"].items()} for m in report["methods"]}
    assert ppl["dynamic"]["128"] == pytest.approx(ppl["plain"]["128"], rel=1e-5)  # dynamic is plain inside the window
    # the one-base-per-forward schedule differs from the causal one past the window, and costs inside it
    assert ppl["dynamic:causal=false"]["512"] != pytest.approx(ppl["dynamic"]["512"], rel=1e-3)
    assert [m["params"] for m in report["methods"] if m["method"] == "dynamic"] == [
        {"granularity": 64},
        {"causal": False, "granularity": 64},
    ]
    assert ppl["yarn"]["512"] < 0.95 * ppl["plain"]["512"]
    assert all(set(m["passkey"]["by_length"]) == {"128"} for m in report["methods"])
    table = (out / "compare.md").read_text()
    assert "| plain | - |" in table and "PPL @512" in table and "passkey @128" in table
    assert "passkey @512" not in table
    buckets = table.split("PPL at length 512 by position")[1]
    assert (
        "| 384-512 |" in buckets and "| dynamic:causal=false |" in buckets and buckets.count("**") >= 8
    )  # a bold minimum per bucket


def test_bad_method_parameter_is_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="METHOD:KEY=VALUE"):
        cli.call(["compare"] + ["--methods", "plain", "yarn", "--param", "ntk:granularity=4", "--output", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="unknown method"):
        cli.call(["compare"] + ["--methods", "plain", "nope", "--output", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="twice"):
        cli.call(["compare"] + ["--methods", "yarn", "yarn", "--output", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        cli.call(["compare"] + ["--methods", "dynamic:granularity", "--output", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_a_spec_takes_list_values_such_as_longrope_factor_lists():
    """A comma inside brackets belongs to the value: longrope's factor lists fit in a spec."""
    runs = compare.parse_specs(["longrope:short_factor=[1.0,1.25],long_factor=[2.0,4.0],causal=false"], [])
    assert runs[0][1:] == ("longrope", {"short_factor": [1.0, 1.25], "long_factor": [2.0, 4.0], "causal": False})
    runs = compare.parse_specs(["longrope"], ["longrope:long_factor=[2.0,4.0]"])
    assert runs[0][2] == {"long_factor": [2.0, 4.0]}
    with pytest.raises(ValueError, match=r"unbalanced brackets in 'long_factor=\[2.0,4.0'"):
        compare.parse_specs(["longrope:long_factor=[2.0,4.0"], [])


@pytest.mark.integration
def test_compare_adds_a_ruler_column(tiny_path, tmp_path):
    """--ruler-samples: lm-eval's niah_single_1 per method and length, beside perplexity and
    passkey, in the JSON, the table and the figure."""
    from rope_ext.evals import plots

    out = tmp_path / "cmp"
    argv = [
        "--model",
        str(tiny_path),
        "--methods",
        "plain",
        "yarn",
        "--lengths",
        "384",
        "512",
        "--passkey-lengths",
        "384",
        "--ruler-samples",
        "2",
        "--output",
        str(out),
        "--no-progress",
    ]
    with pytest.warns(UserWarning, match="plain at length 512"):
        assert cli.call(["compare"] + argv) == 0
    report = json.loads((out / "compare.json").read_text())
    assert report["setup"]["ruler"] == {"task": "niah_single_1", "lengths": [384, 512], "samples": {"384": 2, "512": 2}}
    for m in report["methods"]:
        assert set(m["ruler"]["by_length"]) == {"384", "512"}
        assert all(0.0 <= score <= 1.0 for score in m["ruler"]["by_length"].values())
    table = (out / "compare.md").read_text()
    assert "| method | factor | PPL @384 | PPL @512 | passkey @384 | niah_single_1 @384 | niah_single_1 @512 |" in table
    assert "over 2 sample(s) per length" in table
    titles = [ax.get_title() for ax in plots.compare_figure(report).axes]
    assert "passkey retrieval" in titles and "RULER niah_single_1" in titles


def test_bad_ruler_options_are_refused_before_loading(tmp_path):
    base = ["--methods", "plain", "--output", str(tmp_path / "x")]
    with pytest.raises(ValueError, match="--ruler-task 'nope' is not a RULER task; choose from niah_single_1"):
        cli.call(["compare"] + base + ["--ruler-samples", "2", "--ruler-task", "nope"])
    with pytest.raises(ValueError, match="RULER builds 500 samples per length"):
        cli.call(["compare"] + base + ["--ruler-samples", "501"])
    with pytest.raises(ValueError, match="--ruler-lengths needs --ruler-samples"):
        cli.call(["compare"] + base + ["--ruler-lengths", "4096"])
    assert not (tmp_path / "x").exists()
