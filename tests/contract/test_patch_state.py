"""What a patch shares with the rest of the process, what it leaves behind and what it refuses
(issue #38): the original rotary module object comes back on unpatch, whatever the model was cast
to; a config two models share is not written through one of them; a KV cache that a
rotate-inside-attention patch filled with keys before rotation is refused once that patch is gone,
and its key positions follow the cache's own row operations; a torch.compile wrapper is patched
through; what cannot run is refused at patch(). Each test but the reset's fails on the code before
these fixes."""

from __future__ import annotations

import pytest
import torch
from helpers import WINDOW, left_padded, logits, random_config, random_ids, random_model
from transformers import AutoModelForCausalLM, DynamicCache

import rope_ext
from rope_ext.method import REGISTRY
from rope_ext.method.attention_side import AttentionMethod


@pytest.mark.parametrize("method", ["yarn", "dynamic", "self_extend"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unpatch_puts_back_the_rotary_module_it_replaced_after_a_cast(method, dtype):
    """The module the patch replaced, with its own (cast) buffers and the hooks a user put on it:
    logits after patch + unpatch equal those before, bit for bit, in the cast dtype."""
    model = random_model().to(dtype)
    original = model.model.rotary_emb
    calls = []
    original.register_forward_hook(lambda *args: calls.append(1))
    x = random_ids(WINDOW)
    before = logits(model, x)
    rope_ext.patch(model, method, factor=4)
    rope_ext.unpatch(model)
    assert model.model.rotary_emb is original and original.inv_freq.dtype == dtype
    calls.clear()
    assert torch.equal(logits(model, x), before) and calls


def test_a_patch_does_not_reach_a_model_that_shares_its_config(tmp_path):
    """transformers gives two models built from one config object that object; a patch of one
    leaves the other's config, forward and checkpoint as they were."""
    config = random_config()
    torch.manual_seed(0)
    first, second = AutoModelForCausalLM.from_config(config).eval(), AutoModelForCausalLM.from_config(config).eval()
    x = random_ids(2 * WINDOW)
    before, shared = logits(second, x), second.config.to_dict()
    rope_ext.patch(first, "dynamic", factor=4)
    assert second.config.to_dict() == shared and not hasattr(second.config, "rope_ext")
    assert torch.equal(logits(second, x), before)
    second.save_pretrained(tmp_path)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), x), before)
    assert first.model.layers[0].self_attn.config is first.config


def filled_under_dynamic():
    """(model patched with dynamic x4, ids past its window, a cache holding all but the last of them)."""
    model = random_model()
    rope_ext.patch(model, "dynamic", factor=4)
    x = random_ids(WINDOW + 8)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :-1], cache=cache, use_cache=True)
    return model, x, cache


@pytest.mark.parametrize("after", ["unpatch", "yarn", "dynamic"])
def test_a_cache_a_rotate_inside_patch_filled_is_refused_once_that_patch_is_gone(after):
    """dynamic keeps keys before rotation in the cache; unpatched, or patched anew (with a static
    method that expects rotated keys, or with another rotate-inside patch that does not know where
    they sit), the model would read them wrong: the next step raises instead."""
    model, x, cache = filled_under_dynamic()
    if after == "unpatch":
        rope_ext.unpatch(model)
    else:
        rope_ext.patch(model, after, factor=2)
    with pytest.raises(RuntimeError, match="start from a fresh cache"), torch.no_grad():
        model(x[:, -1:], cache=cache, use_cache=True)


def prefilled(model, batch, mask, positions, end):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(batch[:, :end], attention_mask=mask[:, :end], position_ids=positions[:, :end], cache=cache, use_cache=True)
    return cache


def step(model, cache, batch, mask, positions, end, rows):
    with torch.no_grad():
        return model(
            batch[rows, end : end + 1],
            attention_mask=mask[rows, : end + 1],
            position_ids=positions[rows, end : end + 1],
            cache=cache,
            use_cache=True,
        ).logits[:, -1]


@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
@pytest.mark.parametrize("operation", ["reorder_cache", "batch_select_indices", "batch_repeat_interleave"])
def test_key_positions_follow_the_cache_s_own_row_operations(method, operation):
    """A left-padded batch past the window (its rows' keys at other positions), then the cache's own
    row operation (beam search's reorder, dropping a finished row, repeating prompts) with the next
    step's rows moved the same way: each row decodes as it did before the move."""
    model = random_model()
    rope_ext.patch(model, method, factor=4)
    batch, mask, positions = left_padded(random_ids(WINDOW + 24, seed=3), pad=7)
    end = WINDOW + 20
    unmoved = step(model, prefilled(model, batch, mask, positions, end), batch, mask, positions, end, torch.tensor([0, 1]))
    rows, argument = {
        "reorder_cache": (torch.tensor([1, 0]), torch.tensor([1, 0])),
        "batch_select_indices": (torch.tensor([1]), torch.tensor([1])),
        "batch_repeat_interleave": (torch.tensor([0, 0, 1, 1]), 2),
    }[operation]
    cache = prefilled(model, batch, mask, positions, end)
    getattr(cache, operation)(argument)
    moved = step(model, cache, batch, mask, positions, end, rows)
    torch.testing.assert_close(moved, unmoved[rows], rtol=0, atol=1e-5)


def test_a_reset_cache_starts_over():
    model = random_model()
    rope_ext.patch(model, "dynamic", factor=4)
    x = random_ids(WINDOW + 8)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :WINDOW], cache=cache, use_cache=True)
        cache.reset()
        fresh = model(x, cache=cache, use_cache=True).logits
    torch.testing.assert_close(fresh, logits(model, x), rtol=0, atol=1e-5)


@pytest.mark.slow  # takes long
def test_a_torch_compile_wrapper_is_patched_through():
    """The patch goes to the model the wrapper calls: generate, save_pretrained and deepcopy answer
    through the wrapper, before and after unpatch."""
    import copy

    model = random_model()
    compiled = torch.compile(model)
    info = rope_ext.patch(compiled, "yarn", factor=4)
    assert rope_ext.describe(model)["max_length"] == info.max_length
    prompt = random_ids(6)
    assert compiled.generate(prompt, max_new_tokens=2, do_sample=False).shape == (1, 8)
    assert rope_ext.describe(copy.deepcopy(compiled)) == rope_ext.describe(model)
    rope_ext.unpatch(compiled)
    assert rope_ext.describe(model) is None and compiled.generate(prompt, max_new_tokens=2, do_sample=False).shape == (1, 8)


@pytest.mark.parametrize("method, params", [("dynamic", {}), ("dynamic_yarn", {}), ("longrope", {"long_factor": [2.0] * 8})])
def test_methods_that_group_queries_refuse_flex_attention_at_patch(method, params):
    model = random_model(attn="flex_attention")
    before = model.config.to_dict()
    with pytest.raises(ValueError, match="which the flex_attention backend's mask does not allow"):
        rope_ext.patch(model, method, factor=4, **params)
    assert model.config.to_dict() == before and rope_ext.describe(model) is None


@pytest.mark.parametrize("tiny", [1e-300, 1e-40, 1e-7])
def test_longrope_factors_that_would_give_infinite_frequencies_are_refused(tiny):
    model = random_model()
    with pytest.raises(ValueError, match=r"long_factor\[3\] must be a finite number in \[1/1048576, 1048576\]"):
        rope_ext.patch(model, "longrope", factor=4, long_factor=[1.0, 1.0, 1.0, tiny, 1.0, 1.0, 1.0, 1.0])
    assert rope_ext.describe(model) is None


def test_a_deepcopied_cache_is_refused_naming_the_copy():
    import copy

    model, x, cache = filled_under_dynamic()
    with pytest.raises(RuntimeError, match="a copy made with copy.deepcopy"), torch.no_grad():
        model(x[:, -1:], cache=copy.deepcopy(cache), use_cache=True)


def test_a_native_form_the_config_class_reads_otherwise_is_not_written(tmp_path):
    """Phi-3's config puts its top-level original_max_position_embeddings (the class default 4096)
    over the window a longrope form states, which moves the switch to the long factors: such a form
    would reload as another model, so the patch writes none and rope_ext.from_pretrained reloads it."""
    from census_configs import ids, tiny
    from census_configs import logits as census_logits

    model = tiny("phi3")
    assert model.config.original_max_position_embeddings != model.config.max_position_embeddings
    info = rope_ext.patch(model, "longrope", factor=4, long_factor=[2.0] * 8, causal=False)
    assert info.native is None
    model.save_pretrained(tmp_path)
    x = ids(3 * WINDOW)
    assert torch.equal(census_logits(rope_ext.from_pretrained(tmp_path).eval(), x), census_logits(model, x))


@pytest.mark.parametrize("model_type", ["cohere", "cohere2", "olmo2", "olmo3"])
def test_a_model_that_rotates_in_float32_at_half_precision_is_refused_for_that(model_type):
    """Cohere and OLMo 2/3 upcast queries and keys to rotate them: in bf16 rope-ext's rotation inside
    attention would round otherwise, and the refusal says so (not a norm or a pairing); in fp32 the
    same model takes the method."""
    from census_configs import tiny

    with pytest.raises(ValueError, match="rotates queries and keys in float32 and casts them back to bfloat16"):
        rope_ext.patch(tiny(model_type).to(torch.bfloat16), "self_extend", factor=4)
    assert rope_ext.patch(tiny(model_type), "self_extend", factor=4).method == "self_extend"


def test_a_peft_adapter_folder_without_the_patch_is_refused_naming_the_remedy(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = random_model()
    rope_ext.patch(model, "dynamic", factor=4)
    get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], r=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"is a peft adapter folder .* rope_ext\.saving\.save_record\(folder, base, model\)"):
        rope_ext.from_pretrained(tmp_path)
    # the remedy it names is a function (issue #51 item 9)
    from rope_ext.saving import save_record

    assert callable(save_record)


@pytest.mark.parametrize(
    "model_type, overrides, expected",
    [
        ("llama4_text", {"attention_chunk_size": 32}, {"attention_chunk_size": 32}),
        ("deepseek_v32", {"index_topk": 48}, {"index_topk": 48}),
        ("qwen4_exp_text", {}, {"indexer_budget": 8}),  # the census's 4 blocks of 2 tokens
        ("mistral", {"sliding_window": 32}, {"sliding_window": 32}),
        ("gemma3_text", {"sliding_window": 32, "layer_types": ["full_attention"] * 2}, {}),
    ],
)
def test_the_sizes_a_config_declares_are_read_from_the_fields_of_its_class(model_type, overrides, expected):
    """A chunk or an indexer's top-k: read where the architecture's config class declares the field,
    not where a config merely carries it; a sliding window where a layer uses it."""
    from census_configs import config_for
    from transformers import LlamaConfig

    from rope_ext.patches.llama import hiding_sizes

    assert hiding_sizes(config_for(model_type, **overrides)) == expected
    assert hiding_sizes(LlamaConfig(attention_chunk_size=32, index_topk=48)) == {}


def chunked(monkeypatch, chunk: int):
    """A LLaMA that attends in chunks of `chunk` tokens, as Llama 4's chunked layers do, and whose
    config declares it."""
    from transformers import masking_utils
    from transformers.models.llama import modeling_llama

    from rope_ext.patches import llama

    monkeypatch.setattr(modeling_llama, "create_causal_mask", masking_utils.create_chunked_causal_mask)
    monkeypatch.setattr(llama, "hiding_sizes", lambda config: {"attention_chunk_size": chunk})
    model = random_model()
    model.config.attention_chunk_size = chunk
    return model


@pytest.mark.parametrize("method", [name for name, m in REGISTRY.items() if isinstance(m, AttentionMethod)])
def test_a_chunk_shorter_than_the_patch_refuses_the_methods_that_compute_attention(method, monkeypatch):
    """The probe's few tokens sit inside a chunk: past it, a forward at the chunk plus PROBE_LENGTH
    tokens sees the keys each query is denied, and the methods that attend themselves are refused
    at patch(), changing nothing; the static ones apply."""
    model = chunked(monkeypatch, WINDOW // 2)
    before = model.config.to_dict()
    with pytest.raises(
        ValueError,
        match=r"the model's attention selects keys: at 40 tokens, past its config's attention_chunk_size 32, .* hides keys",
    ):
        rope_ext.patch(model, method, factor=4)
    assert model.config.to_dict() == before and rope_ext.describe(model) is None
    assert rope_ext.patch(model, "yarn", factor=4).native is not None


def test_a_declared_chunk_the_model_does_not_apply_is_proven_past_and_patched(monkeypatch):
    """A config that declares a chunk the model's attention never applies: the forward past it shows
    every earlier key, so the patch proceeds, exact inside the window."""
    from rope_ext.patches import llama

    monkeypatch.setattr(llama, "hiding_sizes", lambda config: {"attention_chunk_size": WINDOW // 2})
    model = random_model()
    x = random_ids(WINDOW, seed=3)
    before = logits(model, x)
    assert rope_ext.patch(model, "self_extend", factor=4).method == "self_extend"
    assert torch.equal(logits(model, x), before)


def test_a_backend_switch_keeps_the_patch_s_proof_of_the_keys_seen(monkeypatch):
    """The forward past a declared size runs once, at patch(): switching the patched model's
    backend keeps its proof (each backend computes the same attention) and its logits."""
    from rope_ext.patches import llama
    from rope_ext.patches.probe import PROBE_LENGTH

    monkeypatch.setattr(llama, "hiding_sizes", lambda config: {"attention_chunk_size": WINDOW // 2})
    forwards = []
    monkeypatch.setattr(llama, "keys_at", lambda model, length: forwards.append(length) or [])
    model = random_model()
    x = random_ids(3 * WINDOW, seed=5)
    rope_ext.patch(model, "rerope", factor=4)
    assert forwards == [WINDOW // 2 + PROBE_LENGTH]
    patched = logits(model, x)
    model.set_attn_implementation("eager")
    model.set_attn_implementation("sdpa")
    assert forwards == [WINDOW // 2 + PROBE_LENGTH]
    torch.testing.assert_close(logits(model, x), patched, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_a_sliding_window_is_proven_to_be_the_declared_one(model_type, monkeypatch):
    """Past a sliding window the forward sees each query's band of keys, which must be the config's
    window; a band of another width (here: a config declaring a wider window than the model's
    layers apply) is refused."""
    from census_configs import tiny

    from rope_ext.patches import llama
    from rope_ext.patches.probe import keys_at

    model = tiny(model_type, sliding_window=WINDOW // 2)
    assert {keys for _, keys in keys_at(model, WINDOW)} <= {None, WINDOW // 2}
    assert WINDOW // 2 in {keys for _, keys in keys_at(model, WINDOW)}
    monkeypatch.setattr(llama, "hiding_sizes", lambda config: {"sliding_window": WINDOW * 3 // 4})
    with pytest.raises(ValueError, match=r"hides all but the last 32 keys"):
        rope_ext.patch(model, "rerope", factor=4, original_window=WINDOW)
    assert rope_ext.describe(model) is None
