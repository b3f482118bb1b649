"""Dynamic methods under the KV cache: decoding token by token past the window must give the same
logits as a full forward over the same prefix (transformers issue #25104), assisted decoding the
tokens of greedy decoding, and a cache the patch did not write is refused."""

import copy
import warnings

import pytest
import torch
from transformers import DynamicCache

import rope_ext

from helpers import DYNAMIC_METHODS, WINDOW, glm_model, greedy, in_another_thread, native_twin, random_ids, random_model


@torch.no_grad()
def worst_decode_gap(model, ids, prefill, check_every=7):
    """Max |decode logits - full-forward logits| over decode steps from `prefill` to the end."""
    cache = DynamicCache(config=model.config)
    model(ids[:, :prefill], cache=cache, use_cache=True)
    worst = 0.0
    for t in range(prefill, ids.shape[1]):
        step = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1]
        if (t - prefill) % check_every == 0 or t == ids.shape[1] - 1:
            full = model(ids[:, : t + 1]).logits[0, -1]
            worst = max(worst, (step - full).abs().max().item())
    return worst


@pytest.mark.integration
@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_trained_model_decode_equals_full_forward(tiny_model, heldout_ids, method, attn):
    tiny_model.set_attn_implementation(attn)
    window = tiny_model.config.max_position_embeddings
    rope_ext.patch(tiny_model, method, factor=4)
    ids = heldout_ids[None, : 3 * window]
    assert worst_decode_gap(tiny_model, ids, prefill=window - 8) <= 1e-4


@pytest.mark.integration
def test_transformers_native_dynamic_fails_the_same_check(tiny_model, heldout_ids):
    """The bug we fix, measured on the same model: native dynamic drifts past the window."""
    window = tiny_model.config.max_position_embeddings
    native = native_twin(tiny_model, {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    ids = heldout_ids[None, : 3 * window]
    assert worst_decode_gap(native, ids, prefill=window - 8) > 1e-2


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_decode_equals_full_forward_on_other_families(family):
    model = random_model(family)
    rope_ext.patch(model, "dynamic", factor=4, granularity=4)
    ids = random_ids(3 * WINDOW)
    assert worst_decode_gap(model, ids, prefill=WINDOW // 2, check_every=13) <= 1e-5


@pytest.mark.parametrize("granularity", [1, 16])
def test_chunked_prefill_equals_one_forward(tiny_model, heldout_ids, granularity):
    window = tiny_model.config.max_position_embeddings
    rope_ext.patch(tiny_model, "dynamic", factor=4, granularity=granularity)
    ids = heldout_ids[None, : 4 * window]
    with torch.no_grad():
        full = tiny_model(ids).logits
        cache = DynamicCache(config=tiny_model.config)
        chunks = [tiny_model(chunk, cache=cache, use_cache=True).logits for chunk in ids.split(window - 3, dim=1)]
    assert (torch.cat(chunks, dim=1) - full).abs().max() <= 1e-4


def test_causal_schedule_makes_early_logits_independent_of_later_tokens(tiny_model, heldout_ids):
    """transformers' dynamic rescales every token for the longest one, so appending text changes
    the model's predictions for text it has already read; the causal schedule does not."""
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, : 4 * window]
    causal = copy.deepcopy(tiny_model)
    rope_ext.patch(causal, "dynamic", factor=4)
    rope_ext.patch(tiny_model, "dynamic", factor=4, causal=False)
    with torch.no_grad():
        for model, expect_equal in ((causal, True), (tiny_model, False)):
            short = model(ids[:, : 2 * window]).logits
            long = model(ids).logits[:, : 2 * window]
            assert torch.allclose(short, long, atol=1e-4) == expect_equal


def test_greedy_generate_with_left_padding_matches_single_rows(tiny_model, tiny_tokenizer, heldout_ids):
    window = tiny_model.config.max_position_embeddings
    rope_ext.patch(tiny_model, "dynamic", factor=4)
    pad = tiny_tokenizer.pad_token_id
    long, short = heldout_ids[: window + 20], heldout_ids[1000 : 1000 + window - 10]
    batch = torch.full((2, len(long)), pad)
    batch[0] = long
    batch[1, -len(short) :] = short
    mask = (torch.arange(len(long))[None] >= torch.tensor([[0], [len(long) - len(short)]])).long()
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        together = tiny_model.generate(batch, attention_mask=mask, **settings)[:, len(long) :]
        alone = [tiny_model.generate(row[None], **settings)[0, len(row) :] for row in (long, short)]
    assert torch.equal(together[0], alone[0])
    assert torch.equal(together[1], alone[1])


@pytest.mark.parametrize("method", DYNAMIC_METHODS)
def test_assisted_decoding_equals_greedy_decoding(tiny_model, heldout_ids, method):
    rope_ext.patch(tiny_model, method, factor=4)
    prompt = heldout_ids[None, 500:600]  # generation runs past the 128-token window
    plain = greedy(tiny_model, prompt, 60)
    assert torch.equal(greedy(tiny_model, prompt, 60, prompt_lookup_num_tokens=3), plain)


def test_a_longer_cache_than_the_patch_wrote_is_still_refused(tiny_model, heldout_ids):
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        tiny_model(heldout_ids[None, :10], cache=cache, use_cache=True)
    rope_ext.patch(tiny_model, "dynamic", factor=4)
    with pytest.raises(RuntimeError, match="did not write"), torch.no_grad():
        tiny_model(heldout_ids[None, 10:11], cache=cache, use_cache=True)


def test_flash_backends_see_their_own_name_under_the_wrapper():
    """transformers' flash backends load their kernel by `module.config._attn_implementation`; under
    a patch that names the rope-ext wrapper, so the wrapper must show them the backend's name. A
    stand-in flash backend (sdpa arithmetic under a name containing "flash") records what it sees."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = []

    def flash_stand_in(module, *args, **kwargs):
        seen.append(module.config._attn_implementation)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register("flash_stand_in", flash_stand_in)
    ALL_MASK_ATTENTION_FUNCTIONS.register("flash_stand_in", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    reference = random_model("llama")
    model = copy.deepcopy(reference)
    model.config._attn_implementation = "flash_stand_in"  # set after init, which would load a kernel
    ids = torch.randint(0, 97, (1, 3 * WINDOW))
    for m in (model, reference):
        rope_ext.patch(m, "dynamic", factor=4)
    with torch.no_grad():
        # the sdpa reference attends each group in calls without a mask (causal_parts), the stand-in
        # through the backend with the group's mask: one function, other roundings
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    assert model.config._attn_implementation == "rope_ext_flash_stand_in"
    assert seen and set(seen) == {"flash_stand_in"}


@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_patch_info_states_what_the_causal_schedule_costs(method):
    notes = rope_ext.patch(random_model(), method, factor=4, granularity=8).notes
    assert "granularity 8" in notes["schedule_cost"] and "R / 8 groups" in notes["schedule_cost"]
    assert "schedule_cost" not in rope_ext.patch(random_model(), method, factor=4, causal=False).notes
    assert "schedule_cost" not in rope_ext.patch(random_model(), "yarn", factor=4).notes


@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_the_default_granularity_is_an_eighth_of_the_window_and_says_so(method):
    info = rope_ext.patch(random_model(), method, factor=4)
    assert info.params["granularity"] == WINDOW // 8
    assert f"granularity {WINDOW // 8} (the default, 1/8 of the trained window)" in info.notes["schedule_cost"]
    explicit = rope_ext.patch(random_model(), method, factor=4, granularity=1)
    assert explicit.params["granularity"] == 1 and "(the default" not in explicit.notes["schedule_cost"]


def test_a_forward_in_many_groups_says_once_what_it_costs(tiny_model):
    model = copy.deepcopy(tiny_model)
    rope_ext.patch(model, "dynamic", factor=4, granularity=1)
    x = random_ids(2 * tiny_model.config.max_position_embeddings)
    with pytest.warns(UserWarning, match="dynamic: this forward attends its rows past the trained window in"), torch.no_grad():
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(x)  # once per patch
    for settings in ({"granularity": 64}, {}):  # the default: 1/8 of the window, 8 groups here
        quick = copy.deepcopy(tiny_model)
        rope_ext.patch(quick, "dynamic", factor=4, **settings)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                quick(x)
    # a set granularity that still makes many groups: the advice counts from it, not from 1
    coarse = copy.deepcopy(tiny_model)
    rope_ext.patch(coarse, "dynamic", factor=4, granularity=2)
    rows = tiny_model.config.max_position_embeddings  # x's rows past the window
    with (
        pytest.warns(
            UserWarning,
            match=rf"in {rows // 2 + 1} groups \(the causal schedule at granularity 2.*about {2 * (rows // 2 + 1)} / g groups",
        ),
        torch.no_grad(),
    ):
        coarse(x)


@torch.no_grad()
def decode_steps(model, ids, cache, steps: int, before_each=lambda step: None) -> list[torch.Tensor]:
    """The logits of a prefill of all but `steps` tokens of `ids`, then of one token at a time."""
    prefill = ids.shape[1] - steps
    spans = [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]
    out = []
    for step, (start, stop) in enumerate(spans):
        before_each(step)
        out.append(model(ids[:, start:stop], cache=cache, use_cache=True).logits)
    return out


@pytest.mark.parametrize("method", ["dynamic", "dpe", "string", "self_extend", "dca", "sink_window", "yarn"])
def test_two_threads_decode_on_one_patched_model_each_with_its_cache(method):
    """One patched model, two threads, each decoding its own prompt with its own KV cache (issue #51
    item 4): every step of the second thread runs while the first one's is inside its forward, at
    every layer boundary of that forward, and both give the logits each gives alone, bit for bit."""
    model = random_model()
    rope_ext.patch(model, method, factor=4)
    first, second = random_ids(WINDOW + 20, seed=1), random_ids(WINDOW + 30, seed=2)
    alone = [decode_steps(model, ids, DynamicCache(config=model.config), 3) for ids in (first, second)]

    second_cache, second_out, pending = DynamicCache(config=model.config), [], []
    spans = iter([(0, second.shape[1] - 3)] + [(t, t + 1) for t in range(second.shape[1] - 3, second.shape[1])])

    @torch.no_grad()
    def second_step():
        start, stop = next(spans)
        return model(second[:, start:stop], cache=second_cache, use_cache=True).logits

    def inside_first(module, args):
        if pending:
            pending.pop()
            second_out.append(in_another_thread(second_step))

    hook = model.model.layers[1].register_forward_pre_hook(inside_first)
    try:
        together = decode_steps(model, first, DynamicCache(config=model.config), 3, lambda step: pending.append(step))
    finally:
        hook.remove()
    second_out = [step.result() for step in second_out]
    assert all(torch.equal(a, b) for a, b in zip(together, alone[0]))
    assert len(second_out) == 4 and all(torch.equal(a, b) for a, b in zip(second_out, alone[1]))


@pytest.mark.parametrize("method", ["dynamic", "dpe", "string", "sink_window"])
def test_a_filled_cache_pickles_and_its_copy_is_refused_on_use_with_the_remedy(tmp_path, method):
    """torch.save of a KV cache a rotate-inside-attention patch filled (issue #51 item 5): it saves
    as the unpatched cache does; the copy loaded back, whose keys' positions stay with the patch
    that wrote the original, is refused on use as a deepcopy is, and the original decodes on."""
    model = random_model()
    rope_ext.patch(model, method, factor=4)
    ids = random_ids(WINDOW + 11)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache, use_cache=True)
    torch.save(cache, tmp_path / "cache.pt")
    copied = torch.load(tmp_path / "cache.pt", weights_only=False)  # the file this test wrote
    with pytest.raises(RuntimeError, match=r"did not write.*torch\.save.*start from a fresh cache"), torch.no_grad():
        model(ids[:, -1:], cache=copied, use_cache=True)
    with torch.no_grad():
        step = model(ids[:, -1:], cache=cache, use_cache=True).logits[0, -1]
        assert torch.allclose(step, model(ids).logits[0, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["dynamic", "self_extend", "dca"])
def test_a_backward_in_another_thread_re_runs_attention_with_the_forwards_positions(method):
    """Gradient checkpointing re-runs attention in backward, which on a GPU runs in autograd's own
    thread, one that ran no forward: it takes the latest forward's frame (rope_ext.rotary.ForwardState),
    and its gradients are those of a backward in the forward's thread, bit for bit."""
    grads = []
    for backward in (lambda loss: loss.backward(), lambda loss: in_another_thread(loss.backward).result()):
        model = random_model()
        rope_ext.patch(model, method, factor=4)
        model.gradient_checkpointing_enable()
        model.train()
        ids = random_ids(2 * WINDOW + 20)
        backward(model(ids, labels=ids).loss)
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class FusedCalls:
    """Counts the calls of attend_with_lse's CPU kernel and the masks they carry."""

    def __init__(self, monkeypatch):
        self.calls, self.masked = 0, 0
        original = rope_ext.attention.parts.FUSED["cpu"]

        def counted(*args, mask=None, **kwargs):
            self.calls += 1
            self.masked += mask is not None
            return original(*args, mask=mask, **kwargs)

        monkeypatch.setitem(rope_ext.attention.parts.FUSED, "cpu", counted)


@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_groups_attend_without_masks_as_the_backend_would_with_them(method, monkeypatch):
    """On sdpa, a forward's groups attend in fused calls without a mask (each group's causal square
    and the keys before it, merged by log-sum-exp), the same function as the backend with each
    group's causal mask, which a forward under autograd still takes (the kernels' log-sum-exp
    carries no gradient)."""
    model = random_model()
    rope_ext.patch(model, method, factor=4, granularity=8)  # 3 windows past it: 24 groups
    ids = random_ids(4 * WINDOW)
    calls = FusedCalls(monkeypatch)
    with torch.no_grad():
        unmasked = model(ids).logits
    assert calls.calls >= 2 * 24 * model.config.num_hidden_layers and calls.masked == 0
    calls.calls = 0
    masked = model(ids).logits.detach()
    assert calls.calls == 0
    torch.testing.assert_close(unmasked, masked, rtol=0, atol=1e-5)


def test_groups_without_masks_rotate_interleaved_partial_heads_as_the_masked_path():
    """The unmasked groups rotate each group's key prefix into one buffer (schedule.PrefixRotation):
    on GLM's heads, interleaved pairs in the first half of the channels and the rest passed through,
    the same logits as the masked path (a forward under autograd), and decoding as one forward."""
    model = glm_model()
    rope_ext.patch(model, "dynamic", factor=4, granularity=8)
    ids = random_ids(4 * WINDOW)
    with torch.no_grad():
        unmasked = model(ids).logits
    torch.testing.assert_close(unmasked, model(ids).logits.detach(), rtol=0, atol=1e-5)
    assert worst_decode_gap(model, ids[:, : 2 * WINDOW], prefill=WINDOW + 4, check_every=11) <= 1e-5
