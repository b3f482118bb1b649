"""Remote-code ChatGLM2 / ChatGLM3 / GLM-4 through the real `trust_remote_code=True` path, and the
converter to native GLM.

The fixture (tests/fixtures/chatglm) is written from the documented interface of the hub code; its
`rope_generation` field picks which generation's code it behaves like (see its configuration file).
Weights are random but large enough that positions matter: each equality below is paired with a
check that the thing it compares moves by far more than the tolerance when the rotary is wrong."""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GlmForCausalLM

import rope_ext
from rope_ext.commands.convert_chatglm import add_arguments
from rope_ext.patches.chatglm.convert import convert_chatglm, ratio_meaning_from_code, run
from rope_ext.patches.chatglm.adapter import ChatGLMRotaryEmbedding, read_convention, reference_table

from helpers import cli_error_line, frequency_scaling, registered, takes_a_factor_alone, takes_a_partial_rotation

FIXTURE = Path(__file__).parents[1] / "fixtures" / "chatglm"
WINDOW = 32  # the fixtures' seq_length
# generation -> (rope_ratio, what it means, effective base, position ratio)
GENERATIONS = {
    "chatglm2": (4, "positions", 10000.0, 4.0),
    "chatglm3": (50, "base", 500000.0, 1.0),
    "glm4": (50, "base", 500000.0, 1.0),
}
# The frequency scalings that take a factor alone (not ntk_alpha, which needs alpha, nor longrope, its
# lists) and run on GLM's half-rotated heads (not proportional, which needs a fully rotated one).
METHODS = registered(
    lambda method: frequency_scaling(method) and takes_a_factor_alone(method) and takes_a_partial_rotation(method.name)
)
TOL = 1e-4


def write_checkpoint(folder: Path, generation: str, seed: int = 0) -> Path:
    """A local remote-code checkpoint: config.json with auto_map, the fixture's code, random weights."""
    folder.mkdir(parents=True)
    for path in FIXTURE.glob("*.py"):
        shutil.copy(path, folder)
    ratio = GENERATIONS[generation][0]
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "chatglm",
                "architectures": ["ChatGLMForConditionalGeneration"],
                "auto_map": {
                    "AutoConfig": "configuration_chatglm.ChatGLMConfig",
                    "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
                    "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
                },
                "rope_ratio": ratio,
                "rope_generation": generation,
                "seq_length": WINDOW,
                "pad_token_id": 0,
                "eos_token_id": 2,
            }
        )
    )
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:  # sharper attention than torch's default init, so rotary changes show in the logits
                p.copy_(noise / p.shape[1] ** 0.5 * (2.0 if "query_key_value" in name else 1.0))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chatglm")
    return {g: write_checkpoint(root / g, g) for g in GENERATIONS}


def load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs).eval()


def ids(length, batch=2, seed=1):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def positions(x):
    return torch.arange(x.shape[1]).expand(x.shape[0], -1)


@torch.no_grad()
def remote_logits(model, x):
    return model(x, position_ids=positions(x)).logits


@torch.no_grad()
def native_logits(model, x):
    return model(x).logits


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    return {g: convert_chatglm(load(path), root / g).dst for g, path in checkpoints.items()}


def test_fixture_loads_through_the_remote_code_path(checkpoints):
    for path in checkpoints.values():
        for auto in (AutoModelForCausalLM, AutoModel):
            model = auto.from_pretrained(path, trust_remote_code=True)
            assert type(model).__module__.startswith("transformers_modules.")
            assert model.config.model_type == "chatglm"
            assert tuple(model.transformer.rotary_pos_emb(WINDOW).shape) == (WINDOW, 4, 2)


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_rope_ratio_meaning_is_read_from_the_live_module(checkpoints, generation):
    ratio, meaning, base, position_ratio = GENERATIONS[generation]
    model = load(checkpoints[generation])
    del model.config.rope_generation  # the fixture's switch: the adapter must not need it
    info = rope_ext.patch(model, "linear", factor=4)
    record = model.config.rope_ext["original"]
    assert (record["rope_ratio"], record["rope_ratio_meaning"], record["base"], record["position_ratio"]) == (
        ratio,
        meaning,
        base,
        position_ratio,
    )
    assert (info.base, info.original_window, info.max_length, info.rotary_dim, info.layout) == (
        base,
        WINDOW,
        4 * WINDOW,
        8,
        "interleaved",
    )
    # linear composes with the checkpoint's own scaling: theta_i / (position ratio * factor)
    theta = 1.0 / base ** (torch.arange(0, 8, 2).float() / 8)
    assert torch.allclose(model.transformer.rotary_pos_emb.scaled_inv_freq, theta / (position_ratio * 4), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "generation,dtype,position_dtype",
    [
        ("chatglm2", torch.float16, "float16"),
        ("chatglm2", torch.bfloat16, "bfloat16"),
        ("chatglm3", torch.float16, "float32"),
    ],
)
def test_position_dtype_is_read_and_patched_positions_are_fp32(checkpoints, generation, dtype, position_dtype):
    model = load(checkpoints[generation], dtype=dtype)
    rotary = model.transformer.rotary_pos_emb
    assert read_convention(rotary, model.config, 16)["position_dtype"] == position_dtype
    original = rotary(16390)
    rope_ext.patch(model, "linear", factor=512)  # 16390 tokens are inside 512 x 32
    patched = model.transformer.rotary_pos_emb(16390)
    _, _, base, position_ratio = GENERATIONS[generation]
    theta = 1.0 / base ** (torch.arange(0, 8, 2).float() / 8) / (512 * position_ratio)
    angles = torch.arange(16390).float()[:, None] * theta
    assert patched.dtype == dtype
    assert torch.equal(patched, torch.stack((angles.cos(), angles.sin()), -1).to(dtype))
    if position_dtype == "float16":  # ChatGLM2 in fp16: 16385 rounds to 16384; the patch does not
        assert torch.equal(original[16384], original[16385]) and not torch.equal(patched[16384], patched[16385])


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_converted_model_reproduces_the_source(checkpoints, converted, generation):
    source, native = load(checkpoints[generation]), GlmForCausalLM.from_pretrained(converted[generation]).eval()
    x = ids(WINDOW)
    assert (remote_logits(source, x) - native_logits(native, x)).abs().max() <= TOL
    ratio, meaning, base, _ = GENERATIONS[generation]
    rope = native.config.rope_parameters
    if meaning == "base":
        assert (rope["rope_type"], rope["rope_theta"]) == ("default", base)
    else:
        assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("linear", ratio, 10000.0)
    assert native.config.max_position_embeddings == WINDOW and native.config.head_dim == 16
    assert rope["partial_rotary_factor"] == 0.5 and native.config.num_key_value_heads == 2


def test_converter_from_a_folder_needs_or_reads_the_ratio_meaning(checkpoints, tmp_path):
    # The fixture's code holds every generation's formula, so its meaning cannot be read statically.
    with pytest.raises(ValueError, match="pass rope_ratio_meaning"):
        convert_chatglm(checkpoints["chatglm2"], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(checkpoints["chatglm2"]), str(tmp_path / "cli"), "--rope-ratio-meaning", "positions"])) == 0
    with pytest.raises(FileExistsError, match="not empty"):
        convert_chatglm(checkpoints["chatglm2"], tmp_path / "cli", rope_ratio_meaning="positions")
    native = GlmForCausalLM.from_pretrained(tmp_path / "cli").eval()
    x = ids(WINDOW)
    assert (remote_logits(load(checkpoints["chatglm2"]), x) - native_logits(native, x)).abs().max() <= TOL
    # ... and the wrong meaning is caught by the same comparison
    convert_chatglm(checkpoints["chatglm2"], tmp_path / "wrong", rope_ratio_meaning="base")
    wrong = GlmForCausalLM.from_pretrained(tmp_path / "wrong").eval()
    assert (remote_logits(load(checkpoints["chatglm2"]), x) - native_logits(wrong, x)).abs().max() > 100 * TOL


def test_convert_chatglm_to_an_existing_file(checkpoints, tmp_path, capsys):
    dst = tmp_path / "taken"
    dst.write_text("mine")
    line = cli_error_line(
        ["convert-chatglm", str(checkpoints["chatglm2"]), str(dst), "--rope-ratio-meaning", "positions"], capsys
    )
    assert "taken is a file, not a folder" in line
    assert dst.read_text() == "mine"


def test_convert_chatglm_names_the_flag_on_the_command_line(checkpoints, tmp_path, capsys):
    line = cli_error_line(["convert-chatglm", str(checkpoints["chatglm2"]), str(tmp_path / "out")], capsys)
    assert "pass --rope-ratio-meaning base" in line and "--rope-ratio-meaning positions" in line
    assert "rope_ratio_meaning=" not in line
    assert not (tmp_path / "out").exists()


def test_ratio_meaning_is_read_from_each_generations_code():
    chatglm2_32k = "def forward_impl(self, n):\n    seq_idx = torch.arange(n, dtype=dtype) / self.rope_ratio\n"
    chatglm3_32k = "def forward_impl(self, n, base=10000):\n    base = base * self.rope_ratio\n"
    assert ratio_meaning_from_code(chatglm2_32k) == "positions"
    assert ratio_meaning_from_code(chatglm3_32k) == "base"
    assert ratio_meaning_from_code(chatglm2_32k + chatglm3_32k) is None
    assert ratio_meaning_from_code("x = 1\n") is None


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_patched_remote_model_equals_converted_native_model_patched_the_same_way(checkpoints, converted, generation):
    source, native = load(checkpoints[generation]), GlmForCausalLM.from_pretrained(converted[generation]).eval()
    x = ids(3 * WINDOW)
    inside = x[:, :WINDOW]
    plain = remote_logits(source, inside)
    for method in METHODS:
        remote_info = rope_ext.patch(source, method, factor=4)
        native_info = rope_ext.patch(native, method, factor=4)
        assert (remote_info.base, remote_info.original_window, remote_info.max_length) == (
            native_info.base,
            native_info.original_window,
            native_info.max_length,
        )
        assert (remote_logits(source, x) - native_logits(native, x)).abs().max() <= TOL, method
        change = (remote_logits(source, inside) - plain).abs().max()
        if rope_ext.methods()[method]["dynamic"]:  # the checkpoint's own angles up to its window
            assert change <= TOL, method
        else:  # static methods change every position, inside the window too
            assert change > 100 * TOL, method


@pytest.mark.parametrize("generation", ["chatglm2", "glm4"])  # sequence-first and batch-first
@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_dynamic_decode_equals_full_forward_past_the_window(checkpoints, generation, method):
    model = load(checkpoints[generation])
    x = ids(2 * WINDOW + 8)
    pos = positions(x)

    @torch.no_grad()
    def decode(prefill):
        out = model(x[:, :prefill], position_ids=pos[:, :prefill])
        steps = [out.logits]
        for i in range(prefill, x.shape[1]):
            out = model(x[:, i : i + 1], position_ids=pos[:, i : i + 1], past_key_values=out.past_key_values)
            steps.append(out.logits)
        return torch.cat(steps, dim=1)

    rope_ext.patch(model, method, factor=4)
    full = remote_logits(model, x)
    assert (decode(WINDOW - 12) - full).abs().max() <= TOL
    with torch.no_grad():  # a prefill that crosses the window, then a chunk
        first = model(x[:, : WINDOW + 5], position_ids=pos[:, : WINDOW + 5])
        rest = model(x[:, WINDOW + 5 :], position_ids=pos[:, WINDOW + 5 :], past_key_values=first.past_key_values)
    assert (torch.cat((first.logits, rest.logits), 1) - full).abs().max() <= TOL
    # One scaling per forward (transformers' schedule) is what makes decoding disagree; the test sees it.
    rope_ext.patch(model, method, factor=4, causal=False)
    assert (decode(WINDOW - 12) - remote_logits(model, x)).abs().max() > 100 * TOL


def test_dynamic_refuses_a_cache_it_did_not_write(checkpoints):
    model = load(checkpoints["chatglm3"])
    x = ids(WINDOW)
    with torch.no_grad():
        past = model(x[:, :10], position_ids=positions(x)[:, :10]).past_key_values
    rope_ext.patch(model, "dynamic", factor=4)
    with pytest.raises(RuntimeError, match="did not write"), torch.no_grad():
        model(x[:, 10:11], position_ids=positions(x)[:, 10:11], past_key_values=past)


def test_dynamic_with_flash_attention_core_is_refused(checkpoints):
    model = load(checkpoints["chatglm3"])
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="eager or sdpa"):
        rope_ext.patch(model, "dynamic", factor=4)
    assert not isinstance(model.transformer.rotary_pos_emb, ChatGLMRotaryEmbedding)


@pytest.mark.parametrize("method", METHODS)
def test_unpatch_restores_exactly(checkpoints, method):
    model = load(checkpoints["chatglm2"])
    x = ids(WINDOW)
    before, state = remote_logits(model, x), {k: v.clone() for k, v in model.state_dict().items()}
    rotary, config = model.transformer.rotary_pos_emb, copy.deepcopy(model.config.to_dict())
    rope_ext.patch(model, "yarn", factor=2)
    rope_ext.patch(model, method, factor=4)  # a repatch replaces
    assert set(model.state_dict()) == set(state)  # the checkpoint's keys, inv_freq included
    rope_ext.unpatch(model)
    assert model.transformer.rotary_pos_emb is rotary
    assert torch.equal(remote_logits(model, x), before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.config.to_dict() == config
    assert not model.transformer._forward_pre_hooks and not model.transformer._forward_hooks
    assert all("forward" not in layer.self_attention.core_attention.__dict__ for layer in model.transformer.encoder.layers)


def test_without_core_attention_a_static_patch_unpatches(checkpoints):
    model = load(checkpoints["chatglm3"])
    for layer in model.transformer.encoder.layers:
        del layer.self_attention.core_attention
    rotary = model.transformer.rotary_pos_emb
    config = copy.deepcopy(model.config.to_dict())
    rope_ext.patch(model, "yarn", factor=4)
    rope_ext.unpatch(model)
    assert model.transformer.rotary_pos_emb is rotary and rope_ext.describe(model) is None
    assert model.config.to_dict() == config
    assert not model.transformer._forward_pre_hooks and not model.transformer._forward_hooks
    with pytest.raises(ValueError, match="expect `transformer.encoder.layers\\[i\\].self_attention.core_attention`"):
        rope_ext.patch(model, "dynamic", factor=4)


def test_repatching_replaces_and_factor_stays_relative_to_seq_length(checkpoints):
    model = load(checkpoints["chatglm2"])
    x = ids(3 * WINDOW)
    rope_ext.patch(model, "yarn", factor=4)
    once = remote_logits(model, x)
    rope_ext.patch(model, "linear", factor=2)
    info = rope_ext.patch(model, "yarn", factor=4)
    assert torch.equal(remote_logits(model, x), once)
    assert (info.original_window, info.max_length) == (WINDOW, 4 * WINDOW)
    info = rope_ext.patch(model, "yarn", factor=4, original_window=16)
    assert (info.original_window, info.max_length) == (16, 64)


def test_save_and_rope_ext_from_pretrained_repatch(checkpoints, tmp_path):
    model = load(checkpoints["chatglm2"])
    rope_ext.patch(model, "yarn", factor=4, beta_fast=16.0)
    model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert rope_ext.describe(reloaded) == rope_ext.describe(model)
    x = ids(3 * WINDOW)
    assert torch.equal(remote_logits(reloaded, x), remote_logits(model, x))


class WrongBase(nn.Module):
    """A rotary module with ChatGLM's interface computing a base no ChatGLM uses."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(2))

    def forward(self, max_seq_len, offset=0):
        return reference_table(max_seq_len, 4, 2.0, "base", torch.float32, None)


class WrongShape(WrongBase):
    def forward(self, max_seq_len, offset=0):
        return torch.zeros(max_seq_len, 8, 2)


class WrongSignature(WrongBase):
    def forward(self, x, position_ids):
        return x, position_ids


class NoBuffer(nn.Module):
    def forward(self, max_seq_len, offset=0):
        return torch.zeros(max_seq_len, 4, 2)


@pytest.mark.parametrize(
    "module,match",
    [
        (
            WrongBase,
            r"matches no known ChatGLM rotary computation .*rope_ratio=50 multiplies the base, positions in float32: max deviation",
        ),
        (WrongShape, r"returned \(4100, 8, 2\); expected .*\(4100, 4, 2\)"),
        (WrongSignature, r"raised TypeError.*expected `transformer.rotary_pos_emb`"),
        (NoBuffer, r"found .*NoBuffer without an `inv_freq` buffer; expected"),
    ],
)
def test_unknown_rotary_interface_is_refused_and_nothing_changes(checkpoints, module, match):
    model = load(checkpoints["chatglm3"])
    model.transformer.rotary_pos_emb = bad = module()
    config = copy.deepcopy(model.config.to_dict())
    with pytest.raises(ValueError, match=match):
        rope_ext.patch(model, "yarn", factor=4)
    assert model.transformer.rotary_pos_emb is bad and model.config.to_dict() == config
    assert not model.transformer._forward_pre_hooks
    del model.transformer.rotary_pos_emb
    with pytest.raises(
        ValueError, match=r"found ChatGLMModel with children \['embedding', 'encoder', 'output_layer'\]; expected"
    ):
        rope_ext.patch(model, "yarn", factor=4)


def test_chatglm_6b_v1_is_refused_with_the_reason(checkpoints):
    # ChatGLM-6B's layout: per-layer `attention.rotary_emb`, 2-D positions, no transformer.rotary_pos_emb.
    model = load(checkpoints["chatglm3"])
    model.config.position_encoding_2d = True
    with pytest.raises(ValueError, match="ChatGLM-6B \\(v1\\) is not supported: it rotates each head with 2-D positions"):
        rope_ext.patch(model, "linear", factor=4)
    with pytest.raises(ValueError, match="2-D positions"):
        convert_chatglm(model, Path("/nonexistent/never-written"))
