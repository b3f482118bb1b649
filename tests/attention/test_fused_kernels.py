"""The kernels attend_with_lse runs (rope_ext.attention.parts): torch's fused kernels on the CPU
and CUDA, explicit scores in blocks elsewhere. The CUDA kernels run on a GPU only
(bench/gpu_check.py checks their numbers there); here every call the attention-side methods make
in a forward and a decode step is also handed, as meta tensors, to the CUDA path, whose two torch
kernels have meta implementations: it must take a fused kernel, return the CPU kernel's shapes,
and compute nothing of the size of the scores."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rope_ext
from rope_ext.attention import parts
from rope_ext.method import REGISTRY
from rope_ext.method.attention_side import AttentionMethod

from helpers import WINDOW, left_padded, random_ids, random_model

ATTENTION_SIDE = sorted(name for name, method in REGISTRY.items() if isinstance(method, AttentionMethod))
FLASH = torch.ops.aten._scaled_dot_product_flash_attention.default
EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
# what computing attention from explicit scores runs
SCORE_OPS = {"mm", "bmm", "matmul", "baddbmm", "exp", "_softmax", "logsumexp"}


class Ops(TorchDispatchMode):
    """Records the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def meta(x):
    return None if x is None else x.to("meta")


@pytest.fixture
def cuda_calls(monkeypatch):
    """Each call of the CPU kernel, replayed through attend_on_cuda on meta tensors: [(the kernel
    it took, masked)]. Fails a call whose CUDA output or lse differs in shape or dtype from the
    CPU kernel's, or that runs an op of explicit scores beside its one kernel."""
    calls = []
    on_cpu = parts.FUSED["cpu"]

    def both(query, key, value, *, causal=False, mask=None, scale=None):
        out, lse = on_cpu(query, key, value, causal=causal, mask=mask, scale=scale)
        with Ops() as ops:
            cuda_out, cuda_lse = parts.attend_on_cuda(
                meta(query), meta(key), meta(value), causal=causal, mask=meta(mask), scale=scale
            )
        assert (cuda_out.shape, cuda_out.dtype) == (out.shape, out.dtype)
        assert (cuda_lse.shape, cuda_lse.dtype) == (lse.shape, torch.float32)
        kernels = [op for op in ops.seen if op in (FLASH, EFFICIENT)]
        assert len(kernels) == 1
        assert not {op.overloadpacket.__name__ for op in ops.seen} & SCORE_OPS
        calls.append((kernels[0], mask is not None))
        return out, lse

    monkeypatch.setitem(parts.FUSED, "cpu", both)
    monkeypatch.setattr(parts, "attend_with_lse_by_scores", lambda *a, **k: pytest.fail("explicit scores on a fused device"))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ATTENTION_SIDE)
def test_every_call_of_a_forward_and_a_decode_step_takes_a_fused_cuda_kernel(cuda_calls, name, dtype):
    model = random_model("llama").to(dtype)
    rope_ext.patch(model, name, factor=4)
    ids = random_ids(3 * WINDOW + 5)
    with torch.no_grad():
        out = model(ids[:, :-1], use_cache=True)
        model(ids[:, -1:], cache=out.cache, use_cache=True)
    assert cuda_calls
    kernels = {kernel for kernel, masked in cuda_calls if not masked}
    # half precision without a mask is FlashAttention's; fp32 has only the memory-efficient kernel
    assert kernels == ({FLASH} if dtype == torch.bfloat16 else {EFFICIENT})
    assert all(kernel is EFFICIENT for kernel, masked in cuda_calls if masked)


def test_a_padded_batch_takes_the_masked_kernel(cuda_calls):
    """Left padding sends self_extend's rows through masked calls, which only the memory-efficient
    kernel takes."""
    model = random_model("llama").to(torch.bfloat16)
    rope_ext.patch(model, "self_extend", factor=4)
    ids, mask, _ = left_padded(random_ids(2 * WINDOW + 7, seed=1), 5)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert {kernel for kernel, masked in cuda_calls if masked} == {EFFICIENT}


def test_other_devices_compute_scores_in_blocks():
    assert set(parts.FUSED) == {"cpu", "cuda"}
    query, key, value = (torch.randn(1, 4, 9, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    expected = parts.attend_on_cpu(query, key[:, :2], value[:, :2], causal=True)
    by_scores = parts.attend_with_lse_by_scores(query, key[:, :2], value[:, :2], causal=True)
    for a, b in zip(expected, by_scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_parts_merged_by_lse_train_on_the_gradients_of_one_softmax():
    """Two fused calls over disjoint keys, merged by their logsumexp, have the gradients of one
    softmax over all the keys: the merge differentiates through the logsumexp, which torch's fused
    kernels return without a gradient, so a call autograd records computes its scores."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, requires_grad=True) for shape in [(1, 4, 6, 8), (1, 2, 9, 8), (1, 2, 9, 8)])
    g = torch.randn(1, 4, 6, 8)
    near = parts.attend_with_lse(q, k[:, :, :4], v[:, :, :4])
    far = parts.attend_with_lse(q, k[:, :, 4:], v[:, :, 4:])
    merged = parts.merge_by_lse([(*near, None), (*far, None)])
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(merged, whole, rtol=0, atol=1e-6)
    got = torch.autograd.grad((merged * g).sum(), (q, k, v))
    expected = torch.autograd.grad((whole * g).sum(), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ATTENTION_SIDE)
def test_a_patched_model_past_its_window_trains_on_its_own_gradients(name):
    """The gradient of the loss along a random direction of the first layer's query weights equals
    the loss's central difference (the model in fp64, its attention's scores in fp32): the backward
    of every attention-side method is its forward's."""
    model = random_model().double()
    rope_ext.patch(model, name, factor=4)
    ids = random_ids(3 * WINDOW)
    weight = model.model.layers[0].self_attn.q_proj.weight
    direction = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss():
        return model(ids, labels=ids).loss * ids.shape[1]

    (grad,) = torch.autograd.grad(loss(), weight)
    step = 1e-2
    with torch.no_grad():
        weight += step * direction
        ahead = loss()
        weight -= 2 * step * direction
        behind = loss()
        weight += step * direction
    assert (grad * direction).sum().item() == pytest.approx(((ahead - behind) / (2 * step)).item(), rel=1e-2)
