"""docs/serving.md: what a saved checkpoint's config.json means to the engines that serve it.

The serving engines' reading rules are restated below as small pure functions, one per engine
version read, from the released wheels' source: vLLM 0.34.0 (the same in 0.30.0 and 0.33.0 for these
rules), vLLM 0.29.0 (the same in 0.27.0 and 0.28.0) and SGLang 0.5.23. For every method the table
lists, a patch is saved as config.json and each engine's frequencies, attention factor, accepted
length and table size are compared with rope-ext's own: the table's cell is "yes" exactly when
they agree in the first and last row of a forward of the trained window, of one past it and of
the length the patch is meant for. No engine version read refuses a rope type rope-ext writes.
No written config lets an engine accept more positions than the patch is meant for.
Transformers' chunked prefill gives the tokens rope_ext.chunked_generate gives."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import linear_glm, random_model, required_params

import rope_ext
from rope_ext.geometry import RotaryGeometry
from rope_ext.method import REGISTRY
from rope_ext.patching import installed_patch

DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


@dataclass(frozen=True)
class Served:
    """What an engine builds from config.json: the inverse frequency of each rotated pair (an
    engine that divides the positions by a factor shows here as frequencies divided by it), the
    factor on cos and sin, the longest sequence it accepts unless told otherwise, and how many
    positions its cos/sin table holds. An engine that picks a set of frequencies per forward from
    the positions it holds (SGLang's longrope) states the other set in `short`: its frequencies,
    its attention factor, and the longest forward (from position 0) that uses them."""

    inv_freq: torch.Tensor
    attention: float
    max_length: int
    positions: int
    short: tuple[torch.Tensor, float, int] | None = None

    def at(self, length: int) -> tuple[torch.Tensor, float]:
        """The frequencies and attention factor of a forward over positions 0 to length - 1."""
        if self.short is not None and length <= self.short[2]:
            return self.short[0], self.short[1]
        return self.inv_freq, self.attention


def pair_frequencies(base: float, dim: int) -> torch.Tensor:
    """1 / base^(2i/dim) in fp32, as all three engines compute it (vLLM base.py and SGLang
    base.py, `RotaryEmbedding._compute_inv_freq`)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def yarn_frequencies(rope: dict, base: float, dim: int, extrapolation: float = 1.0) -> torch.Tensor:
    """The YaRN blend the three engines share (vLLM yarn_scaling_rope.py `_compute_inv_freq` with
    common.py's `yarn_find_correction_range` and `yarn_linear_ramp_mask`; SGLang yarn.py): pairs
    that turn more than beta_fast times in original_max_position_embeddings keep their frequency,
    fewer than beta_slow times are divided by the factor, a linear ramp between."""
    window, factor = rope["original_max_position_embeddings"], rope["factor"]

    def pair_index(turns: float) -> float:
        return dim * math.log(window / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(rope.get("beta_fast", 32)), pair_index(rope.get("beta_slow", 1))
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    keep = (1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)) * extrapolation
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature 0.1 * mscale * ln(s) + 1 (vLLM common.py, SGLang yarn.py)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def shared_types(kind: str, rope: dict, base: float, dim: int, window: int) -> tuple[torch.Tensor, int]:
    """(frequencies, table positions) of the rope types the three engines read alike, given
    max_position = max_position_embeddings (the models' get_rope call): `default`; `linear`
    (positions divided by the factor, a table of max_position * factor); `llama3` (vLLM
    llama3_rope.py, SGLang rope_variant.py `Llama3RotaryEmbedding._compute_inv_freq`)."""
    inv = pair_frequencies(base, dim)
    if kind == "default":
        return inv, window
    if kind == "linear":
        return inv / rope["factor"], math.ceil(window * rope["factor"])
    assert kind == "llama3", kind
    factor, low, high, trained = (
        rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    wavelen = 2 * math.pi / inv
    smooth = (trained / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen < trained / high, inv, torch.where(wavelen > trained / low, inv / factor, blended)), window


def head_size(config: dict) -> int:
    """head_dim, or hidden_size / heads where the config states none (vLLM get_rope's callers,
    SGLang models/llama.py)."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def read(config: dict) -> tuple[dict, str, float, int, int]:
    """(rope_parameters, rope_type, base, rotary dim, max_position_embeddings) as every engine
    reads them (vLLM get_rope, SGLang models/llama.py): the head size times
    partial_rotary_factor."""
    rope = config["rope_parameters"]
    dim = int(head_size(config) * rope.get("partial_rotary_factor", 1.0))
    return rope, rope.get("rope_type", "default"), rope.get("rope_theta", 10000), dim, config["max_position_embeddings"]


def longrope_set(factors: list[float], base: float, dim: int) -> torch.Tensor:
    """1 / (lambda_i base^(2i/dim)) in fp32: vLLM phi3_long_rope_scaled_rope.py and SGLang
    rope_variant.py, `Phi3LongRoPEScaledRotaryEmbedding._compute_inv_freq`."""
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def longrope_mscales(rope: dict, trained: int, max_position: int) -> tuple[float, float]:
    """(short, long) factor on cos and sin, `Phi3LongRoPEScaledRotaryEmbedding.__init__` in both
    engines: `short_mscale` and `long_mscale` where given, else sqrt(1 + ln(max_position / L) /
    ln L), 1 when max_position <= L, with max_position the config's max_position_embeddings:
    neither `factor` nor `attention_factor` is read."""
    scale = max_position / trained
    default = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(trained))
    return tuple(default if rope.get(key) is None else rope[key] for key in ("short_mscale", "long_mscale"))


def proportional_frequencies(base: float, head: int, dim: int) -> torch.Tensor:
    """vLLM gemma4_rope.py and SGLang rope_variant.py, `Gemma4RotaryEmbedding._compute_inv_freq`:
    dim // 2 pairs turn at 1 / base^(2i/head), the other pairs of the head at 0. No `factor`."""
    turning = 1.0 / (base ** (torch.arange(0, 2 * (dim // 2), 2, dtype=torch.float) / head))
    return torch.cat((turning, torch.zeros(head // 2 - dim // 2)))


def vllm_longrope(config: dict) -> Served:
    """vLLM's longrope, the same in 0.27.0, 0.29.0, 0.30.0 and 0.34.0. config/model.py
    `_get_and_verify_max_len` does not multiply max_position_embeddings by `factor`, and without
    --max-model-len sets max_model_len to a top-level original_max_position_embeddings where the
    config has one (Phi-3's), else to max_position_embeddings. `get_rope` builds
    `Phi3LongRoPEScaledRotaryEmbedding` (phi3_long_rope_scaled_rope.py), whose `__init__` picks one
    set at start-up: the long factors for every position, in a table of max_position_embeddings
    positions, when max_model_len > L (rope_parameters' original_max_position_embeddings), else
    the short ones, in a table of L."""
    rope, _, base, dim, window = read(config)
    trained = rope["original_max_position_embeddings"]
    accepted = int(config.get("original_max_position_embeddings", window))
    short_mscale, long_mscale = longrope_mscales(rope, trained, window)
    if accepted > trained:
        return Served(longrope_set(rope["long_factor"], base, dim), long_mscale, accepted, window)
    return Served(longrope_set(rope["short_factor"], base, dim), short_mscale, accepted, trained)


def vllm_0_34(config: dict) -> Served:
    """vLLM 0.34.0 (the same in 0.30.0 and 0.33.0): `get_rope` (model_executor/layers/rotary_embedding/
    __init__.py) and its classes, and config/model.py `_get_and_verify_max_len`. The accepted
    length is max_position_embeddings, times `factor` for every rope type but llama3, yarn and
    longrope. yarn takes transformers' `attention_factor`, else the mscale ratio, else 0.1 ln s + 1.
    dynamic (dynamic_ntk_scaling_rope.py) scales the base by (s * max_position /
    max_trained_positions - (s - 1)), max_trained_positions defaulting to max_position: the base
    unchanged, in a table of max_position positions. proportional (`Gemma4RotaryEmbedding`)
    rotates int(head * partial_rotary_factor) // 2 pairs with exponents over the whole head and
    ignores `factor`, in a table of max_position positions, while the accepted length is times
    `factor`. longrope: `vllm_longrope`."""
    rope, kind, base, dim, window = read(config)
    if kind == "longrope":
        return vllm_longrope(config)
    length = window if kind in ("llama3", "yarn") else window * rope.get("factor", 1.0)
    if kind == "yarn":
        factor, attention = rope["factor"], rope.get("attention_factor")
        if attention is None:
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                if mscale and mscale_all_dim
                else yarn_mscale(factor)
            )
        positions = math.ceil(rope["original_max_position_embeddings"] * factor)
        return Served(yarn_frequencies(rope, base, dim), attention, int(length), positions)
    if kind == "dynamic":
        factor, trained = rope["factor"], rope.get("max_trained_positions", window)
        scaled = base * (factor * window / trained - (factor - 1)) ** (dim / (dim - 2))
        return Served(pair_frequencies(scaled, dim), 1.0, int(length), window)
    if kind == "proportional":
        return Served(proportional_frequencies(base, head_size(config), dim), 1.0, int(length), window)
    inv, positions = shared_types(kind, rope, base, dim, window)
    return Served(inv, 1.0, int(length), positions)


def vllm_0_29(config: dict) -> Served:
    """vLLM 0.29.0 (the same in 0.27.0 and 0.28.0): as 0.34.0 but for yarn, which reads `attn_factor`,
    `extrapolation_factor` and `apply_yarn_scaling` (not transformers' `attention_factor`: the
    temperature is (0.1 ln s + 1) * attn_factor), and whose accepted length is
    original_max_position_embeddings * factor."""
    rope, kind, base, dim, _ = read(config)
    if kind != "yarn":
        return vllm_0_34(config)
    factor, attn_factor = rope["factor"], rope.get("attn_factor", 1)
    attention = yarn_mscale(factor) * attn_factor if rope.get("apply_yarn_scaling", True) else attn_factor
    length = rope["original_max_position_embeddings"] * factor
    inv = yarn_frequencies(rope, base, dim, rope.get("extrapolation_factor", 1))
    return Served(inv, float(attention), int(length), math.ceil(length))


def sglang_0_5(config: dict) -> Served:
    """SGLang 0.5.23: `get_rope` (srt/layers/rotary_embedding/factory.py) with its classes
    (yarn.py, rope_variant.py, base.py), and utils/hf_transformers/common.py `get_context_length`:
    max_position_embeddings times `factor`, unless the rope parameters state
    original_max_position_embeddings or the type is llama3. yarn reads `attn_factor`,
    `extrapolation_factor`, `mscale` and `mscale_all_dim` (not `attention_factor`): the
    temperature is (the mscale ratio where both are given, else 0.1 ln s + 1) * attn_factor.
    dynamic builds one table of max_position * s positions with the base of length
    max_position * s: base * (s^2 - s + 1)^(d/(d-2)) for every position.
    longrope (`Phi3LongRoPEScaledRotaryEmbedding`, rope_variant.py; models/llama.py puts a
    top-level original_max_position_embeddings over the rope parameters' L) picks a set per
    forward: the long factors for all of its positions when any position is > L (a forward of
    L + 2 tokens from position 0), else the short ones; tables of max_position (long) and L
    (short) positions. proportional (`Gemma4RotaryEmbedding`) rotates rotary_dim // 2 pairs with
    exponents over the whole head and ignores `factor`; models/llama.py takes rotary_dim from
    a top-level partial_rotary_factor (1 without one), not from the rope parameters."""
    rope, kind, base, dim, window = read(config)
    scale = 1 if "original_max_position_embeddings" in rope or kind == "llama3" else rope.get("factor", 1)
    length = int(scale * window)
    if kind == "yarn":
        factor, mscale, mscale_all_dim = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
        ratio = (
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            if None not in (mscale, mscale_all_dim)
            else yarn_mscale(factor)
        )
        positions = math.ceil(rope["original_max_position_embeddings"] * factor)
        inv = yarn_frequencies(rope, base, dim, rope.get("extrapolation_factor", 1))
        return Served(inv, ratio * rope.get("attn_factor", 1), length, positions)
    if kind == "dynamic":
        factor = rope["factor"]
        table = window * factor
        scaled = base * (factor * table / window - (factor - 1)) ** (dim / (dim - 2))
        return Served(pair_frequencies(scaled, dim), 1.0, length, math.ceil(table))
    if kind == "longrope":
        trained = config.get("original_max_position_embeddings", rope["original_max_position_embeddings"])
        short_mscale, long_mscale = longrope_mscales(rope, trained, window)
        short = (longrope_set(rope["short_factor"], base, dim), short_mscale, trained + 1)
        return Served(longrope_set(rope["long_factor"], base, dim), long_mscale, length, window, short)
    if kind == "proportional":
        head = head_size(config)
        rotated = int(config.get("partial_rotary_factor", 1) * head)
        return Served(proportional_frequencies(base, head, rotated), 1.0, length, window)
    inv, positions = shared_types(kind, rope, base, dim, window)
    return Served(inv, 1.0, length, positions)


ENGINES = {"vLLM 0.30-0.34": vllm_0_34, "vLLM 0.27-0.29": vllm_0_29, "SGLang 0.5.23": sglang_0_5}
COLUMNS = ("transformers 5", *ENGINES)
ROW = re.compile(r"^\| `(\w+)`((?: `\w+=[^`]+`)*) \| (`\w+`|-) \|" + r" ([a-z ]+) \|" * len(COLUMNS) + "$", re.MULTILINE)


def table() -> list[tuple[str, dict, str, dict]]:
    """(method, parameters, rope_type written, {column: cell}) for each row of the doc's table."""
    header = re.search(r"^\| method \| `rope_type` written \| (.+) \|$", DOC.read_text(), flags=re.MULTILINE)
    assert header and tuple(header.group(1).split(" | ")) == COLUMNS
    rows = []
    for name, params, rope_type, *cells in ROW.findall(DOC.read_text()):
        values = {k: {"True": True, "False": False}.get(v, v) for k, v in re.findall(r"`(\w+)=([^`]+)`", params)}
        values = {k: v if isinstance(v, bool) else float(v) for k, v in values.items()}
        rows.append((name, values, rope_type.strip("`"), dict(zip(COLUMNS, cells))))
    return rows


def required(name: str, model) -> dict:
    """`name`'s required parameters for `model`, its rotated pairs read from its config."""
    pairs = read(json.loads(model.config.to_json_string()))[3] // 2
    return required_params(name, pairs)


def native(name: str, **params) -> dict | None:
    params = {**required_params(name, 32), **params}
    method = REGISTRY[name].bind(params)
    geometry = RotaryGeometry(rotary_dim=64, base=10000.0, original_window=8192)
    return method.native(geometry, 4.0, method.validate(4.0, params), {})


def test_the_table_follows_the_registry():
    rows = table()
    assert [name for name, params, *_ in rows if not params] == list(rope_ext.methods())
    for name, params, rope_type, _ in rows:
        form = native(name, **params)
        assert rope_type == ("-" if form is None else form["rope_type"]), name
    assert native("dynamic", causal=False)["rope_type"] == "dynamic"  # a row of its own in the table


def served_model():
    """A LLaMA with a 4096-token window and 128-dim heads, so that the YaRN and Llama 3 bands fall
    inside the rotated pairs."""
    return random_model(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )


def patched_at(model, row: int, length: int) -> tuple[torch.Tensor, float]:
    """The patch's frequencies and attention factor for the row at position `row` of a forward over
    positions 0 to length - 1: under a causal schedule each row has the length it has seen."""
    rotary = model.model.rotary_emb
    if not rotary.method.follows_length:
        return rotary.frequencies(length)
    return rotary.frequencies(int(rotary.rotation.scaled_lengths(torch.arange(length))[row]))


def serves_as_patched(served: Served, model) -> bool:
    """The engine's frequencies and attention factor are the patch's in the first and the last
    row of a forward of the trained window, of one past it and of the length the patch is meant
    for, and it accepts that length with a table that holds it."""
    applied = installed_patch(model)
    for length in (applied.original_window, applied.original_window + 1, applied.max_length):
        for row in (0, length - 1):
            inv_freq, attention = patched_at(model, row, length)
            served_freq, served_attention = served.at(length)
            if served_freq.shape != inv_freq.shape or not torch.allclose(served_freq, inv_freq, rtol=1e-6, atol=0):
                return False
            if not math.isclose(served_attention, attention, rel_tol=1e-9):
                return False
    return served.max_length == applied.max_length and served.positions >= served.max_length


@pytest.mark.parametrize("row", table(), ids=lambda row: row[0] + "".join(f"-{k}={v}" for k, v in row[1].items()))
def test_each_engine_serves_what_the_table_says(row):
    name, params, _, cells = row
    model = served_model()
    window, base = model.config.max_position_embeddings, model.config.rope_parameters["rope_theta"]
    info = rope_ext.patch(model, name, factor=4, **required(name, model), **params)
    config = json.loads(model.config.to_json_string())
    # transformers reads the written form exactly (tests/test_saving.py) but sets the frequencies
    # of `dynamic` and `longrope` once per forward, from its length (`dynamic_rope_update`,
    # modeling_rope_utils.py): a causal schedule, whose rows of one forward differ, is not its
    causal = model.model.rotary_emb.method.follows_length and info.params.get("causal", True)
    assert cells["transformers 5"] == ("unpatched" if info.native is None else "not as patched" if causal else "yes")
    for engine, reading in ENGINES.items():
        served = reading(config)
        if info.native is None:
            assert (served.max_length, served.attention) == (window, 1.0), engine
            assert torch.equal(served.inv_freq, pair_frequencies(base, info.rotary_dim)), engine
            assert cells[engine] == "unpatched", engine
        else:
            assert cells[engine] == ("yes" if serves_as_patched(served, model) else "not as patched"), engine


CHECKPOINTS = {
    "llama": served_model,
    "llama already yarn-scaled": lambda: random_model(
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e4},
    ),
    "mixtral without head_dim": lambda: random_model("mixtral", head_dim=None),
    "glm with a linear checkpoint scaling": linear_glm,
}


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("method,params", [(name, {}) for name in rope_ext.methods()] + [("dynamic", {"causal": False})])
def test_no_engine_accepts_more_positions_than_the_patch_is_meant_for(checkpoint, method, params):
    """A patch with a native form is served up to its max_length at most; one without leaves the
    checkpoint's own config, which engines serve as the unpatched checkpoint."""
    model = CHECKPOINTS[checkpoint]()
    before = json.loads(model.config.to_json_string())
    if method == "proportional" and checkpoint == "glm with a linear checkpoint scaling":
        # GLM rotates half of each head; the patch is refused and writes nothing
        with pytest.raises(ValueError, match="needs a fully rotated head"):
            rope_ext.patch(model, method, factor=3)
        assert json.loads(model.config.to_json_string()) == before
        return
    info = rope_ext.patch(model, method, factor=3, **required(method, model), **params)
    config = json.loads(model.config.to_json_string())
    if info.native is None:
        for key in ("rope_parameters", "max_position_embeddings", "head_dim"):
            assert config.get(key) == before.get(key), key
        return
    for engine, reading in ENGINES.items():
        served = reading(config)
        assert served.max_length <= info.max_length, (engine, config["rope_parameters"], config["max_position_embeddings"])


def test_a_saved_checkpoint_states_the_native_form(tiny_model, tmp_path):
    rope_ext.patch(tiny_model, "yarn", factor=2)
    tiny_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 256


@pytest.mark.parametrize("method", ["yarn", "ntk"])
def test_transformers_chunked_prefill_matches_chunked_generate(tiny_model, heldout_ids, method):
    rope_ext.patch(tiny_model, method, factor=2)
    prompt = heldout_ids[:200].unsqueeze(0)
    options = {"max_new_tokens": 8, "do_sample": False}
    ours = rope_ext.chunked_generate(tiny_model, prompt, 64, **options)
    theirs = tiny_model.generate(prompt, prefill_chunk_size=64, **options)
    assert torch.equal(ours, theirs)
    assert torch.equal(theirs, tiny_model.generate(prompt, **options))
