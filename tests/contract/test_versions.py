"""The versions rope-ext runs on (docs/compatibility.md): the documented ranges are pyproject.toml's,
a transformers version outside the tested range is refused at import with the reason, and within
it the KV cache reaches the patch under both of its names (transformers 5.24 renamed
`past_key_values` to `cache` and keeps the old name, deprecated, until 5.40)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from transformers import DynamicCache

import rope_ext

LENGTH = 220  # past the tiny model's 128-token window


def test_the_installed_transformers_is_one_the_suite_passes_on():
    """What a fresh `bash setup.sh` installs is the newest release in range: when a newer one
    appears, this fails until the suite passes on it and NEWEST_TESTED names it, so that a fresh
    install never warns."""
    from importlib import metadata

    installed = Version(metadata.version("transformers")).release[:2]
    assert installed <= Version(rope_ext.NEWEST_TESTED).release[:2]


@pytest.mark.parametrize("found", ["5.24.0", "5.24.1", "5.25.0", "5.26.0", "5.39.2", "5.40.0.dev0"])
def test_a_version_in_the_range_is_accepted_and_an_untested_one_says_so(found, recwarn):
    rope_ext.check_transformers(found)
    warned = [str(w.message) for w in recwarn]
    if Version(found).release[:2] > (5, 25):
        assert warned == [
            f"rope-ext's suite has passed on transformers up to 5.25, not on {found}: "
            f"`.ci/floors transformers=={found}` in a checkout runs its cache and decode tests on it"
        ]
    else:
        assert warned == []


@pytest.mark.parametrize("found", ["4.57.6", "5.0.0", "5.23.0", "5.24.0.dev0", "5.24.0rc1", "6.0.0", "6.0.0.dev0"])
def test_a_version_outside_the_tested_range_is_refused_with_the_reason(found):
    with pytest.raises(
        ImportError, match=rf"^rope-ext is tested with transformers>=5.24,<6, found transformers {found} "
    ) as refused:
        rope_ext.check_transformers(found)
    reason = "`past_key_values`" if Version(found) < Version("5.24") else "not been tested"
    assert reason in str(refused.value)


@pytest.mark.slow  # spawns an interpreter
def test_the_import_refuses_an_untested_transformers():
    """`import rope_ext` itself refuses: the installed version is read from its metadata,
    monkeypatched here in a fresh interpreter."""
    script = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda name: '5.23.0' if name == 'transformers' else real(name)\n"
        "import rope_ext\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "ImportError: rope-ext is tested with transformers>=5.24,<6, found transformers 5.23.0 " in proc.stderr


def test_the_range_is_the_one_pyproject_declares():
    """The range the import checks is the one pip installs from, in every requirement that names it."""
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert set(re.findall(r'"(transformers[^"]*)"', text)) == {f"transformers{rope_ext.TRANSFORMERS}"}


def test_the_compatibility_table_states_pyproject_s_ranges():
    """docs/compatibility.md's table gives each floored package the range every requirement naming it
    in pyproject.toml declares (`.ci/floors` installs those floors)."""
    root = Path(__file__).resolve().parents[2]
    rows = re.findall(r"^\| ([a-z-]+) \| `([^`]+)` \|", (root / "docs/compatibility.md").read_text(), re.MULTILINE)
    assert {name for name, _ in rows} == {"torch", "transformers", "accelerate", "peft", "lm-eval"}
    listed = re.findall(r'"([A-Za-z][^"]*)"', (root / "pyproject.toml").read_text())
    for name, documented in rows:
        declared = {m.group(1) for r in listed if (m := re.fullmatch(rf"{name}(?:\[[^\]]*\])?([<>=!~][^;]*)", r))}
        assert declared == {documented}, (name, declared)


@pytest.mark.parametrize(
    "method, params",
    [("dynamic", {"factor": 4}), ("self_extend", {"factor": 4}), ("dca", {"factor": 4}), ("sink_window", {"factor": 4})],
)
def test_decoding_through_the_decoder_with_the_deprecated_cache_name(tiny_model, heldout_ids, method, params):
    """The decoder called with `past_key_values=` (the name before 5.24, still accepted until 5.40)
    decodes as one forward does: the patch reads the cache under either name."""
    rope_ext.patch(tiny_model, method, **params)
    ids = heldout_ids[None, :LENGTH]
    decoder = tiny_model.model
    with torch.no_grad():
        full = decoder(ids).last_hidden_state
        cache = DynamicCache(config=tiny_model.config)
        decoder(ids[:, : LENGTH - 4], past_key_values=cache, use_cache=True)
        steps = torch.cat(
            [
                decoder(ids[:, t : t + 1], past_key_values=cache, use_cache=True).last_hidden_state
                for t in range(LENGTH - 4, LENGTH)
            ],
            dim=1,
        )
    assert cache.get_seq_length() == LENGTH
    assert (steps - full[:, -4:]).abs().max() <= 1e-4
