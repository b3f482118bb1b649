"""Shared fixtures. The tiny trained LLaMA comes from recipes/pretrain_tiny.py: trained once
(a few CPU minutes) into rope_ext.defaults.cache_dir() and reused by every later run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "pretrain_tiny.py"


def _load_recipe():
    # recipes/ is a folder of scripts, not a package: load the checkout's file by path.
    spec = importlib.util.spec_from_file_location("rope_ext_recipe_pretrain_tiny", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain_tiny = _load_recipe()

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
        return pretrain_tiny.ensure_tiny()


@pytest.fixture
def tiny_model(tiny_path):
    """A fresh fp32 copy in eval mode: tests may patch or modify it freely."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def heldout_ids(tiny_tokenizer) -> torch.LongTensor:
    """1-D stream of the held-out plays (never trained on), eos between plays, no bos."""
    return pretrain_tiny.heldout_ids(tiny_tokenizer)
