"""The checkpoints users load most, from configs shaped like their published config.json (issues
#26 and #37): the rope_parameters, window and attention options each checkpoint ships, every length
divided by one ratio per checkpoint so that its pretraining window is the census's tiny window (64),
on the census's tiny size. Each is put through the census's check (tests/patches/test_census.py): yarn
equal to transformers' natively configured twin, attention-side methods exact inside the window or
refused with a listed reason, decode equal to the full forward, save/reload and unpatch exact.

A checkpoint that ships a scaling is extended from the model as loaded (rope_ext.shipped): its
frequencies and temperature are the base, the context it serves is the window, no patch reads less
without being asked, and re-applying its own scaling with original_window= gives it bit for bit."""

from __future__ import annotations

import ast
import copy
import json
import logging
import re
import warnings

import pytest
import torch
from helpers import computes_attention, leaves_the_trained_window, registered, required_params
from test_census import WINDOW, check, ids, logits, tiny
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import rope_ext
from rope_ext.method import REGISTRY
from rope_ext.patching import engine_verdicts
from rope_ext.record import UNLISTED_KEYS

# microsoft/Phi-3.5-mini-instruct config.json rope_scaling (type longrope), as published at
# https://huggingface.co/microsoft/Phi-3.5-mini-instruct/blob/main/config.json; the hub is not
# reachable here, so the values are read from the copy of that config.json in
# sdpython/experimental-experiment, _doc/recipes/plot_exporter_recipes_c_phi35.py, which links it.
# fmt: off
PHI35_SHORT_FACTOR = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
    1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
    2.749999523162842, 2.8399994373321533,
]
PHI35_LONG_FACTOR = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
    1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
    4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
    17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
    50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
    62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
    63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
    64.51000213623047, 64.52999877929688, 64.83999633789062,
]
# fmt: on
assert len(PHI35_SHORT_FACTOR) == len(PHI35_LONG_FACTOR) == 48

SHAPES = {
    # meta-llama/Llama-3.1-8B config.json: max_position_embeddings 131072, rope_theta 500000, llama3
    # {factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192} (ratio 128)
    "llama-3.1": (
        "llama",
        {
            "max_position_embeddings": WINDOW * 16,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": WINDOW,
            },
        },
    ),
    # Qwen/Qwen2.5-7B-Instruct config.json (max_position_embeddings 32768, rope_theta 1e6) with the
    # yarn block its model card adds for 128k: {factor 4, original_max_position_embeddings 32768} (ratio 512)
    "qwen2.5-yarn": (
        "qwen2",
        {
            "max_position_embeddings": WINDOW,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": WINDOW,
            },
            "use_sliding_window": False,
        },
    ),
    # Qwen/Qwen3-8B config.json: max_position_embeddings 40960, rope_theta 1e6, no scaling; its model
    # card states a native context of 32768 (ratio 512: 80 over 64), which no config field says
    "qwen3": ("qwen3", {"max_position_embeddings": WINDOW * 40960 // 32768, "rope_parameters": {"rope_theta": 1000000.0}}),
    # mistralai/Mistral-Nemo-Base-2407 config.json: max_position_embeddings 1024000, rope_theta 1e6,
    # head_dim 128, no scaling, for a 128k training context (its model card; ratio 2048: 500 over 64)
    "mistral-nemo": (
        "mistral",
        {"max_position_embeddings": 1024000 // 2048, "sliding_window": None, "rope_parameters": {"rope_theta": 1000000.0}},
    ),
    # mistralai/Mistral-7B-v0.1: a 4096-token sliding window in every layer
    "mistral-swa": (
        "mistral",
        {"sliding_window": WINDOW // 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    # mistralai/Mistral-7B-v0.3: no sliding window, theta 1e6
    "mistral-full": ("mistral", {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # google/gemma-2-2b: local/global layers, logit softcaps, query_pre_attn_scalar
    "gemma-2": (
        "gemma2",
        {
            "sliding_window": WINDOW // 2,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # google/gemma-3-4b-it config.json, text_config: max_position_embeddings 131072, linear {factor 8}
    # on the global layers (rope_theta 1e6) over a 32768-token pretraining window, local layers at
    # rope_local_base_freq 1e4 (ratio 512; the sliding window kept shorter than the window, as 1024 is)
    "gemma-3": (
        "gemma3_text",
        {
            "sliding_window": WINDOW // 2,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": WINDOW * 4,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # microsoft/Phi-3.5-mini-instruct config.json: max_position_embeddings 131072,
    # original_max_position_embeddings 4096, sliding_window 262144, hidden_size 3072 over 32 heads
    # (head_dim 96: 48 frequency pairs), longrope with the published 48-entry factor lists (ratio 64)
    "phi-3.5-mini": (
        "phi3",
        {
            "hidden_size": 192,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 96,
            "max_position_embeddings": WINDOW * 32,
            "original_max_position_embeddings": WINDOW,
            "sliding_window": WINDOW * 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": PHI35_SHORT_FACTOR,
                "long_factor": PHI35_LONG_FACTOR,
                "original_max_position_embeddings": WINDOW,
            },
        },
    ),
    # deepseek-ai/DeepSeek-V3 config.json: max_position_embeddings 163840, rope_theta 10000, yarn
    # {factor 40, beta_fast 32, beta_slow 1, mscale 1.0, mscale_all_dim 1.0,
    # original_max_position_embeddings 4096} (ratio 64)
    "deepseek-v3": (
        "deepseek_v3",
        {
            "index_topk": None,  # the census's MLA shape sets it for DeepSeek-V3.2; V3's config has none
            "max_position_embeddings": WINDOW * 40,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": WINDOW,
            },
        },
    ),
    # meta-llama/Llama-4-Scout-17B-16E config.json, text_config: max_position_embeddings 10485760,
    # rope_theta 500000, llama3 {factor 16, low_freq_factor 1, high_freq_factor 1,
    # original_max_position_embeddings 8192}, attention_chunk_size 8192, every fourth layer without
    # RoPE (no_rope_layers), attn_temperature_tuning with floor_scale 8192, attn_scale 0.1 (ratio 128)
    "llama-4-scout": (
        "llama4_text",
        {
            "num_hidden_layers": 4,
            "intermediate_size_mlp": 128,
            "num_experts_per_tok": 1,
            "max_position_embeddings": 10485760 // 128,
            "attention_chunk_size": WINDOW,
            "no_rope_layers": [1, 1, 1, 0],
            "attn_temperature_tuning": True,
            "floor_scale": WINDOW,
            "attn_scale": 0.1,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": WINDOW,
            },
        },
    ),
    # HuggingFaceTB/SmolLM3-3B: every fourth layer without RoPE
    "smollm3": (
        "smollm3",
        {
            "num_hidden_layers": 4,
            "no_rope_layer_interval": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},
        },
    ),
    # openai/gpt-oss-20b config.json: max_position_embeddings 131072, rope_theta 150000, yarn {factor 32,
    # beta_fast 32, beta_slow 1, truncate false, original_max_position_embeddings 4096} (ratio 64),
    # learned sinks, sliding (128) and full layers alternating
    "gpt-oss": (
        "gpt_oss",
        {
            "max_position_embeddings": WINDOW * 32,
            "sliding_window": WINDOW // 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": WINDOW,
            },
        },
    ),
}

# Attention-side methods each shape refuses, by the reason key (patches/probe.py REASONS, or the
# methods' own refusal of sliding-window layers); every other method patches it exactly.
# What patch() needs of a shape: Phi-3.5's longrope switches frequency sets at its pretraining
# window, so no patch extends it unchanged; it is replaced, over that window, by a patch meant
# for fewer tokens than it serves (x4 where it serves x32), which must be asked for.
GIVEN = {"phi-3.5-mini": {"original_window": WINDOW, "allow_shrink": True}}
REFUSED = {
    "gemma-3": {"sink_window": "sliding-window", "dca": "sliding-window"},
    "mistral-swa": {"sink_window": "sliding-window", "dca": "sliding-window"},
    "gemma-2": {"self_extend": "attention", "sink_window": "sliding-window", "dca": "sliding-window"},
    "gpt-oss": {"self_extend": "attention", "sink_window": "sliding-window", "dca": "sliding-window"},
    # Llama 4 multiplies complex freqs_cis into its queries and keys itself (and attends in chunks)
    "llama-4-scout": {"self_extend": "rotation", "sink_window": "rotation", "dca": "rotation"},
}
# shapes that ship a scaling a patch extends, and the context each serves as loaded
EXTENDED = {
    "llama-3.1": WINDOW * 16,
    "qwen2.5-yarn": WINDOW * 4,
    "gemma-3": WINDOW * 4,
    "deepseek-v3": WINDOW * 40,
    "gpt-oss": WINDOW * 32,
    "llama-4-scout": 10485760 // 128,
}
# each shipped scaling re-applied with original_window=: (method, factor)
OWN = {"llama-3.1": ("llama3", 8.0), "qwen2.5-yarn": ("yarn", 4.0), "deepseek-v3": ("yarn", 40.0), "gpt-oss": ("yarn", 32.0)}


def model_of(shape: str):
    model_type, config = SHAPES[shape]
    return tiny(model_type, **config)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_published_shapes_are_patched_exactly(shape, tmp_path):
    from test_census import method_reason

    model = model_of(shape)
    assert model is not None, f"{shape} does not build"
    refusals = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "rope_ext: the trained window is taken")
        assert check(model, tmp_path, refusals, **GIVEN.get(shape, {})) is None
    assert {method: method_reason(message) for method, message in refusals.items()} == REFUSED.get(shape, {})


@pytest.mark.slow
def test_inside_gpt_oss_window_dynamic_is_the_unpatched_forward_over_those_tokens():
    """gpt-oss's eager attention with learned sinks (issue #51 item 11): under dynamic, the rows of
    an input past the served window that sit inside it are the unpatched model's forward over those
    tokens, bit for bit; its own rows of the longer forward move by 2.4e-7, as docs/concepts.md
    states where it promises exactness inside the window."""
    from pathlib import Path

    promise = (Path(__file__).resolve().parents[2] / "docs" / "concepts.md").read_text()
    assert "gpt-oss's eager attention with its learned sinks does not" in promise
    model = model_of("gpt-oss")
    served = EXTENDED["gpt-oss"]
    x = ids(served + 100)
    with torch.no_grad():
        alone = model(x[:, :served]).logits
        rope_ext.patch(model, "dynamic", factor=2)
        assert torch.equal(model(x).logits[:, :served], alone)


@pytest.mark.parametrize("shape", sorted(EXTENDED))
def test_a_shipped_scaling_is_the_base_and_its_context_the_window(shape):
    model = model_of(shape)
    info = rope_ext.patch(model, "yarn", factor=4)
    served = EXTENDED[shape]
    scaling = "linear" if shape == "gemma-3" else SHAPES[shape][1]["rope_parameters"]["rope_type"]
    assert (info.original_window, info.max_length) == (served, 4 * served)
    assert info.starts_from["scaling"] == scaling and info.starts_from["source"] == "the shipped scaling"


@pytest.mark.parametrize("shape", ["llama-3.1", "qwen2.5-yarn"])
@pytest.mark.parametrize(
    "method", registered(lambda method: computes_attention(method) and leaves_the_trained_window(method.name))
)
def test_attention_side_methods_leave_the_shipped_model_inside_its_whole_window(shape, method):
    """At the full context the checkpoint serves (16x and 4x the pretraining window), not at 8 tokens."""
    model = model_of(shape)
    x = ids(EXTENDED[shape])
    shipped = logits(model, x)
    rope_ext.patch(model, method, factor=4)
    assert torch.equal(logits(model, x), shipped)


@pytest.mark.parametrize("shape", ["llama-3.1", "qwen2.5-yarn"])
def test_string_rotates_with_the_shipped_frequencies(shape):
    """STRING is exact below its shift S (past it, distances move by design); over a shipped scaling
    it rotates with the shipped frequencies, as its authors run it over Llama 3.1's llama3."""
    model = model_of(shape)
    info = rope_ext.patch(copy.deepcopy(model), "string", factor=1)
    x = ids(info.params["shift"])
    patched = copy.deepcopy(model)
    rope_ext.patch(patched, "string", factor=1)
    assert torch.equal(logits(patched, x), logits(model, x))


@pytest.mark.parametrize("shape", sorted(OWN))
def test_the_shipped_scaling_re_applied_is_the_shipped_model(shape, tmp_path):
    """With original_window= a method of the shipped type replaces the scaling; the shipped
    parameters (gpt-oss's truncate false, DeepSeek's mscale and mscale_all_dim, whose softmax
    temperature reaches every channel) are its defaults, and the patch is the checkpoint bit for bit,
    past the pretraining window too."""
    model = model_of(shape)
    x = ids(3 * WINDOW, seed=2)
    shipped = logits(model, x)
    method, factor = OWN[shape]
    info = rope_ext.patch(model, method, factor=factor, original_window=WINDOW)
    assert torch.equal(logits(model, x), shipped)
    assert info.max_length == max(EXTENDED[shape], int(WINDOW * factor)) and info.native is not None
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["max_position_embeddings"] == info.max_length


def test_deepseek_s_temperature_was_lost_without_its_mscale():
    """The test above can fail: the same patch without DeepSeek's mscale keys moves the temperature."""
    model = model_of("deepseek-v3")
    x = ids(3 * WINDOW, seed=2)
    shipped = logits(model, x)
    rope_ext.patch(model, "yarn", factor=40.0, original_window=WINDOW, mscale=None, mscale_all_dim=None)
    assert not torch.equal(logits(model, x), shipped)


@pytest.mark.parametrize("shape", sorted(EXTENDED))
def test_a_patch_that_reads_less_than_the_checkpoint_is_refused_unless_asked(shape):
    model = model_of(shape)
    before = copy.deepcopy(model.config.to_dict())
    with pytest.raises(ValueError, match="fewer than the .* this checkpoint serves"):
        rope_ext.patch(model, "yarn", factor=2, original_window=WINDOW)
    assert model.config.to_dict() == before and rope_ext.describe(model) is None
    info = rope_ext.patch(model, "yarn", factor=2, original_window=WINDOW, allow_shrink=True)
    assert info.max_length == 2 * WINDOW and info.starts_from == {"scaling": None, "window": WINDOW, "source": "original_window="}


@pytest.mark.parametrize("given", [{"mscale_all_dim": 0.5}, {"mscale": 1.0, "mscale_all_dim": 1.0}])
def test_a_temperature_split_the_shipped_scaling_fixes_is_refused_before_the_model_changes(given):
    """DeepSeek's mscale_all_dim sets the softmax scale too, which an extension keeps as shipped:
    a split given to it would leave cos/sin and the softmax unmatched (even with the shipped values,
    which give the extension no temperature at all). Refused, naming the remedy; with it, accepted."""
    model = model_of("deepseek-v3")
    x = ids(2 * WINDOW, seed=5)
    config, shipped = copy.deepcopy(model.config.to_dict()), logits(model, x)
    modules = [(name, type(module)) for name, module in model.named_modules()]
    named = re.escape(f"mscale_all_dim={given['mscale_all_dim']!r} contradicts")
    with pytest.raises(ValueError, match=rf"{named} .* \(mscale 1\.0, mscale_all_dim 1\.0 .*original_window={WINDOW}$"):
        rope_ext.patch(model, "yarn", factor=2, **given)
    assert model.config.to_dict() == config and rope_ext.describe(model) is None
    assert [(name, type(module)) for name, module in model.named_modules()] == modules
    assert torch.equal(logits(model, x), shipped)
    info = rope_ext.patch(model, "yarn", factor=80, original_window=WINDOW, **given)
    assert info.params["mscale_all_dim"] == given["mscale_all_dim"]


@pytest.mark.parametrize("model", ["qwen2.5-yarn", "ministral3"])
def test_a_temperature_split_is_the_extension_s_own_where_no_softmax_takes_the_shipped_one(model):
    """Qwen2.5's yarn states no split; ministral3's states mscale and mscale_all_dim 1.0, which its
    attention does not read: the split given to the extension is its own ratio on cos/sin."""
    model = tiny("ministral3") if model == "ministral3" else model_of(model)
    info = rope_ext.patch(model, "yarn", factor=2, mscale=1.0, mscale_all_dim=0.5)
    assert info.starts_from["scaling"] == "yarn" and info.params["mscale_all_dim"] == 0.5


def test_a_window_that_contradicts_the_shipped_scaling_is_refused():
    model = model_of("llama-3.1")
    with pytest.raises(ValueError, match="contradicts the checkpoint's llama3 scaling"):
        rope_ext.patch(model, "yarn", factor=64, original_window=WINDOW // 2)
    assert rope_ext.describe(model) is None


@pytest.mark.parametrize("shape", ["qwen3", "mistral-nemo"])
def test_a_window_taken_from_max_position_embeddings_alone_is_stated(shape):
    model = model_of(shape)
    with pytest.warns(UserWarning, match="taken as .* from max_position_embeddings alone"):
        info = rope_ext.patch(model, "yarn", factor=4)
    assert info.starts_from["source"] == "max_position_embeddings"
    assert info.original_window == SHAPES[shape][1]["max_position_embeddings"]
    rope_ext.unpatch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the card's window, stated: no warning
        stated = rope_ext.patch(model, "yarn", factor=8, original_window=WINDOW)
    assert stated.original_window == WINDOW and stated.starts_from["source"] == "original_window="


def test_a_shipped_longrope_is_refused_with_the_way_to_replace_it():
    model = model_of("phi-3.5-mini")
    with pytest.raises(ValueError, match=f"pass original_window={WINDOW}"):
        rope_ext.patch(model, "yarn", factor=4)
    assert rope_ext.describe(model) is None


@pytest.mark.parametrize("shape", ["llama-3.1", "qwen2.5-yarn"])
def test_an_extension_of_a_shipped_scaling_is_written_as_one_longrope(shape, tmp_path):
    """llama3 (or yarn) then yarn: one longrope type with equal short and long lists and an explicit
    attention factor, which plain transformers reloads bit for bit past the shipped window."""
    from transformers import AutoModelForCausalLM

    model = model_of(shape)
    info = rope_ext.patch(model, "yarn", factor=2)
    assert info.native["rope_type"] == "longrope" and info.native["short_factor"] == info.native["long_factor"]
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_position_embeddings"] == info.max_length
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = ids(EXTENDED[shape] + 40, seed=3)
    assert torch.equal(logits(plain, x), logits(model, x))


@pytest.mark.parametrize("shape", sorted(EXTENDED))
def test_unpatch_gives_back_the_checkpoint_s_own_scaling(shape):
    model = model_of(shape)
    x = ids(2 * WINDOW, seed=4)
    shipped, rope = logits(model, x), copy.deepcopy(model.config.rope_parameters)
    rope_ext.patch(model, "yarn", factor=8)
    rope_ext.unpatch(model)
    assert model.config.rope_parameters == rope and torch.equal(logits(model, x), shipped)


def verdicts_of(model, info) -> dict:
    return engine_verdicts(model, info.native is not None)


@pytest.mark.parametrize(
    "shape, method, factor, given",
    [
        ("llama-3.1", "yarn", 2.0, {}),
        ("qwen2.5-yarn", "ntk", 2.0, {}),
        ("gemma-3", "yarn", 2.0, {}),
        ("gemma-3", "linear", 4.0, {"original_window": WINDOW}),
        ("deepseek-v3", "yarn", 40.0, {"original_window": WINDOW}),
        ("gpt-oss", "yarn", 32.0, {"original_window": WINDOW}),
    ],
)
def test_the_engines_serve_these_shapes_as_patched(shape, method, factor, given):
    """Gemma 3's linear writes the length itself (no engine multiplies a factor nested per layer
    type); DeepSeek's own yarn is what the engines' deepseek_yarn computes."""
    model = model_of(shape)
    info = rope_ext.patch(model, method, factor=factor, **given)
    assert model.config.max_position_embeddings == info.max_length
    assert set(verdicts_of(model, info).values()) == {"as patched"}


def test_the_engines_rewrite_deepseek_s_other_rope_types(tmp_path):
    """vLLM and SGLang serve any DeepSeek-V2/V3 rope type but default as deepseek_yarn: a linear
    patch does not load in vLLM and is YaRN in SGLang; the save says so."""
    model = model_of("deepseek-v3")
    info = rope_ext.patch(model, "linear", factor=40.0, original_window=WINDOW)
    found = verdicts_of(model, info)
    assert found["vLLM 0.30-0.34"].endswith("needs original_max_position_embeddings: the checkpoint does not load")
    assert found["SGLang 0.5.23"] == "not as patched: it serves DeepSeek's linear as deepseek_yarn"
    with pytest.warns(UserWarning, match="SGLang 0.5.23 not as patched: it serves DeepSeek's linear as deepseek_yarn"):
        model.save_pretrained(tmp_path)


def test_the_per_family_table_holds():
    """docs/serving.md's table per published shape: what each engine serves from the written config."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = doc[doc.index("## Per family") :]
    rows = re.findall(r"^\| ([\w.-]+) \| (\w+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", section, flags=re.MULTILINE)
    assert rows[0][:2] == ("shape", "method") and len(rows[1:]) == 4 * 9
    for shape, method, *cells in rows[1:]:
        model = model_of(shape)
        info = rope_ext.patch(model, method, factor=4, **GIVEN.get(shape, {}))
        expected = ["as patched" if info.native else "unpatched", *verdicts_of(model, info).values()]
        assert [cell.strip() for cell in cells] == expected, (shape, method)


def test_ministral3_keeps_the_window_its_query_scale_reads():
    """ministral3 scales its queries by 1 + beta ln(1 + floor(p / original_max_position_embeddings)),
    read from rope_parameters at forward time: the longrope a patch over its shipped yarn writes keeps
    that window, so the query scale stays the shipped one, and plain transformers reloads the patch."""
    model = tiny("ministral3")
    shipped = copy.deepcopy(model.config.rope_parameters)
    info = rope_ext.patch(model, "yarn", factor=2)
    assert info.starts_from["scaling"] == "yarn" and info.native["rope_type"] == "longrope"
    written = model.config.rope_parameters
    assert written["original_max_position_embeddings"] == shipped["original_max_position_embeddings"]
    assert written["llama_4_scaling_beta"] == shipped["llama_4_scaling_beta"]


class Logged(logging.Handler):
    """The messages transformers logs at WARNING or above while it is attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, entry: logging.LogRecord) -> None:
        self.messages.append(entry.getMessage())

    def __enter__(self):
        hf_logging.get_logger().addHandler(self)
        return self.messages

    def __exit__(self, *exc):
        hf_logging.get_logger().removeHandler(self)


def unlisted(message: str) -> bool:
    """Whether `message` is transformers' "Unrecognized keys" naming only UNLISTED_KEYS of its type."""
    found = re.match(r"Unrecognized keys in `rope_parameters` for 'rope_type'='(\w+)': (\{.*\})$", message)
    return found is not None and ast.literal_eval(found[2]) <= UNLISTED_KEYS.get(found[1], set())


@pytest.mark.slow  # takes long
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_written_checkpoint_loads_without_a_transformers_warning(shape, tmp_path):
    """Every method on every published shape: patch() and rope_ext.from_pretrained of the saved
    checkpoint log nothing the shipped checkpoint's own load does not (Llama-4-Scout's config logs its
    equal llama3 frequency factors); a plain transformers load adds only "Unrecognized keys" naming
    UNLISTED_KEYS, the engines' keys and proportional's factor, which transformers does not list."""
    base = model_of(shape)
    base.save_pretrained(tmp_path / "shipped")
    with Logged() as own:
        AutoModelForCausalLM.from_pretrained(tmp_path / "shipped")
    patched = set()
    for method in REGISTRY:
        model = copy.deepcopy(base)
        with Logged() as at_patch:
            try:  # the census's head of 16 rotates 8 pairs in every shape
                rope_ext.patch(model, method, factor=4, **GIVEN.get(shape, {}), **required_params(method, 8))
            except ValueError:  # refused before any change, as test_published_shapes_are_patched_exactly lists
                continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # save_pretrained's own warnings about engines are rope-ext's, not these
            model.save_pretrained(tmp_path / method)
        with Logged() as reloaded:
            rope_ext.from_pretrained(tmp_path / method)
        with Logged() as plain:
            AutoConfig.from_pretrained(tmp_path / method)
        assert set(at_patch) <= set(own) and set(reloaded) <= set(own), (method, at_patch, reloaded)
        assert all(unlisted(message) for message in set(plain) - set(own)), (method, plain)
        patched.add(method)
    assert {"linear", "yarn", "llama3"} <= patched  # every shape takes these (MLA refuses proportional)
