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
from transformers import AutoModelForCausalLM

import rope_ext
from rope_ext import cli
from rope_ext.attention import AttentionTransform
from rope_ext.method import dca
from rope_ext.method.rope import yarn

from helpers import (
    WINDOW,
    assert_refused_unchanged,
    assert_saves_reloads_and_unpatches,
    ppl_past_window,
    random_ids,
    random_model,
    set_chain,
)


class PaperDualChunk(AttentionTransform):
    """Dual Chunk Attention as An et al. 2024 define it (section 3, Fig. 2), in fp64, for one
    unpadded sequence at positions start, start + 1, ... with no cache; written from the paper, not
    from rope_ext (docs/dca.md says where HKUNLP/ChunkLlama's code differs). With c = chunk_size, w = local_size and s = c - w, the
    chunk of position p is floor(p / s) and every key sits at P_k = p mod s; a query meets a key
    of its own chunk at P_q^intra = its position mod s, a key of the chunk before at P_q^succ (the
    first w positions of a chunk at s, s + 1, ..., s + w - 1, the others at c - 1) and a key of
    any earlier chunk at P_q^inter = c - 1; one softmax over all. No query is exempt."""

    def __init__(self, chunk: int, local: int, base: float, dim: int, start: int = 0, inv_freq=None, temperature: float = 1.0):
        """`inv_freq` (default: base^(-2i/dim)) and `temperature` (YaRN's factor on cos and sin)
        are the frequencies the chunks rotate with."""
        self.chunk, self.local, self.base, self.dim, self.start = chunk, local, base, dim, start
        half = dim // 2
        default = base ** (-torch.arange(half, dtype=torch.float64) * 2 / dim)
        self.inv_freq = default if inv_freq is None else inv_freq.double()
        self.temperature = temperature

    def rotate(self, x, positions):
        half = self.dim // 2
        angles = positions[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos() * self.temperature, angles.sin() * self.temperature
        a, b = x[..., :half], x[..., half : self.dim]
        return torch.cat((a * cos - b * sin, b * cos + a * sin, x[..., self.dim :]), dim=-1)

    def __call__(self, module, query, key, value, attention_mask, attend, scaling=None, **kwargs):
        c, w = self.chunk, self.local
        s = c - w
        positions = torch.arange(self.start, self.start + query.shape[-2], dtype=torch.float64)
        in_chunk = positions - s * torch.floor(positions / s)
        chunk_of = torch.floor(positions / s)
        p_intra = in_chunk
        p_succ = torch.where(in_chunk < w, s + in_chunk, torch.full_like(in_chunk, c - 1))
        p_inter = torch.full_like(in_chunk, c - 1)
        rep = query.shape[1] // key.shape[1]
        q, k, v = query.double(), key.double().repeat_interleave(rep, dim=1), value.double().repeat_interleave(rep, dim=1)
        k_rot = self.rotate(k, in_chunk).transpose(-1, -2)
        back = chunk_of[:, None] - chunk_of[None, :]  # how many chunks the key lies before the query
        scores = torch.where(
            back == 0,
            self.rotate(q, p_intra) @ k_rot,
            torch.where(back == 1, self.rotate(q, p_succ) @ k_rot, self.rotate(q, p_inter) @ k_rot),
        )
        scores = (scores * scaling).masked_fill(positions[:, None] < positions[None, :], float("-inf"))
        return (scores.softmax(-1) @ v).to(query.dtype).transpose(1, 2), None


@torch.no_grad()
def paper_logits(model, ids, chunk: int, local: int, start: int = 0, yarn_factor: float | None = None) -> torch.Tensor:
    """fp64 logits of `model` with every layer's attention PaperDualChunk at positions start, ...;
    over YaRN's frequencies and temperature at `yarn_factor` where one is given."""
    exact = copy.deepcopy(model).double()
    rope_ext.patch(exact, "dca", factor=4, chunk_size=chunk, local_size=local)  # the hook, queries and keys unrotated
    geometry = exact.model.rotary_emb.geometry
    frequencies = {}
    if yarn_factor is not None:
        inv_freq, temperature = yarn(geometry, factor=yarn_factor)
        frequencies = {"inv_freq": inv_freq, "temperature": temperature}
    set_chain(exact, [PaperDualChunk(chunk, local, geometry.base, geometry.rotary_dim, start, **frequencies)])
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
    naive = paper_logits(model, x, params["chunk_size"], params["local_size"])
    assert (ours - naive).abs().max() < 1e-5
    # the rows past chunk_size (the first of them mid-chunk) attend without a mask
    assert masks and all(mask is None for mask in masks)


# (chunk_size, local_size) on the tiny model (window 128): ChunkLlama's 3/4 of the window, the
# default, and local_size above chunk_size / 2, where queries below chunk_size see keys two
# chunks back
PAPER_SETTINGS = [(96, 24), (128, 8), (128, 80), (64, 48)]


@pytest.mark.parametrize("chunk, local", PAPER_SETTINGS)
def test_matches_the_paper_on_the_tiny_model(tiny_model, heldout_ids, chunk, local):
    """The patched fp32 logits against PaperDualChunk in fp64 are as close as plain attention's
    fp32 logits to fp64 (with local_size > chunk_size / 2 rows 2s .. c - 1 were 0.88 off)."""
    ids = heldout_ids[None, :512]
    with torch.no_grad():
        plain_error = (tiny_model(ids).logits.double() - copy.deepcopy(tiny_model).double()(ids).logits).abs().max()
        rope_ext.patch(tiny_model, "dca", factor=4, chunk_size=chunk, local_size=local)
        error = (tiny_model(ids).logits.double() - paper_logits(tiny_model, ids, chunk, local)).abs().max()
    assert error <= 4 * plain_error, (error, plain_error)


# A forward whose positions start past 0 (a continuation without the cache of the tokens before)
# once killed the process with SIGFPE: it runs in a child process so that a crash fails the test.
OFFSET_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import rope_ext
from helpers import load_llama
from rope_ext.training import tiny
from transformers import AutoTokenizer
from test_dca import paper_logits

path, chunk, local, start = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = load_llama(path)
ids = tiny.heldout_ids(AutoTokenizer.from_pretrained(path))[None, :200]
rope_ext.patch(model, "dca", factor=4, chunk_size=chunk, local_size=local)
with torch.no_grad():
    ours = model(ids, position_ids=torch.arange(start, start + 200)[None]).logits.double()
print((ours - paper_logits(model, ids, chunk, local, start)).abs().max().item())
"""


@pytest.mark.parametrize("chunk, local, start", [(128, 8, 37), (128, 8, 300), (64, 48, 100)])
def test_positions_that_do_not_start_at_0_follow_the_paper(tiny_path, chunk, local, start):
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
        ({"causal": False}, "do not apply"),
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


# yarn_dca: Dual Chunk Attention over YaRN's frequencies and temperature (Qwen2.5-1M's setup).


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("factor", [4, 2.5])
def test_yarn_dca_inside_the_window_is_the_yarn_patch_bit_for_bit(tiny_model, heldout_ids, attn, factor):
    """With chunk_size = L every query inside the window meets every key at its true distance: the
    patch is rope-ext's yarn at the same factor (frequencies and temperature), bit for bit."""
    tiny_model.set_attn_implementation(attn)
    window = tiny_model.config.max_position_embeddings
    ids = heldout_ids[None, : 3 * window]
    lengths = (window, window - 37, 1)
    with torch.no_grad():
        rope_ext.patch(tiny_model, "yarn", factor=factor)
        expected = [tiny_model(ids[:, :n]).logits for n in lengths]
        expected_long = tiny_model(ids).logits
        info = rope_ext.patch(tiny_model, "yarn_dca", factor=factor, chunk_size=window)
        patched = [tiny_model(ids[:, :n]).logits for n in lengths]
        patched_long = tiny_model(ids).logits
    assert info.params["chunk_size"] == window
    for before, after in zip(expected, patched):
        assert torch.equal(before, after)
    assert torch.equal(expected_long[:, :window], patched_long[:, :window])
    assert (expected_long[:, window:] - patched_long[:, window:]).abs().max() > 1.0  # past the window DCA acts


@pytest.mark.parametrize("chunk, local", [(128, 8), (96, 24)])
def test_yarn_dca_matches_the_paper_over_yarn_frequencies_on_the_tiny_model(tiny_model, heldout_ids, chunk, local):
    """Past the window, the fp32 logits against PaperDualChunk in fp64 with YaRN's frequencies and
    temperature are as close as plain attention's fp32 logits to fp64."""
    ids = heldout_ids[None, :512]
    with torch.no_grad():
        plain_error = (tiny_model(ids).logits.double() - copy.deepcopy(tiny_model).double()(ids).logits).abs().max()
        rope_ext.patch(tiny_model, "yarn_dca", factor=4, chunk_size=chunk, local_size=local)
        ours = tiny_model(ids).logits.double()
    error = (ours - paper_logits(tiny_model, ids, chunk, local, yarn_factor=4)).abs().max()
    assert error <= 4 * plain_error, (error, plain_error)
    # the reference tells the frequencies apart: over the trained ones it is far off
    assert (ours - paper_logits(tiny_model, ids, chunk, local)).abs().max() > 100 * plain_error


def test_yarn_dca_takes_yarn_parameters(tiny_model, heldout_ids):
    ids = heldout_ids[None, :300]
    with torch.no_grad():
        rope_ext.patch(tiny_model, "yarn", factor=4, beta_fast=16, beta_slow=2, attention_factor=1.0)
        expected = tiny_model(ids[:, :128]).logits
        rope_ext.patch(tiny_model, "yarn_dca", factor=4, beta_fast=16, beta_slow=2, attention_factor=1.0)
        assert torch.equal(tiny_model(ids[:, :128]).logits, expected)
        ours = tiny_model(ids).logits.double()
    chunk, local = tiny_model.model.rotary_emb.params["chunk_size"], tiny_model.model.rotary_emb.params["local_size"]
    exact = copy.deepcopy(tiny_model).double()
    rope_ext.patch(exact, "dca", factor=4, chunk_size=chunk, local_size=local)
    geometry = exact.model.rotary_emb.geometry
    inv_freq, _ = yarn(geometry, factor=4, beta_fast=16, beta_slow=2)
    set_chain(exact, [PaperDualChunk(chunk, local, geometry.base, geometry.rotary_dim, inv_freq=inv_freq)])
    with torch.no_grad():
        assert (ours - exact(ids).logits).abs().max() < 1e-3


def yarn_dca_checkpoint(tiny_path, path, stated: dict | None = None) -> Path:
    """The tiny trained model saved with a Qwen2.5-1M-style config.json, shrunk to its sizes: yarn
    rope_parameters (factor 4 over its 128-token window) and a dual_chunk_attention_config."""
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    window = model.config.max_position_embeddings
    rope = model.config.rope_parameters
    model.config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": rope["rope_theta"],
        "factor": 4.0,
        "original_max_position_embeddings": window,
    }
    model.config.max_position_embeddings = 4 * window
    model.config.dual_chunk_attention_config = stated or {
        "chunk_size": window,
        "local_size": 8,
        "original_max_position_embeddings": window,
    }
    model.save_pretrained(path)
    return path


def test_a_qwen_1m_style_config_is_patched_with_its_factor_and_sizes(tiny_path, heldout_ids, tmp_path):
    """yarn_dca on a checkpoint whose config.json states yarn (factor 4) and dual chunk attention:
    the factor, chunk_size, local_size and window come from the config; inside the window it is
    the checkpoint's own YaRN (transformers') bit for bit; it saves, reloads and unpatches exactly."""
    path = yarn_dca_checkpoint(tiny_path, tmp_path / "qwen-1m-style")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = heldout_ids[None, :384]
    with torch.no_grad():
        native = model(ids[:, :128]).logits
        info = rope_ext.patch(model, "yarn_dca")
        assert (info.factor, info.params["chunk_size"], info.params["local_size"], info.original_window) == (4.0, 128, 8, 128)
        assert info.max_length == 512
        inside = model(ids[:, :128]).logits
        ours = model(ids).logits.double()
    assert torch.equal(inside, native)
    assert (ours - paper_logits(model, ids, 128, 8, yarn_factor=4)).abs().max() < 1e-3
    rope_ext.unpatch(model)
    assert_saves_reloads_and_unpatches(model, "yarn_dca", {}, ids, tmp_path / "patched")


@pytest.mark.parametrize(
    "rope, message",
    [
        (None, "yarn_dca needs a factor"),
        ({"rope_type": "llama3", "factor": 2.0}, "yarn_dca needs a factor"),
        ({"rope_type": "yarn", "factor": 0.5}, re.escape("yarn_dca: config.json: rope_parameters.factor: factor must be")),
    ],
)
def test_yarn_dca_without_a_factor_on_a_config_without_a_yarn_factor_is_refused(rope, message):
    model = random_model()
    if rope is not None:
        theta = model.config.rope_parameters["rope_theta"]
        model.config.rope_parameters = {**rope, "rope_theta": theta, "original_max_position_embeddings": WINDOW}
    assert_refused_unchanged("yarn_dca", {"chunk_size": WINDOW}, message, model=model)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beta_fast": 1, "beta_slow": 2}, "need beta_fast > beta_slow > 0"),
        ({"attention_factor": 0}, "attention_factor must be in"),
        ({"beta_fast": "32"}, "beta_fast must be a number"),
        ({"chunk_size": 2 * WINDOW}, "exceeds the trained window"),
        ({"rope": "ntk"}, r"unknown parameter\(s\) \['rope'\]"),
    ],
)
def test_yarn_dca_bad_parameters_change_nothing(kwargs, message):
    assert_refused_unchanged("yarn_dca", {"factor": 4, **kwargs}, message)


def test_yarn_dca_runs_from_the_command_line(tiny_path, tmp_path):
    """`rope-ext eval passkey --method yarn_dca --factor 4 --param chunk_size=...` patches with the
    given sizes and yarn's parameters, and records them."""
    out = tmp_path / "passkey"
    argv = ["eval", "passkey", "--model", str(tiny_path), "--method", "yarn_dca", "--factor", "4"]
    argv += ["--param", "chunk_size=128", "--param", "beta_fast=16", "--lengths", "400", "--depths", "0.5", "--trials", "1"]
    assert cli.main([*argv, "--max-new-tokens", "4", "--dtype", "float32", "--no-progress", "--output", str(out)]) == 0
    result = json.loads((out / "passkey.json").read_text())
    patch = result["setup"]["patch"]
    assert (patch["method"], patch["factor"], patch["max_length"]) == ("yarn_dca", 4.0, 512)
    assert {k: patch["params"][k] for k in ("chunk_size", "local_size", "beta_fast")} == {
        "chunk_size": 128,
        "local_size": 8,
        "beta_fast": 16,
    }
