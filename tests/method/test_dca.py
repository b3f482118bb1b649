"""dca: Dual Chunk Attention (rope_ext.method.dca), against its definition written out with full
[S, S] matrices, its parameters, and on the tiny trained model. What every attention-side method
meets (exactness inside the window, caching, saving, refusals) is in test_attention_methods.py."""

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import rope_ext
from rope_ext.attention import AttentionTransform
from rope_ext.method import dca

from census_configs import norms_moved
from helpers import (
    WINDOW,
    assert_refused_unchanged,
    assert_saves_reloads_and_unpatches,
    ppl_past_window,
    random_ids,
    random_model,
    set_chain,
)


class EngineDualChunk(AttentionTransform):
    """Dual Chunk Attention as the engines that serve Qwen2.5-1M compute a prefill, in fp64, for one
    unpadded sequence at positions start, start + 1, ... with no cache; written from their source,
    not from rope_ext: vLLM 0.10.2, vllm/attention/backends/dual_chunk_flash_attn.py
    (DualChunkFlashAttentionImpl._dual_chunk_flash_attn_prefill_func) and
    vllm/model_executor/layers/rotary_embedding/dual_chunk_rope.py (DualChunkRotaryEmbedding); SGLang
    0.5.2, sglang/srt/layers/attention/dual_chunk_flashattention_backend.py, the same code. Sparse
    attention is off (it needs a sparse_attention_config, which these configs do not state).

    chunk_len = chunk_size - local_size; keys at j % chunk_len (cos_sin_k_cache); a query attends
    the keys of its chunk [i // chunk_len * chunk_len, i] at i % chunk_len (cos_sin_q_cache), the
    chunk before at min(i % chunk_len + chunk_len, chunk_size) (cos_sin_qc_cache, clamped at
    chunk_size), every earlier key at cos_sin_qc_cache[chunk_len - 1] = min(2 chunk_len - 1,
    chunk_size); the three flash-attention outputs merged by their log-sum-exp (one softmax). With
    original_max_position_embeddings L > 0 (`window`), the metadata's scaling_factor
    (0.1 * log(n / L) + 1).clip(min=1), n the sequence's orig_seq_len (the prompt's length), multiplies
    the keys before they are cached (key.mul_) and the softmax scale (softmax_scale *
    scaling_factor): logits times its square. `causal` takes n per row as the length the row has
    seen, rope-ext's schedule that decoding reproduces; False is the engines' prefill."""

    def __init__(self, chunk: int, local: int, base: float, dim: int, start: int = 0, window: int = 0, causal: bool = True):
        self.chunk, self.local, self.base, self.dim, self.start = chunk, local, base, dim, start
        self.window, self.causal = window, causal
        self.inv_freq = base ** (-torch.arange(dim // 2, dtype=torch.float64) * 2 / dim)

    def rotate(self, x, positions):
        half = self.dim // 2
        angles = positions[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        a, b = x[..., :half], x[..., half : self.dim]
        return torch.cat((a * cos - b * sin, b * cos + a * sin, x[..., self.dim :]), dim=-1)

    def __call__(self, module, query, key, value, attention_mask, attend, scaling=None, **kwargs):
        chunk_len = self.chunk - self.local
        positions = torch.arange(self.start, self.start + query.shape[-2], dtype=torch.float64)
        in_chunk = torch.remainder(positions, chunk_len)
        chunk_of = torch.div(positions, chunk_len, rounding_mode="floor")
        p_succ = torch.clamp(in_chunk + chunk_len, max=self.chunk)
        p_inter = torch.full_like(in_chunk, min(2 * chunk_len - 1, self.chunk))
        rep = query.shape[1] // key.shape[1]
        q, k, v = query.double(), key.double().repeat_interleave(rep, dim=1), value.double().repeat_interleave(rep, dim=1)
        k_rot = self.rotate(k, in_chunk).transpose(-1, -2)
        back = chunk_of[:, None] - chunk_of[None, :]  # how many chunks the key lies before the query
        scores = torch.where(
            back == 0,
            self.rotate(q, in_chunk) @ k_rot,
            torch.where(back == 1, self.rotate(q, p_succ) @ k_rot, self.rotate(q, p_inter) @ k_rot),
        )
        if self.window > 0:
            n = positions + 1 if self.causal else torch.full_like(positions, positions[-1] + 1)
            factor = (0.1 * torch.log(n / self.window) + 1.0).clip(min=1)
            scores = scores * (factor * factor)[:, None]
        scores = (scores * scaling).masked_fill(positions[:, None] < positions[None, :], float("-inf"))
        return (scores.softmax(-1) @ v).to(query.dtype).transpose(1, 2), None


@torch.no_grad()
def engine_logits(model, ids, chunk: int, local: int, start: int = 0, window: int = 0, causal: bool = True) -> torch.Tensor:
    """fp64 logits of `model` with every layer's attention EngineDualChunk at positions start, ...;
    with the temperature over the trained window `window` where it is > 0."""
    exact = copy.deepcopy(model).double()
    rope_ext.patch(exact, "dca", factor=4, chunk_size=chunk, local_size=local)  # the hook, queries and keys unrotated
    geometry = exact.model.rotary_emb.geometry
    set_chain(exact, [EngineDualChunk(chunk, local, geometry.base, geometry.rotary_dim, start, window, causal)])
    positions = torch.arange(start, start + ids.shape[-1])[None]
    return exact(ids, position_ids=positions).logits


@pytest.mark.parametrize("params", [{}, {"chunk_size": 48, "local_size": 6}, {"local_size": 20}])
def test_matches_the_definition(monkeypatch, params):
    model = random_model("qwen2")
    rope_ext.patch(model, "dca", factor=4, **params)
    x = random_ids(4 * WINDOW)
    masks = []
    attend_with_lse = dca.attend_with_lse

    def recorded(query, key, value, *, mask=None, **kwargs):
        masks.append(mask)
        return attend_with_lse(query, key, value, mask=mask, **kwargs)

    monkeypatch.setattr(dca, "attend_with_lse", recorded)
    with torch.no_grad():
        ours = model(x).logits.double()
    params = model.model.rotary_emb.params
    naive = engine_logits(model, x, params["chunk_size"], params["local_size"])
    assert (ours - naive).abs().max() < 1e-5
    # the rows past chunk_size (the first of them mid-chunk) attend without a mask
    assert masks and all(mask is None for mask in masks)


# (chunk_size, local_size) on the tiny model (window 128): ChunkLlama's 3/4 of the window, the
# default, and local_size above chunk_size / 2, where queries below chunk_size see keys two
# chunks back
SETTINGS = [(96, 24), (128, 8), (128, 80), (64, 48)]


@pytest.mark.parametrize("chunk, local", SETTINGS)
def test_matches_the_engines_on_the_tiny_model(tiny_model, heldout_ids, chunk, local):
    """The patched fp32 logits against EngineDualChunk in fp64 are as close as plain attention's
    fp32 logits to fp64 (with local_size > chunk_size / 2 rows 2s .. c - 1 were 0.88 off)."""
    ids = heldout_ids[None, :512]
    with torch.no_grad():
        plain_error = (tiny_model(ids).logits.double() - copy.deepcopy(tiny_model).double()(ids).logits).abs().max()
        rope_ext.patch(tiny_model, "dca", factor=4, chunk_size=chunk, local_size=local)
        error = (tiny_model(ids).logits.double() - engine_logits(tiny_model, ids, chunk, local)).abs().max()
    assert error <= 4 * plain_error, (error, plain_error)


# A forward whose positions start past 0 (a continuation without the cache of the tokens before)
# once killed the process with SIGFPE: it runs in a child process so that a crash fails the test.
OFFSET_CHILD = """
import sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]  # this test's folder, and tests/ for helpers
import rope_ext
from helpers import load_llama
from rope_ext.training import tiny
from transformers import AutoTokenizer
from test_dca import engine_logits

path, chunk, local, start = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = load_llama(path)
ids = tiny.heldout_ids(AutoTokenizer.from_pretrained(path))[None, :200]
rope_ext.patch(model, "dca", factor=4, chunk_size=chunk, local_size=local)
with torch.no_grad():
    ours = model(ids, position_ids=torch.arange(start, start + 200)[None]).logits.double()
print((ours - engine_logits(model, ids, chunk, local, start)).abs().max().item())
"""


@pytest.mark.parametrize("chunk, local, start", [(128, 8, 37), (128, 8, 300), (64, 48, 100)])
def test_positions_that_do_not_start_at_0_follow_the_engines(tiny_path, chunk, local, start):
    tests = Path(__file__).parent
    child = subprocess.run(
        [sys.executable, "-c", OFFSET_CHILD, str(tests), str(tiny_path), str(chunk), str(local), str(start)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert float(child.stdout.split()[-1]) < 1e-4


def test_fp32_rounding_past_the_window_is_that_of_plain_attention(tiny_model, heldout_ids):
    """The three parts merged by log-sum-exp add no error beyond fp32 rounding: against the same
    model in fp64, the patched fp32 logits are about as close as plain attention's."""
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, : 4 * window]
    exact = copy.deepcopy(tiny_model).double()
    with torch.no_grad():
        plain_error = (tiny_model(ids).logits.double() - exact(ids).logits).abs().max()
        rope_ext.patch(tiny_model, "dca", factor=4)
        rope_ext.patch(exact, "dca", factor=4)
        error = (tiny_model(ids).logits.double() - exact(ids).logits)[:, window:].abs().max()
    assert error <= 2 * plain_error, (error, plain_error)


def test_reads_past_the_window_better_than_plain_rope(tiny_path, heldout_ids):
    passages = torch.stack([heldout_ids[s : s + 513] for s in range(0, 16 * 513, 513)])
    assert ppl_past_window(tiny_path, passages, "dca") < 0.9 * ppl_past_window(tiny_path, passages, "plain")


def test_qwen_dual_chunk_attention_config_sets_chunk_local_and_window():
    model = random_model("qwen2", max_position_embeddings=4 * WINDOW)
    model.config.dual_chunk_attention_config = {"chunk_size": 48, "local_size": 4, "original_max_position_embeddings": WINDOW}
    info = rope_ext.patch(model, "dca", factor=4)
    assert (info.params["chunk_size"], info.params["local_size"], info.original_window) == (48, 4, WINDOW)
    assert info.max_length == 4 * WINDOW
    explicit = rope_ext.patch(model, "dca", factor=4, chunk_size=32, local_size=8)
    assert (explicit.params["chunk_size"], explicit.params["local_size"]) == (32, 8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunk_size": 2 * WINDOW}, "exceeds the trained window"),
        ({"local_size": WINDOW}, "local_size must be between"),
        ({"chunk_size": 1.5}, "must be an int"),
        ({"chunk_size": 1}, re.escape("dca: chunk_size (or None for the default) must be an int in [2,")),
        ({"granularity": 4}, "unknown parameter"),  # a record's old schedule: tests/method/test_attention_side.py
        ({"temperature": 1}, "temperature must be True, False or None"),
    ],
)
def test_bad_parameters_change_nothing(kwargs, message):
    assert_refused_unchanged("dca", {"factor": 4, **kwargs}, message)


def qwen_with(stated):
    """A random Qwen2 (window 4 x WINDOW, or WINDOW where `stated` says so) whose config carries `stated` as its dual_chunk_attention_config."""
    model = random_model("qwen2", max_position_embeddings=4 * WINDOW)
    model.config.dual_chunk_attention_config = stated
    return model


KEY = "config.json: dual_chunk_attention_config"


@pytest.mark.parametrize(
    "method, stated, message",
    [
        ("dca", {"chunk_size": 40.7}, f"{KEY}.chunk_size must be an int in [2,"),
        ("dca", {"chunk_size": "48"}, f"{KEY}.chunk_size must be an int in [2,"),
        ("dca", {"local_size": True}, f"{KEY}.local_size must be an int in [1,"),
        ("dca", {"original_max_position_embeddings": 0}, f"{KEY}.original_max_position_embeddings must be an int in [2,"),
        ("yarn", {"original_max_position_embeddings": 0}, f"{KEY}.original_max_position_embeddings must be an int"),
        ("yarn", {"original_max_position_embeddings": "64"}, f"{KEY}.original_max_position_embeddings must be an int"),
        ("dca", [48, 4], f"{KEY} must be a mapping"),
        ("yarn", "chunked", f"{KEY} must be a mapping"),
        ("dca", {"chunk_size": 48, "local_size": 48}, f"{KEY}.local_size (48) must be below {KEY[13:]}.chunk_size (48)"),
        ("dca", {"chunk_size": 96, "original_max_position_embeddings": WINDOW}, f"{KEY}.chunk_size (96) exceeds"),
        ("dca", {"chunk_size": 5 * WINDOW}, f"dca: chunk_size ({KEY}.chunk_size) 320 exceeds the trained window {4 * WINDOW}"),
        ("dca", {"local_size": 5 * WINDOW}, f"dca: local_size ({KEY}.local_size) must be between 1 and chunk_size - 1"),
    ],
)
def test_a_bad_dual_chunk_attention_config_is_refused_naming_config_json_and_the_key(method, stated, message):
    assert_refused_unchanged(method, {"factor": 4}, re.escape(message), model=qwen_with(stated))


@pytest.mark.parametrize(
    "stated",
    [
        {"chunk_size": 48, "local_size": 4, "original_max_position_embeddings": WINDOW, "sparse_attention_enabled": True},
        {"chunk_size": 40, "local_size": None},
    ],
)
def test_an_accepted_dual_chunk_attention_config_saves_and_reloads(tmp_path, stated):
    """A checkpoint whose config.json carries the setting (what Qwen2.5-1M ships) patches, saves
    and reloads exactly."""
    model = qwen_with(stated)
    for layer in model.model.layers:  # norm weights away from 1, so that a lost scale shows
        torch.nn.init.uniform_(layer.input_layernorm.weight, 0.5, 1.5)
    model.save_pretrained(tmp_path / "checkpoint")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32).eval()
    assert_saves_reloads_and_unpatches(model, "dca", {"factor": 4}, random_ids(3 * WINDOW), tmp_path / "patched")


# Qwen/Qwen2.5-7B-Instruct-1M's config.json: rope_scaling null, rope_theta 1e7,
# max_position_embeddings 1010000, dual_chunk_attention_config {chunk_size 262144, local_size 8192,
# original_max_position_embeddings 262144}; every length divided by 2048.
QWEN_1M = {"chunk_size": 128, "local_size": 4, "original_max_position_embeddings": 128}
QWEN_1M_LENGTH = 1010000 // 2048


def qwen_1m():
    model = random_model(
        "qwen2", max_position_embeddings=QWEN_1M_LENGTH, rope_parameters={"rope_type": "default", "rope_theta": 1e7}
    )
    model.config.dual_chunk_attention_config = dict(QWEN_1M)
    return norms_moved(model)


@pytest.mark.parametrize("causal", [False, True])
def test_computes_the_engines_dca_with_their_temperature_on_a_qwen_1m_shaped_config(causal):
    """480 tokens, 3.9 chunks of 124: the local size and the temperature come from the config, and
    the fp32 logits are as close to EngineDualChunk in fp64 as plain attention's fp32 logits to
    fp64; the same reference without the temperature is far from them."""
    model, ids = qwen_1m(), random_ids(480)
    with torch.no_grad():
        plain_error = (model(ids).logits.double() - copy.deepcopy(model).double()(ids).logits).abs().max()
        info = rope_ext.patch(model, "dca", factor=4, causal=causal)
        ours = model(ids).logits.double()
    assert (info.params["chunk_size"], info.params["local_size"], info.params["temperature"]) == (128, 4, True)
    reference = engine_logits(model, ids, 128, 4, window=128, causal=causal)
    error = (ours - reference).abs().max()
    assert error <= 4 * plain_error, (error, plain_error)
    without = (ours - engine_logits(model, ids, 128, 4)).abs().max()
    assert without > 100 * error, (without, error)


def test_decoding_with_the_temperature_equals_one_forward():
    """causal=True: each query's temperature is that of the length it has seen, so a prefill of
    200 tokens and 80 decode steps give every step the logits of one forward over the same tokens."""
    model, ids = qwen_1m(), random_ids(280)
    rope_ext.patch(model, "dca", factor=4)
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        model(ids[:, :200], cache=cache, use_cache=True)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(200, 280)], 1)
    assert (steps - full[:, 200:]).abs().max() < 1e-5


def test_the_temperature_follows_the_config_unless_given():
    model = qwen_1m()
    assert rope_ext.patch(model, "dca", factor=4).params["temperature"] is True
    assert rope_ext.patch(model, "dca", factor=4, temperature=False).params["temperature"] is False
    stated = {k: v for k, v in QWEN_1M.items() if k != "original_max_position_embeddings"}
    model.config.dual_chunk_attention_config = stated
    assert rope_ext.patch(model, "dca", factor=4).params["temperature"] is False
    plain = random_model("qwen2")
    assert rope_ext.patch(plain, "dca", factor=4).params["temperature"] is False


def test_yarn_dca_is_refused_with_what_to_use():
    assert_refused_unchanged("yarn_dca", {"factor": 4}, "yarn_dca .* was removed: .* use dca")


@pytest.mark.parametrize(
    "method, params, message",
    [
        ("yarn_dca", {"chunk_size": 64, "local_size": 4}, "rope_ext.method: yarn_dca .* was removed"),
        ("dca", {"chunk_size": 64, "local_size": 4}, "rope_ext.params: dca was recorded by a rope-ext that clamped"),
    ],
)
def test_a_record_written_before_is_refused_with_the_reason(tmp_path, method, params, message):
    """A checkpoint saved with yarn_dca, or with dca before it followed the engines (its params
    without `temperature`), is refused on reload instead of computing other logits."""
    model = random_model("qwen2")
    rope_ext.patch(model, "dca", factor=4)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_ext"].update(method=method, params=params)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        rope_ext.from_pretrained(tmp_path)
