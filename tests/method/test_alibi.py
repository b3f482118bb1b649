"""alibi_hybrid: RoPE plus a linear distance bias added inside attention.

The bias is checked against the formula written out here, independently of the implementation:
chunk by chunk (the masks the bias hands the backend), and end to end (a model whose attention
adds the full formula bias). Then: backends agree, KV-cache decoding equals a full forward,
unpatch restores the model exactly, bad parameters are refused, trainable slopes train, save and
reload, and on the trained tiny model the bias beats plain RoPE past the window.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from transformers import AutoConfig, DynamicCache, StaticCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import rope_ext
from rope_ext.method import alibi_hybrid as alibi

from helpers import WINDOW, glm_model, random_ids, random_model

W = 16  # a bias-free distance well inside the random models' 64-token window


def formula_bias(num_heads: int, q_index: list[int], k_len: int, w: int, heads=None, slope_scale=1.0) -> torch.Tensor:
    """-slope_scale * m_h * max(0, i - j - w) for j <= i (0 for j > i), with ALiBi's slopes written
    out from the paper: 2^(-8h/n) for n the power of two <= H, then every other slope of 2n."""
    n = 2 ** int(math.log2(num_heads))
    slopes = [2 ** (-8 * h / n) for h in range(1, n + 1)]
    slopes += [2 ** (-8 * h / (2 * n)) for h in range(1, 2 * n + 1)][0::2][: num_heads - n]
    out = torch.zeros(num_heads, len(q_index), k_len, dtype=torch.float64)
    for h in range(num_heads):
        if heads is not None and h not in heads:
            continue
        for r, i in enumerate(q_index):
            for j in range(min(i + 1, k_len)):
                out[h, r, j] = -slope_scale * slopes[h] * max(0, i - j - w)
    return out


class _Holder(nn.Module):
    """The attributes of an attention module that the bias reads."""

    def __init__(self, num_heads, heads, slope_scale, backend="rope_ext_eager"):
        super().__init__()
        self.config = type("Config", (), {"_attn_implementation": backend})()
        self.rope_ext_alibi = alibi.AlibiSlopes(num_heads, heads, slope_scale, False, "cpu")


# transformers hands sdpa no mask ("none") only for square or single-row attention
CHUNK_CASES = [(40, 40, "none"), (1, 23, "none")] + [
    (q, k, m) for q, k in [(40, 40), (3, 40), (1, 23)] for m in ("bool", "float")
]


@pytest.mark.parametrize("q_len, kv_len, model_mask", CHUNK_CASES)
def test_chunk_masks_equal_the_formula(monkeypatch, q_len, kv_len, model_mask):
    """Every mask the bias hands the backend, put back together, is the formula plus causality;
    none is a [H, L, L] tensor in memory."""
    num_heads, heads, w, scale = 6, [0, 2, 5], 5, 0.5
    bias = alibi.AlibiBias(num_heads, heads, w, scale, trainable=False)
    holder = _Holder(num_heads, heads, scale)
    monkeypatch.setattr(alibi, "MASK_BYTES", 6 * kv_len * 4 * 7)  # 7 rows a chunk with a model mask
    monkeypatch.setattr(alibi, "QUERY_ROWS", 6)
    monkeypatch.setattr(alibi, "MAX_CHUNKS", 100)
    q = torch.randn(1, num_heads, q_len, 8)
    k = torch.randn(1, num_heads, kv_len, 8)
    offset = kv_len - q_len
    causal = torch.arange(kv_len)[None, :] <= (offset + torch.arange(q_len))[:, None]
    additive = torch.zeros(q_len, kv_len).masked_fill(~causal, torch.finfo(torch.float32).min)
    mask = {"none": None, "bool": causal[None, None], "float": additive[None, None]}[model_mask]
    seen = []

    def attend(module, query, key, value, chunk_mask, **kwargs):
        seen.append((query.shape[-2], key, chunk_mask))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    bias(holder, q, k, k, mask, attend)
    full = torch.full((num_heads, q_len, kv_len), float("-inf"), dtype=torch.float64)
    row = 0
    for rows, key, chunk_mask in seen:
        # which key each column is: the chunk may see the keys in any order
        columns = [int((k[0, 0] == key[0, 0, c]).all(-1).nonzero()) for c in range(key.shape[-2])]
        if chunk_mask is None:  # the backend's own causal path for a square block
            assert row == 0 and offset == 0 and columns == list(range(rows))
            block = torch.zeros(rows, rows).masked_fill(~causal[:rows, :rows], float("-inf"))[None]
        else:
            assert chunk_mask.untyped_storage().nbytes() <= max(alibi.MASK_BYTES, num_heads * (q_len + kv_len) * 4)
            if chunk_mask.dtype == torch.bool:
                block = torch.zeros(chunk_mask.shape[-2:]).masked_fill(~chunk_mask[0, 0], float("-inf"))[None]
            else:
                block = chunk_mask[0].double()
        full[:, row : row + rows, columns] = block.expand(num_heads, -1, -1).double()
        row += rows
    assert row == q_len and (len(seen) > 1 or q_len < 7)
    full = full.masked_fill(full <= torch.finfo(torch.float32).min, float("-inf"))
    expected = formula_bias(num_heads, list(range(offset, kv_len)), kv_len, w, heads, scale)
    expected = expected.masked_fill(~causal[None], float("-inf"))
    torch.testing.assert_close(full, expected, rtol=1e-6, atol=1e-6)


def _register_formula_attention() -> str:
    """An eager attention that adds the full formula bias: the reference the patch must match."""
    name = "alibi_formula_reference"

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        q_len, kv_len = query.shape[-2], key.shape[-2]
        spec = module.formula
        bias = formula_bias(query.shape[1], list(range(kv_len - q_len, kv_len)), kv_len, **spec).to(query.dtype)
        scores = query @ key.transpose(-1, -2) * scaling + bias + attention_mask
        return (scores.softmax(-1) @ value).transpose(1, 2), None

    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return name


def formula_twin(model, rope: str, factor: float, **spec):
    """The same weights with the rotary method `rope` and attention that adds formula_bias."""
    twin = copy.deepcopy(model)
    rope_ext.patch(twin, rope, factor=factor)
    for layer in twin.model.layers:
        layer.self_attn.formula = spec
    twin.config._attn_implementation = _register_formula_attention()
    return twin


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_model_matches_formula_reference(monkeypatch, attn):
    monkeypatch.setattr(alibi, "MASK_BYTES", 4 * 150 * 4 * 16)  # ~16 rows a chunk
    model = random_model(attn=attn)
    ids = torch.randint(0, 97, (2, 150), generator=torch.Generator().manual_seed(1))
    reference = formula_twin(model, "yarn", 4.0, w=W, heads=[1, 3], slope_scale=2.0)
    rope_ext.patch(model, "alibi_hybrid", factor=4, rope="yarn", w=W, heads=[1, 3], slope_scale=2.0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def _flex_compiles() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention

        q = torch.randn(1, 1, 16, 16)
        torch.compile(flex_attention)(q, q, q, score_mod=lambda s, b, h, i, j: s - (i - j))
        return True
    except Exception:  # no C++ compiler or no flex kernel for this device
        return False


def padded_batch():
    ids = torch.randint(3, 97, (2, 140), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0  # left padding on the second row
    return ids, mask


@torch.no_grad()
def patched_logits(backend: str, ids, mask=None):
    model = random_model(attn=backend)
    rope_ext.patch(model, "alibi_hybrid", factor=4, rope="ntk", w=W, slope_scale=1.5)
    return model(ids, attention_mask=mask).logits


def test_sdpa_agrees_with_eager_and_padding_is_respected():
    ids, mask = padded_batch()
    eager, sdpa = patched_logits("eager", ids, mask), patched_logits("sdpa", ids, mask)
    torch.testing.assert_close(sdpa[:, 20:], eager[:, 20:], rtol=0, atol=1e-5)
    torch.testing.assert_close(sdpa[0], patched_logits("sdpa", ids[:1])[0], rtol=0, atol=1e-5)
    # the padded row's real tokens see exactly what they see without the pads
    torch.testing.assert_close(eager[1, 20:], patched_logits("eager", ids[1:, 20:])[0], rtol=0, atol=1e-5)


@pytest.mark.integration
def test_flex_attention_agrees_with_eager():
    if not _flex_compiles():
        pytest.skip("torch cannot compile flex_attention on this machine")
    ids, mask = padded_batch()
    flex, eager = patched_logits("flex_attention", ids, mask), patched_logits("eager", ids, mask)
    torch.testing.assert_close(flex[:, 20:], eager[:, 20:], rtol=0, atol=1e-5)


@torch.no_grad()
def decode_gap(model, ids, prefill: int) -> float:
    cache = DynamicCache(config=model.config)
    model(ids[:, :prefill], cache=cache, use_cache=True)
    steps = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(prefill, ids.shape[1])], 1)
    return (steps - model(ids).logits[:, prefill:]).abs().max().item()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("rope", ["ntk", "dynamic", None])
def test_cache_decoding_equals_full_forward(attn, rope):
    model = random_model(attn=attn)
    rope_ext.patch(model, "alibi_hybrid", factor=4, rope=rope, w=W)
    ids = random_ids(2 * WINDOW + 16, seed=3)
    assert decode_gap(model, ids, prefill=WINDOW - 10) <= 1e-5


def test_static_cache_is_refused():
    model = random_model()
    rope_ext.patch(model, "alibi_hybrid", factor=4, w=W)
    cache = StaticCache(config=model.config, max_cache_len=80)
    with pytest.raises(ValueError, match="static"):
        model(torch.randint(0, 97, (1, 8)), cache=cache, use_cache=True)


def test_native_glm():
    model = glm_model()
    ids = random_ids(2 * WINDOW, seed=4)
    with torch.no_grad():
        before = model(ids).logits
    rope_ext.patch(model, "alibi_hybrid", factor=4, rope=None, w=W)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after[:, : W + 1], before[:, : W + 1], rtol=0, atol=1e-5)  # no key past w yet
    assert (after[:, W + 1 :] - before[:, W + 1 :]).abs().max() > 1e-2
    assert decode_gap(model, ids, prefill=W) <= 1e-5
    rope_ext.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_inside_w_the_model_is_unchanged_and_unpatch_restores_exactly():
    model = random_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = random_ids(2 * WINDOW, seed=5)
    with torch.no_grad():
        before = model(ids).logits
    info = rope_ext.patch(model, "alibi_hybrid", factor=2, rope=None, trainable=True)
    assert info.params["w"] == WINDOW and info.max_length == 2 * WINDOW and info.native is None
    assert model.config._attn_implementation == "rope_ext_sdpa"
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after[:, : WINDOW + 1], before[:, : WINDOW + 1], rtol=0, atol=1e-6)
    assert (after[:, WINDOW + 1 :] - before[:, WINDOW + 1 :]).abs().max() > 1e-3
    rope_ext.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    assert rope_ext.describe(model) is None
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(name.endswith("slopes") for name, _ in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(w=-1), "w"),
        (dict(w=2.5), "w"),
        (dict(slope_scale=0), "slope_scale"),
        (dict(slope_scale=-1.0), "slope_scale"),
        (dict(slope_scale=float("nan")), "slope_scale"),
        (dict(rope="rerope"), "unknown rope"),
        (dict(rope="alibi_hybrid"), "unknown rope"),
        (dict(heads=[0, 4]), "out of range"),
        (dict(heads=[1, 1]), "heads"),
        (dict(heads=[]), "heads"),
        (dict(trainable="yes"), "trainable"),
        (dict(beta_fast=8.0), "unknown parameter"),  # ntk has no beta_fast
        (dict(rope=None, factor=1.0), "factor"),
    ],
)
def test_bad_parameters_are_refused_and_change_nothing(params, message):
    model = random_model()
    params = {"factor": 4, **params}
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, "alibi_hybrid", **params)
    assert rope_ext.describe(model) is None and model.config._attn_implementation == "sdpa"
    assert not hasattr(model.model.layers[0].self_attn, "rope_ext_alibi")


@pytest.mark.parametrize(
    "backend, params, message",
    [
        ("flash_attention_2", dict(w=16), "w=16"),
        ("flash_attention_2", dict(w=0, trainable=True), "trainable"),
        ("flex_attention", dict(trainable=True), "trainable"),
        (
            "paged|sdpa",
            dict(),
            "runs on the eager, sdpa, flex_attention or flash_attention_2 attention backend, not 'paged\\|sdpa'",
        ),
    ],
)
def test_backends_that_cannot_honour_the_bias_are_refused(backend, params, message):
    model = random_model()
    model.config._attn_implementation = backend  # the name is all the check reads
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, "alibi_hybrid", factor=4, **params)
    assert rope_ext.describe(model) is None and model.config._attn_implementation == backend


def test_rope_parameters_pass_through_and_repatching_replaces():
    model = random_model()
    info = rope_ext.patch(model, "alibi_hybrid", factor=4, rope="yarn", beta_fast=16.0, w=0)
    assert info.params["beta_fast"] == 16.0 and info.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    rope_ext.patch(model, "ntk", factor=2)
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model.model.layers[0].self_attn, "rope_ext_alibi")


def test_trainable_slopes_train_save_and_reload(tmp_path):
    model = random_model()
    rope_ext.patch(model, "alibi_hybrid", factor=4, rope="ntk", w=4, heads=[0, 1], trainable=True)
    slopes = [p for n, p in model.named_parameters() if n.endswith("rope_ext_alibi.slopes")]
    assert len(slopes) == 2 and all(p.shape == (2,) for p in slopes)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in slopes:
        p.requires_grad_(True)
    initial = [p.detach().clone() for p in slopes]
    ids = torch.randint(0, 97, (2, 100), generator=torch.Generator().manual_seed(6))
    optimizer = torch.optim.SGD(slopes, lr=1.0)
    model.train()
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in slopes)
    optimizer.step()
    assert any(not torch.equal(p, q) for p, q in zip(slopes, initial))
    model.eval()
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path).eval()
    assert rope_ext.describe(reloaded)["params"]["heads"] == [0, 1]
    for p, q in zip(slopes, [p for n, p in reloaded.named_parameters() if n.endswith("rope_ext_alibi.slopes")]):
        assert torch.equal(p, q)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=1e-6)


def test_slope_gradients_agree_between_sdpa_and_eager():
    """sdpa differentiates through the strided bias view, eager through materialized masks."""
    ids = torch.randint(0, 97, (2, 100), generator=torch.Generator().manual_seed(9))
    grads = {}
    for backend in ("eager", "sdpa"):
        model = random_model(attn=backend)
        rope_ext.patch(model, "alibi_hybrid", factor=4, w=4, heads=[0, 2, 3], trainable=True)
        model(ids, labels=ids).loss.backward()
        grads[backend] = torch.stack([p.grad for n, p in model.named_parameters() if n.endswith("rope_ext_alibi.slopes")])
    assert grads["eager"].abs().min() > 0
    torch.testing.assert_close(grads["sdpa"], grads["eager"], rtol=1e-4, atol=1e-7)


def test_peft_trains_slopes_as_modules_to_save():
    from peft import LoraConfig, get_peft_model

    model = random_model()
    rope_ext.patch(model, "alibi_hybrid", factor=4, w=4, trainable=True)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["rope_ext_alibi"]))
    trained = [n for n, p in peft_model.named_parameters() if p.requires_grad and "rope_ext_alibi" in n]
    assert len(trained) == 2
    ids = torch.randint(0, 97, (2, 100), generator=torch.Generator().manual_seed(7))
    peft_model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in peft_model.named_parameters() if n in trained)
    assert rope_ext.describe(peft_model)["method"] == "alibi_hybrid"
    rope_ext.unpatch(peft_model)
    assert not any("rope_ext_alibi" in n for n, _ in peft_model.named_parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash_attention_2 needs a CUDA GPU")
def test_flash_attention_2_agrees_with_sdpa():
    pytest.importorskip("flash_attn")
    ids = torch.randint(3, 97, (2, 200), generator=torch.Generator().manual_seed(8)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    out = {}
    for backend in ("sdpa", "flash_attention_2"):
        model = random_model(attn="sdpa").to("cuda", torch.bfloat16)
        model.config._attn_implementation = backend
        rope_ext.patch(model, "alibi_hybrid", factor=4, w=0)
        with torch.no_grad():
            out[backend] = model(ids, attention_mask=mask).logits.float()
    torch.testing.assert_close(out["flash_attention_2"][:, 30:], out["sdpa"][:, 30:], rtol=0, atol=5e-2)


@torch.no_grad()
def perplexities(model, stream: torch.LongTensor, length: int, n_segments: int, past: int) -> tuple[float, float]:
    """exp(mean NLL) over n_segments disjoint segments of `length` tokens: of all predicted tokens,
    and of the tokens at positions >= past."""
    nll = torch.cat(
        [
            torch.nn.functional.cross_entropy(model(ids[None]).logits[0, :-1], ids[1:], reduction="none")
            for ids in stream[: n_segments * length].view(n_segments, length)
        ]
    )
    per_position = nll.view(n_segments, length - 1)
    return math.exp(nll.mean().item()), math.exp(per_position[:, past - 1 :].mean().item())


@pytest.mark.integration
def test_trained_tiny_model_bias_beats_plain_rope_at_4x(tiny_path, heldout_ids):
    from transformers import LlamaForCausalLM

    window = AutoConfig.from_pretrained(tiny_path).max_position_embeddings
    length, segments = 4 * window, 6
    configs = {
        "plain RoPE": None,
        "ntk x4": ("ntk", {}),
        "yarn x4": ("yarn", {}),
        "alibi_hybrid(ntk x4, w=W)": ("alibi_hybrid", {"rope": "ntk"}),
        "alibi_hybrid(rope=None, w=W)": ("alibi_hybrid", {"rope": None}),
    }
    rows = {}
    for label, spec in configs.items():
        model = LlamaForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
        if spec is not None:
            rope_ext.patch(model, spec[0], factor=4, **spec[1])
        rows[label] = perplexities(model, heldout_ids, length, segments, past=window)
    print(f"\ntiny model (W={window}), {segments} held-out segments of {length} tokens; PPL all / past W")
    for label, (all_tokens, past) in rows.items():
        print(f"| {label} | {all_tokens:.2f} | {past:.2f} |")
    assert rows["alibi_hybrid(ntk x4, w=W)"][1] < 0.8 * rows["plain RoPE"][1]
