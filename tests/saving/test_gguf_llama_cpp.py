"""llama.cpp runs a GGUF `rope-ext patch` writes: the tiny trained LLaMA in fp32 written as a GGUF
(tests/gguf_files.py), patched from metadata alone, gives through llama.cpp the logits of rope-ext's
transformers model of the same patch, at 4x the window. Needs llama-cpp-python (the `llama-cpp`
extra: a source build, about 8 minutes on 2 cores, docs/serving.md), so it is marked slow."""

from __future__ import annotations

import pytest
import torch

import rope_ext
from rope_ext import cli

from gguf_files import write_llama_gguf
from helpers import load_llama

llama_cpp = pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python is not installed: the llama-cpp extra, a source build of about 8 minutes on 2 cores "
    '(CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" on a CPU without AVX-512, docs/serving.md)',
)

pytestmark = pytest.mark.slow
F32 = 0  # GGML_TYPE_F32 (ggml/include/ggml.h): an fp32 KV cache, so that only the arithmetic differs
# measured: the largest logit difference over 512 tokens is 1.4e-5 (linear) to 1.2e-4 (yarn), on
# logits up to 15 in size; the unpatched file differs from the patched model by more than 1 past
# the window
ATOL = 5e-4


def llama_cpp_logits(path, ids: torch.Tensor) -> torch.Tensor:
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=len(ids),
        n_batch=len(ids),
        n_ubatch=len(ids),
        n_threads=1,
        logits_all=True,
        type_k=F32,
        type_v=F32,
        verbose=False,
    )
    llm.eval(ids.tolist())
    logits = torch.from_numpy(llm.scores[: len(ids)].copy())
    llm.close()
    return logits


@torch.no_grad()
def transformers_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None]).logits[0]


@pytest.mark.parametrize("method", ["yarn", "llama3", "ntk", "linear", "ntk_by_parts"])
def test_llama_cpp_runs_the_patch_rope_ext_writes(method, tiny_path, heldout_ids, tmp_path):
    model = load_llama(tiny_path)
    window = model.config.max_position_embeddings
    ids = heldout_ids[: 4 * window]
    source = write_llama_gguf(model, tmp_path / "tiny.gguf")
    out = tmp_path / f"{method}.gguf"
    assert cli.main(["patch", str(source), str(out), "--method", method, "--factor", "4"]) == 0

    unpatched = llama_cpp_logits(source, ids)
    torch.testing.assert_close(unpatched, transformers_logits(model, ids), rtol=0, atol=ATOL)
    rope_ext.patch(model, method, factor=4, original_window=window)
    expected = transformers_logits(model, ids)
    served = llama_cpp_logits(out, ids)
    gap = (unpatched - expected)[window:].abs().max()
    assert gap > 1.0  # what the comparison below must tell apart
    torch.testing.assert_close(served, expected, rtol=0, atol=ATOL)
