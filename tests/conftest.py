"""Shared fixtures. The tiny trained LLaMA comes from rope_ext.training.tiny (the model of
recipes/pretrain_tiny.py): trained once (a few CPU minutes) into rope_ext.defaults.cache_dir() and
reused by every later run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rope_ext.training import tiny

from helpers import load_llama


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The inner loop `-m "not slow"` runs tiny random models only: every `integration` test is
    `slow` too, and so is every test of the tiny trained model, whose first run trains it."""
    for item in items:
        if item.get_closest_marker("integration") or "tiny_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


# The suite runs thousands of ops on tiny matrices, where a second thread costs more in
# synchronisation than it gains (measured 4-10x slower with 2 threads on a busy 2-core machine).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_path(pytestconfig) -> Path:
    """The cached checkpoint directory (model + tokenizer), trained on first use."""
    # Let the training progress bar through pytest's capture: the first run takes minutes.
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        return tiny.ensure_tiny()


@pytest.fixture
def tiny_model(tiny_path):
    """A fresh fp32 copy in eval mode: tests may patch or modify it freely."""
    return load_llama(tiny_path)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def heldout_ids(tiny_tokenizer) -> torch.LongTensor:
    """1-D stream of the held-out plays (never trained on), eos between plays, no bos."""
    return tiny.heldout_ids(tiny_tokenizer)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the in-process training runs, as each DDP process has: on a shared
    2-core machine two spinning OpenMP threads per process made these tests 10-50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: a command must refuse its arguments before a model loads."""
    from rope_ext import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr("rope_ext.defaults.load_smollm2", refuse)
