"""What the serving engines compute from a config.json rope-ext writes (docs/serving.md): each
engine's reading rules restated as small pure functions, one per engine version read, from the
released wheels' source (file and version named on each), and the check of what they build against
the patch itself, per family.

The versions read: vLLM 0.34.0 (the same in 0.30.0 and 0.33.0 for these rules), vLLM 0.29.0 (the
same in 0.27.0 and 0.28.0) and SGLang 0.5.23. Each function takes config.json as a dict and returns
`Served`: the frequencies of each rotated pair, the factor on cos and sin, the longest sequence the
engine accepts unless told otherwise, and its cos/sin table size.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig

from .record import holder


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
    rewritten: str | None = None  # a model rule that serves another rope type than the one written

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
    partial_rotary_factor. Of parameters nested per layer type, the full-attention layers' entry,
    the one a patch writes: vLLM's gemma3.py calls get_rope with `rope_parameters[layer_type]` per
    layer, SGLang's gemma3_causal.py builds the global layers from transformers' own rope functions
    over that entry."""
    rope = config["rope_parameters"]
    rope = rope.get(GLOBAL_LAYERS, rope)
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


GLOBAL_LAYERS = "full_attention"
DEEPSEEK = ("deepseek_v2", "deepseek_v3")


def deepseek_yarn(config: dict, engine: str) -> Served | str:
    """What every engine read builds for a DeepSeek-V2/V3 rope type other than default: vLLM
    models/deepseek_v2.py (0.29.0 and 0.34.0) and SGLang models/deepseek_v2.py (0.5.23) rewrite it to
    `deepseek_yarn`, YaRN over `factor` and `original_max_position_embeddings` with cos/sin times
    mscale(s, mscale) / mscale(s, mscale_all_dim) (mscale 1 and mscale_all_dim 0 where absent),
    always truncated, reading no `attention_factor`. vLLM's get_rope then needs both keys (a config
    without them does not load: KeyError); SGLang takes `factor` 1 and the window
    max_position_embeddings in their place. The accepted length is the yarn rule's: vLLM 0.34 and
    SGLang max_position_embeddings, vLLM 0.29 original_max_position_embeddings * factor."""
    rope, kind, base, dim, window = read(config)
    missing = [key for key in ("factor", "original_max_position_embeddings") if key not in rope]
    if missing and engine.startswith("vLLM"):
        return f"it builds DeepSeek's {kind} as deepseek_yarn, which needs {' and '.join(missing)}: the checkpoint does not load"
    rope = {"factor": 1.0, "original_max_position_embeddings": window, **rope, "truncate": True}
    factor = rope["factor"]
    attention = yarn_mscale(factor, rope.get("mscale", 1)) / yarn_mscale(factor, rope.get("mscale_all_dim", 0))
    length = rope["original_max_position_embeddings"] * factor if engine == "vLLM 0.27-0.29" else window
    served = Served(yarn_frequencies(rope, base, dim), attention, int(length), math.ceil(length))
    return served if kind == "yarn" else dataclasses.replace(served, rewritten=f"it serves DeepSeek's {kind} as deepseek_yarn")


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
    # config/model.py skips the factor for a model_type containing "gemma3" ("already scaled")
    length = (
        window if kind in ("llama3", "yarn") or "gemma3" in config.get("model_type", "") else window * rope.get("factor", 1.0)
    )
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
    if kind != "yarn" or "gemma3" in config.get("model_type", ""):
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
    # the rule reads the top-level dict, which per layer type holds no factor
    top = config["rope_parameters"]
    scale = 1 if "original_max_position_embeddings" in top or top.get("rope_type") == "llama3" else top.get("factor", 1)
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


def serve(engine: str, config: dict) -> Served | str:
    """What `engine` builds from `config`, with the model-specific rules: DeepSeek-V2/V3's
    rewrite (`deepseek_yarn`); a str says why it serves no rotary module of the rope type."""
    rope = config["rope_parameters"]
    if config.get("model_type") in DEEPSEEK and rope.get("rope_type", "default") != "default":
        return deepseek_yarn(config, engine)
    return ENGINES[engine](config)


COLUMNS = ("transformers 5", *ENGINES)


def patched_at(rotary, row: int, length: int) -> tuple[torch.Tensor, float]:
    """The patch's frequencies and attention factor for the row at position `row` of a forward over
    positions 0 to length - 1: under a causal schedule each row has the length it has seen."""
    if not rotary.method.follows_length:
        return rotary.frequencies(length)
    return rotary.frequencies(int(rotary.rotation.scaled_lengths(torch.arange(length))[row]))


def serves_as_patched(served: Served, applied, rotary) -> bool:
    """The engine's frequencies and attention factor are those of the patch `applied` (installed as
    the rotary module `rotary`) in the first and the last row of a forward of the trained window, of
    one past it and of the length the patch is meant for, and it accepts that length (or more:
    `linear` and `proportional`, whose factor the engines multiply max_position_embeddings by) with
    a table that holds it."""
    for length in (applied.original_window, applied.original_window + 1, applied.max_length):
        for row in (0, length - 1):
            inv_freq, attention = patched_at(rotary, row, length)
            served_freq, served_attention = served.at(length)
            if served_freq.shape != inv_freq.shape or not torch.allclose(served_freq, inv_freq.cpu(), rtol=1e-6, atol=0):
                return False
            if not math.isclose(served_attention, attention, rel_tol=1e-9):
                return False
    return served.max_length >= applied.max_length and served.positions >= served.max_length


def verdicts(config: dict, applied, rotary, native: bool) -> dict[str, str]:
    """engine -> "as patched", "unpatched" (a config without a native form: the engine serves the
    checkpoint as it was), "not as patched: <why>" or "not checked: <why>", for the config.json
    `config` a patch wrote."""
    return {engine: verdict(engine, config, applied, rotary, native) for engine in ENGINES}


def verdict(engine: str, config: dict, applied, rotary, native: bool) -> str:
    """One engine's verdict of `verdicts`."""
    if not native:
        return "unpatched"
    missing = [key for key in ("rope_parameters", "max_position_embeddings") if key not in config]
    if missing:  # a model that states its length under another name (the engines read several)
        return f"not checked: config.json has no {' or '.join(missing)}, which these rules read"
    served = serve(engine, config)
    if isinstance(served, str):
        return f"not as patched: {served}"
    if serves_as_patched(served, applied, rotary):
        return "as patched"
    why = served.rewritten or "its frequencies, temperature or accepted length differ from the patch's"
    return f"not as patched: {why}"


def written(model) -> dict:
    """The config.json entries an engine reads for the patched model: the config that holds the
    patch (a composite model's text config)."""
    return json.loads(holder(model.config).to_json_string())


def table(found: dict[str, str]) -> str:
    """`verdicts` as lines of a readable table."""
    width = max(map(len, found))
    return "\n".join(f"  {engine:{width}}  {verdict}" for engine, verdict in found.items())


TRANSFORMERS = "transformers 5"


def transformers_verdict(rotary, native: bool) -> str:
    """What a plain transformers load of the written config serves: the native form where there is
    one, read exactly (tests/saving/test_saving.py), except that transformers sets the frequencies
    of `dynamic` and `longrope` once per forward from its length (`dynamic_rope_update`,
    modeling_rope_utils.py), where a causal schedule gives each row those of the length it has seen."""
    if not native:
        return "unpatched"
    if rotary.method.follows_length and rotary.params.get("causal", True):
        return (
            "not as patched: it sets one frequency set per forward, where the patch's causal schedule gives each row "
            "the set of the length it has seen (causal=False is transformers' schedule)"
        )
    return "as patched"


# --- The override forms: the same patch given to an engine on the unmodified checkpoint ---------


def vllm_overridden(config, overrides: dict):
    """`config` (a transformers config, as vLLM loads the checkpoint) with vLLM 0.34.0's
    `--hf-overrides` applied: vllm/config/model.py `ModelConfig.__post_init__` splits the JSON into
    flat values, which vllm/transformers_utils/config.py `get_config` applies with
    `config.update(...)`, and dict values, which `_apply_dict_overrides` applies after the config is
    loaded: into a nested config recursively (`_update_nested`: a dict inside it, such as its
    rope_parameters, is updated key by key), else set whole (a top-level rope_parameters replaces
    the loaded one)."""
    config = copy.deepcopy(config)
    config.update({key: value for key, value in overrides.items() if not isinstance(value, dict)})
    for key, value in overrides.items():
        if isinstance(value, dict):
            current = getattr(config, key, None)
            if isinstance(current, PreTrainedConfig):
                _vllm_update_nested(current, value)
            else:
                setattr(config, key, copy.deepcopy(value))
    return config


def _vllm_update_nested(target, updates: dict) -> None:
    """vllm/config/model.py `_update_nested` (0.34.0)."""
    for key, value in updates.items():
        if isinstance(value, dict):
            nested = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
            if nested is not None and (isinstance(nested, dict) or hasattr(nested, "__dict__")):
                _vllm_update_nested(nested, value)
                continue
        if isinstance(target, dict):
            target[key] = copy.deepcopy(value)
        else:
            setattr(target, key, copy.deepcopy(value))


def sglang_overridden(config, overrides: dict):
    """`config` with SGLang 0.5.23's `--json-model-override-args` applied
    (srt/utils/hf_transformers/config.py `get_config`): a dict given for a nested config updates it
    (`PretrainedConfig.update`: its rope_parameters replaced whole), a rope_parameters dict is
    merged over the loaded one (`{**current, **value}`: a key the loaded dict has and the override
    lacks stays), any other value is set."""
    config = copy.deepcopy(config)
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PreTrainedConfig):
            current.update(copy.deepcopy(value))
        elif key in ("rope_scaling", "rope_parameters") and isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, {**current, **copy.deepcopy(value)})
        else:
            setattr(config, key, copy.deepcopy(value))
    return config


OVERRIDDEN = {"vLLM 0.30-0.34": vllm_overridden, "SGLang 0.5.23": sglang_overridden}
