"""Llama 4 (`llama4_text`): its rotary module returns complex `freqs_cis` (torch.polar of the
angles, times the attention factor), which its attention multiplies with queries and keys viewed
as complex pairs, in fp32. The probe proves the format (cos/sin format "complex"); the static
frequency methods then patch it exactly (alibi_hybrid, which adds a bias inside attention, is
taken too), and the methods that rotate inside attention are refused
(reason `rotation`): the complex product rounds otherwise than rope-ext's rotation, and a norm
follows the rotation (`use_qk_norm`).

Tiny random fp32 models, norm weights moved from 1: four layers, the fourth without RoPE (with
attention temperature tuning, floor scale 16), chunked attention of 48 tokens in the RoPE layers,
routed experts; a window of 64 tokens."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, Llama4TextConfig

import rope_ext
from helpers import required_params
from rope_ext.method import REGISTRY
from rope_ext.patches.probe import REASONS, probe
from census_configs import VOCAB, ids, logits, norms_moved
from test_census import decode_gap, twin_of

WINDOW = 64
DECODE_TOLERANCE = 1e-4
# the methods that only change the rotary module's output, with a transformers-native form
STATIC_METHODS = [name for name, m in REGISTRY.items() if not m.dynamic and not m.needs_attention_interface]
# a static rotation plus a bias inside attention, without a native form
BIASED_METHODS = [name for name, m in REGISTRY.items() if not m.dynamic and m.needs_attention_interface]
IN_ATTENTION_METHODS = [name for name, listed in rope_ext.methods().items() if listed["dynamic"]]
PAIRS = 8  # rotated pairs of the tiny model (head size 16)
# Llama-4-Scout's rope_parameters with the pretraining window shrunk from 8192 to 32 tokens
SCOUT_ROPE = {
    "rope_type": "llama3",
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 1.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}


def tiny(use_qk_norm: bool = True, rope_parameters: dict | None = None, max_position_embeddings: int = WINDOW):
    config = Llama4TextConfig(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=max_position_embeddings,
        num_local_experts=2,
        num_experts_per_tok=1,
        attention_chunk_size=48,
        floor_scale=16,
        use_qk_norm=use_qk_norm,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return norms_moved(model)


def twin(model, config):
    """The model transformers alone builds from `config` (its rope_ext record dropped), with `model`'s weights."""
    config = copy.deepcopy(config)
    if hasattr(config, "rope_ext"):
        del config.rope_ext
    return twin_of(model, config)


def test_the_probe_proves_the_complex_format_and_the_nope_layer():
    structure = probe(tiny())
    assert structure.cos_format == "complex"
    assert structure.layout == "interleaved"
    assert structure.rope == (True, True, True, False)  # no_rope_layers: every fourth layer
    assert (structure.head_dim, structure.rotary_dim) == (16, 16)
    assert structure.static_only is not None


def test_every_method_is_tested_here():
    assert sorted(STATIC_METHODS + BIASED_METHODS + IN_ATTENTION_METHODS) == sorted(rope_ext.methods())


def assert_exact(model, method: str, tmp_path, inside: int, past: int, native: bool = True) -> None:
    """`method` x4 on `model`: fp32 logits bit-equal to transformers' twin built from the written
    config inside and past the window (where the method has a native form), decoding equal to the
    full forward, the saved checkpoint reloaded by rope_ext.from_pretrained and unpatch bit-exact."""
    short, long = ids(inside), ids(past, seed=1)
    reference = logits(model, long)
    shipped = copy.deepcopy(model.config.rope_parameters)
    info = rope_ext.patch(model, method, factor=4, **required_params(method, PAIRS))
    if method in STATIC_METHODS and native:
        native = twin(model, model.config)
        for x in (short, long):
            assert torch.equal(logits(model, x), logits(native, x))
    else:
        assert info.native is None
    assert decode_gap(model, long[:, : inside + 12], inside - 4) <= DECODE_TOLERANCE
    with warnings.catch_warnings():  # alibi_hybrid's: no native form
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path)
    reloaded = rope_ext.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(logits(reloaded, long), logits(model, long))
    rope_ext.unpatch(model)
    assert model.config.rope_parameters == shipped
    assert torch.equal(logits(model, long), reference)


@pytest.mark.parametrize("use_qk_norm", [True, False])
@pytest.mark.parametrize("method", STATIC_METHODS + BIASED_METHODS)
def test_static_rotation_methods_patch_llama4_exactly(method, use_qk_norm, tmp_path):
    assert_exact(tiny(use_qk_norm), method, tmp_path, WINDOW, WINDOW + 40)


@pytest.mark.parametrize("method", STATIC_METHODS)
def test_static_methods_patch_a_scout_shaped_checkpoint_exactly(method, tmp_path):
    """A checkpoint that ships Llama-4-Scout's llama3 scaling (factor 16, low and high frequency
    factors 1, over a 32-token pretraining window here): extended from that scaling at the 512
    tokens it serves, each static method written as one longrope type, except `proportional`,
    whose pairs that stop turning no longrope factor expresses (rope_ext.from_pretrained reloads it)."""
    model = tiny(rope_parameters=dict(SCOUT_ROPE), max_position_embeddings=512)
    assert_exact(model, method, tmp_path, 32, 600, native=method != "proportional")


@pytest.mark.parametrize("use_qk_norm", [True, False])
@pytest.mark.parametrize("method", IN_ATTENTION_METHODS)
def test_methods_rotating_inside_attention_are_refused(method, use_qk_norm):
    model = tiny(use_qk_norm)
    plain = copy.deepcopy(model)
    with pytest.raises(ValueError, match=f"{method} rotates queries and keys inside attention") as refused:
        rope_ext.patch(model, method, factor=4, **required_params(method, PAIRS))
    message = str(refused.value)
    assert REASONS["rotation"] in message and "complex freqs_cis" in message
    assert "rope-ext's rotation does not give bit for bit" in message
    assert rope_ext.describe(model) is None
    assert model.config.to_dict() == plain.config.to_dict()
    x = ids(WINDOW + 8)
    assert torch.equal(logits(model, x), logits(plain, x))


def test_a_bf16_checkpoint_is_patched_as_transformers_reloads_it(tmp_path):
    """In bf16 (as Llama 4 ships) the rotary module still answers complex64 from fp32 angles: the
    yarn patch equals the saved checkpoint reloaded by transformers alone, bit for bit."""
    tiny().save_pretrained(tmp_path / "plain")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.bfloat16).eval()
    rope_ext.patch(model, "yarn", factor=4)
    model.save_pretrained(tmp_path / "yarn")
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "yarn", dtype=torch.bfloat16).eval()
    x = ids(WINDOW + 40)
    assert torch.equal(logits(model, x), logits(native, x))
