"""Multi-head latent attention (DeepSeek-V2/V3 and the models built like them): each head's queries
and keys are unrotated channels followed by `qk_rope_head_dim` rotated ones (the key's shared
across heads), DeepSeek-V3's kin take those in interleaved pairs and hand attention their halves,
and DeepSeek's YaRN sets the softmax scale at construction from `mscale_all_dim`. Every MLA type
of the installed transformers that builds tiny is either patched exactly or refused with a reason
from patches.probe.REASONS, per method, on fp32 logits:

- the static frequency methods equal transformers' natively configured twin (the patched config,
  reloaded by transformers alone) bit for bit inside and past the window, the softmax scale
  included, or, needing a fully rotated head, refuse;
- the methods that rotate inside rope-ext's attention rotate the channels the model rotates: the
  first window's logits equal the unpatched model's wherever they do on a LLaMA (MOE_TOLERANCE:
  expert routing amplifies a changed summation order), and `dynamic` equals transformers' own past
  the window;

Each case runs every registered method its declarations (rotation, requirements) select.
- decoding equals the full forward; rope_ext.from_pretrained and unpatch are bit-exact."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import rope_ext
from rope_ext.attention import base_name
from rope_ext.method import REGISTRY
from rope_ext.patches.probe import REASONS, probe
from census_configs import VOCAB, ids, logits, norms_moved
from helpers import (
    computes_attention,
    leaves_the_trained_window,
    patch_params,
    registered,
    rotates_inside_attention,
    takes_a_partial_rotation,
)
from test_census import check, decode_gap

WINDOW = 32
ROPE_DIM, NOPE_DIM = 8, 8
# The tiny MLA shape; keys a config does not know become unused attributes.
SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=ROPE_DIM,
    qk_nope_head_dim=NOPE_DIM,
    v_head_dim=8,
    head_dim=ROPE_DIM,  # the rotary module's width
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    zero_expert_num=2,  # longcat_flash
    expert_ffn_hidden_size=32,
    ffn_hidden_size=128,
    index_topk=16,  # sparse-attention indexers keep 16 keys: past 16 tokens their ranking counts
    vocab_size=VOCAB,
    max_position_embeddings=WINDOW,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# interleave: DeepSeek-V3's kin rotate interleaved pairs of their rope channels
PATCHED = {
    "deepseek_v3": {"rope_interleave": True},
    "deepseek_v3 halves": {"rope_interleave": False},
    "minicpm3": {},
    "glm4_moe_lite": {},
    "longcat_flash": {},
    "youtu": {},
    "sarvam_mla": {},
    "axk1": {},
    "axk2": {},
    "deepseek_v32": {},
    "glm_moe_dsa": {},
    "hy_v4": {},
    "bailing_hybrid": {"layer_group_size": 2},  # one linear-attention layer, one MLA layer
}
EAGER_ONLY = ("hy_v4",)  # transformers runs its attention on the eager backend only
# The reason each type refuses the methods that rotate inside attention (dynamic ones among them):
# a sparse-attention indexer ranks keys by scores of its own rotated queries and keys, which such a
# method would hand an identity rotation; hy_v4's learned sinks refuse those that compute attention.
REFUSED_INSIDE = {name: "rotation-elsewhere" for name in ("axk2", "deepseek_v32", "glm_moe_dsa", "hy_v4")}
ATTENTION_REFUSED = {"hy_v4": "attention"}
# the methods with a native form: the static frequency changes, which need nothing of attention
FREQUENCY = registered(lambda method: method.rotation == "static" and not method.needs_attention_interface)
INSIDE_ATTENTION = registered(rotates_inside_attention)
MOE_TOLERANCE = 1e-5
DECODE_TOLERANCE = 1e-4


def mla(name: str, rope_parameters: dict | None = None):
    """The tiny fp32 model of `name` (a model type, or a PATCHED key), norm weights moved from 1."""
    model_type = name.split()[0]
    overrides = dict(PATCHED.get(name, {}))
    if rope_parameters is not None:
        overrides["rope_parameters"] = rope_parameters
    config = CONFIG_MAPPING[model_type](**{**SHAPE, **overrides})
    config._attn_implementation = "eager" if model_type in EAGER_ONLY else "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return norms_moved(model)


def twin_of(model, rope_parameters: dict, max_position_embeddings: int):
    """`model`'s weights in a model transformers alone builds from its config with these values."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "rope_ext"):
        del config.rope_ext
    config.rope_parameters = copy.deepcopy(rope_parameters)
    config.max_position_embeddings = max_position_embeddings
    config._attn_implementation = base_name(config._attn_implementation)
    twin = AutoModelForCausalLM.from_config(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def scalings(model) -> list[float]:
    return [layer.self_attn.scaling for layer in model.model.layers]


@pytest.mark.parametrize("name", PATCHED)
def test_probe_finds_the_trailing_rotated_channels(name):
    structure = probe(mla(name))
    assert (structure.channels, structure.layout) == ("trailing", "half")  # interleaved pairs arrive as halves
    assert (structure.rotary_dim, structure.head_dim) == (ROPE_DIM, ROPE_DIM + NOPE_DIM)
    assert all(structure.rope)


@pytest.mark.parametrize("method", FREQUENCY)
@pytest.mark.parametrize("name", PATCHED)
def test_frequency_methods_equal_the_native_twin(name, method, tmp_path):
    model = mla(name)
    inside, past = ids(WINDOW), ids(2 * WINDOW, seed=1)
    reference = logits(model, inside)
    if not takes_a_partial_rotation(method):  # these rotate part of each head
        with pytest.raises(ValueError, match=f"^{method}: "):
            rope_ext.patch(model, method, factor=4, **patch_params(method, model))
        assert not hasattr(model.config, "rope_ext") and torch.equal(logits(model, inside), reference)
        return
    info = rope_ext.patch(model, method, factor=4, **patch_params(method, model))
    assert info.native is not None and (info.head_dim, info.rotary_dim) == (ROPE_DIM + NOPE_DIM, ROPE_DIM)
    twin = twin_of(model, model.config.rope_parameters, model.config.max_position_embeddings)
    assert torch.equal(logits(model, past), logits(twin, past))
    assert decode_gap(model, past[:, : WINDOW + 8], WINDOW - 4) <= DECODE_TOLERANCE
    if method == "yarn":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(tmp_path)
        assert torch.equal(logits(rope_ext.from_pretrained(tmp_path).eval(), past), logits(model, past))
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, inside), reference)


def moe_tolerance(model) -> float:
    return MOE_TOLERANCE if any("expert" in key for key, _ in model.named_modules()) else 0.0


@pytest.mark.parametrize("method", INSIDE_ATTENTION)
@pytest.mark.parametrize("name", PATCHED)
def test_methods_inside_attention_rotate_the_models_channels(name, method):
    """Those that leave a LLaMA's trained window as it was leave this model's too."""
    model = mla(name)
    inside, past = ids(WINDOW), ids(WINDOW + 16, seed=1)
    reference = logits(model, inside)
    computes = computes_attention(REGISTRY[method])
    reason = ATTENTION_REFUSED.get(name, REFUSED_INSIDE.get(name)) if computes else REFUSED_INSIDE.get(name)
    if reason is not None:
        with pytest.raises(ValueError, match=re.escape(f"{method}: {REASONS[reason]}")):
            rope_ext.patch(model, method, factor=4, **patch_params(method, model))
        assert not hasattr(model.config, "rope_ext") and torch.equal(logits(model, inside), reference)
        return
    rope_ext.patch(model, method, factor=4, **patch_params(method, model))
    if leaves_the_trained_window(method):
        assert (logits(model, inside) - reference).abs().max().item() <= moe_tolerance(model)
    assert decode_gap(model, past, WINDOW - 4) <= DECODE_TOLERANCE
    rope_ext.unpatch(model)
    assert torch.equal(logits(model, inside), reference)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3 halves", "minicpm3"])
def test_dynamic_equals_transformers_past_the_window(name):
    """Past the window, rope-ext's rotation inside attention (of un-rotated cached keys) gives the
    logits transformers' own dynamic NTK gives with the model's rotation: the same channels turn."""
    model = mla(name)
    past = ids(2 * WINDOW, seed=1)
    info = rope_ext.patch(model, "dynamic", factor=4, causal=False)
    twin = twin_of(model, info.native, model.config.max_position_embeddings)
    gap = (logits(model, past) - logits(twin, past)).abs().max().item()
    assert gap <= moe_tolerance(model)


def test_string_keeps_the_rows_below_its_shift():
    """STRING for the trained window (factor 1: the trained frequencies) moves distances past its
    shift S, so the queries below S keep their logits and the others do not."""
    model = mla("deepseek_v3")
    past = ids(WINDOW, seed=1)
    reference = logits(model, past)
    shift = rope_ext.patch(model, "string", factor=1).params["shift"]
    patched = logits(model, past)
    assert 0 < shift < past.shape[1]
    assert (patched[:, :shift] - reference[:, :shift]).abs().max().item() <= MOE_TOLERANCE
    assert (patched[:, shift:] - reference[:, shift:]).abs().max().item() > 10 * MOE_TOLERANCE
    assert decode_gap(model, past, shift - 4) <= DECODE_TOLERANCE


# DeepSeek-V3's checkpoint: YaRN x40 over a 4K window, mscale and mscale_all_dim 1 (here x2 over 32)
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 2.0,
    "original_max_position_embeddings": WINDOW,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


@pytest.mark.parametrize("name", ["deepseek_v3", "minicpm3", "glm4_moe_lite"])
def test_a_yarn_patch_sets_the_softmax_scale_transformers_builds(name):
    """DeepSeek's YaRN with mscale_all_dim multiplies the softmax scale, set at construction, by
    mscale(factor)^2; a patch that replaces the checkpoint's factor (original_window=; the shipped
    mscale and mscale_all_dim are its defaults) sets the scale transformers builds from the patched
    config, and unpatch puts the checkpoint's back."""
    model = mla(name, {**DEEPSEEK_YARN})
    window = 2 * WINDOW
    model.config.max_position_embeddings = window
    past = ids(3 * WINDOW, seed=1)
    before, reference = scalings(model), logits(model, past)
    info = rope_ext.patch(model, "yarn", factor=4, original_window=WINDOW)
    twin = twin_of(model, model.config.rope_parameters, model.config.max_position_embeddings)
    assert scalings(model) == scalings(twin) != before
    assert torch.equal(logits(model, past), logits(twin, past))
    assert info.native["factor"] == 4
    rope_ext.unpatch(model)
    assert scalings(model) == before
    assert torch.equal(logits(model, past), reference)


def test_attention_side_methods_keep_the_checkpoints_softmax_scale_unless_it_is_replaced(tmp_path):
    """Extending the checkpoint as loaded, self_extend keeps its yarn scaling, mscale_all_dim's
    softmax scale included: inside the shipped window it is the checkpoint. Replacing the scaling
    (original_window=) drops the softmax scale with the frequencies: inside the window self_extend
    is then the model without the scaling (rope_type default), also reloaded by
    rope_ext.from_pretrained from a config that keeps the checkpoint's scaling."""
    model = mla("deepseek_v3", {**DEEPSEEK_YARN})
    inside, past = ids(WINDOW), ids(2 * WINDOW, seed=1)
    shipped = copy.deepcopy(model)
    rope_ext.patch(shipped, "self_extend", factor=4)
    assert scalings(shipped) == scalings(model)
    assert (logits(shipped, past) - logits(model, past)).abs().max().item() <= MOE_TOLERANCE
    trained = twin_of(model, {"rope_type": "default", "rope_theta": 10000.0}, model.config.max_position_embeddings)
    before = scalings(model)
    rope_ext.patch(model, "self_extend", factor=4, original_window=WINDOW, allow_shrink=True)
    assert scalings(model) == scalings(trained) != before
    assert (logits(model, inside) - logits(trained, inside)).abs().max().item() <= MOE_TOLERANCE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path).eval()
    assert scalings(reloaded) == scalings(model)
    assert torch.equal(logits(reloaded, past), logits(model, past))
    rope_ext.unpatch(model)
    assert scalings(model) == before


def test_deepseek_v2_complex_rotation_takes_the_static_methods_only(tmp_path):
    """DeepSeek-V2's rotary module returns complex `freqs_cis`, which the model multiplies with its
    queries and keys itself (as Llama 4's, tests/patches/test_llama4.py): the static methods patch it exactly
    (the census's check), the methods rotating inside attention are refused, model unchanged."""
    model = mla("deepseek_v2")
    refusals = {}
    assert check(model, tmp_path, refusals) is None
    x = ids(WINDOW)
    before = logits(model, x)
    for method in INSIDE_ATTENTION:
        with pytest.raises(
            ValueError, match=re.escape(f"{method} rotates queries and keys inside attention, and {REASONS['rotation']}")
        ):
            rope_ext.patch(model, method, factor=4, **patch_params(method, model))
    assert not hasattr(model.config, "rope_ext")
    assert torch.equal(logits(model, x), before)
