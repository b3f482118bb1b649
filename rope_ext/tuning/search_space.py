"""The search spaces of `rope-ext search` (docs/search.md): each a method and the declared
dimensions searched for it, with the seeds of its first generation.

A candidate is a dict {dimension name: value}; the name is the patch parameter the value sets and
the candidate's key in the search log. Each dimension keeps its values legal (bounds, grid,
order), mutates them and crosses two of them over, so one evolution loop (rope_ext.tuning.search.Search)
runs over any space. Lists cross over entry by entry; a scalar at its parents' midpoint, since
picking one parent's value would only repeat a candidate already evaluated.

- `longrope`: `long_factor`, one factor per rotated pair (LongRoPE's space, as before spaces);
- `dpe`: `scales`, one power of two per group of frequency pairs (DPE's);
- `string`: `shift`, STRING's S;
- `self_extend`: `group`, SelfExtend's one scale (DPE with one group), for the temperature below;
- with `temperature`, a space whose method takes the query scales adds `attn_scale`, Llama 4's
  query temperature (floor_scale the trained window)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from rope_ext.geometry import RotaryGeometry
from rope_ext.method import REGISTRY
from rope_ext.method.attention_side import default_window
from rope_ext.method.base import default_inv_freq
from rope_ext.method.dpe import PRESETS, WINDOW_FRACTION
from rope_ext.method.rope import ntk, yarn
from rope_ext.method.self_extend import choose_group
from rope_ext.method.string import LOCAL, SHIFT_FRACTION

STEP = 0.01  # LongRoPE's grid for lambda
HEADROOM = 1.25  # lambda_i <= 1.25 s, LongRoPE's upper bound
MUTATION_RATE = 0.3  # the share of a list's entries a mutation moves
MUTATION_SCALE = 0.1  # the spread of a move, in log(value)
SCALE_REACH = 4  # scales up to 4x the uniform one that reaches the length: DPE's slowest group (128 at 16x over 32)
DPE_GROUPS = 8  # the authors' grouping of Llama-3-8B's pairs
PRESET_REACH = 32  # the uniform power-of-two scale that reaches 128k over 8192 at W = 1024, beside the preset
SHIFT_FRACTIONS = (SHIFT_FRACTION, 0.25, 0.4)  # STRING's default and the ends of its "0.25 to 0.4 of the length"
TEMPERATURE_TOP = 0.5  # attn_scale bound: Llama 4 Scout states 0.1
TEMPERATURE_STEP = 0.01
TEMPERATURE_MOVE = 0.05  # the spread of a temperature move
SCOUT_TEMPERATURE = 0.1
# each space's dimension names, the keys of its candidates in the log, known before a model loads
NAMES = {"longrope": ("long_factor",), "dpe": ("scales",), "string": ("shift",), "self_extend": ("group",)}
TEMPERATURE_NAME = "attn_scale"


@dataclass(frozen=True)
class Dimension:
    """One searched parameter of `method`: `name` is the patch parameter it sets."""

    name: str
    method: str

    def legal(self, value):
        raise NotImplementedError

    def mutate(self, value, rng: random.Random):
        raise NotImplementedError

    def crossover(self, a, b, rng: random.Random):
        raise NotImplementedError


@dataclass(frozen=True)
class PairFactors(Dimension):
    """LongRoPE's per-pair factors: non-decreasing, in [1, HEADROOM s], on the STEP grid."""

    factor: float

    def legal(self, value) -> list[float]:
        top = math.floor(HEADROOM * self.factor / STEP) * STEP
        out, floor = [], 1.0
        for entry in value:
            floor = max(floor, min(max(float(entry), 1.0), top))
            out.append(round(round(floor / STEP) * STEP, 2))
        return out

    def mutate(self, value, rng: random.Random) -> list[float]:
        moved = [v * math.exp(rng.gauss(0, MUTATION_SCALE)) if rng.random() < MUTATION_RATE else v for v in value]
        return self.legal(moved)

    def crossover(self, a, b, rng: random.Random) -> list[float]:
        return self.legal([x if rng.random() < 0.5 else y for x, y in zip(a, b)])


@dataclass(frozen=True)
class PowerScales(Dimension):
    """DPE's per-group scales: powers of two in [1, top], in any order across groups (the
    authors' published scales [4, 4, 2, 16, 32, 32, 16, 128] are not monotone); a mutation moves
    an entry one power up or down."""

    top: int

    def legal(self, value) -> list[int]:
        return [min(max(1, 2 ** round(math.log2(max(1, v)))), self.top) for v in value]

    def mutate(self, value, rng: random.Random) -> list[int]:
        return self.legal([v * 2 ** rng.choice((-1, 1)) if rng.random() < MUTATION_RATE else v for v in value])

    def crossover(self, a, b, rng: random.Random) -> list[int]:
        return self.legal([x if rng.random() < 0.5 else y for x, y in zip(a, b)])


@dataclass(frozen=True)
class Whole(Dimension):
    """A whole number in [low, high]: STRING's shift, SelfExtend's group; a mutation moves it by a
    log-normal step."""

    low: int
    high: int

    def legal(self, value) -> int:
        return min(max(round(value), self.low), self.high)

    def mutate(self, value, rng: random.Random) -> int:
        return self.legal(value * math.exp(rng.gauss(0, MUTATION_SCALE)))

    def crossover(self, a, b, rng: random.Random) -> int:
        return self.legal((a + b) / 2)


@dataclass(frozen=True)
class Temperature(Dimension):
    """Llama 4's attn_scale in [0, TEMPERATURE_TOP] on its grid; 0 is no temperature."""

    def legal(self, value) -> float:
        return round(round(min(max(float(value), 0.0), TEMPERATURE_TOP) / TEMPERATURE_STEP) * TEMPERATURE_STEP, 2)

    def mutate(self, value, rng: random.Random) -> float:
        return self.legal(value + rng.gauss(0, TEMPERATURE_MOVE))

    def crossover(self, a, b, rng: random.Random) -> float:
        return self.legal((a + b) / 2)


@dataclass(frozen=True)
class Space:
    """A method, its searched dimensions, the patch parameters held fixed, and the named seeds of
    generation 0, the method's own default or the published setting first (its mutations complete
    the generation). `native`: the method's checkpoint is
    transformers' own config; `scoring`: parameters a score adds to the patch the checkpoint holds."""

    name: str
    method: str
    dimensions: tuple[Dimension, ...]
    seeds: dict[str, dict]
    fixed: dict = field(default_factory=dict)
    native: bool = False
    scoring: dict = field(default_factory=dict)

    def params(self, candidate: dict) -> dict:
        """The patch parameters of `candidate`."""
        return {**self.fixed, **{d.name: candidate[d.name] for d in self.dimensions}}

    def mutate(self, candidate: dict, rng: random.Random) -> dict:
        return {d.name: d.mutate(candidate[d.name], rng) for d in self.dimensions}

    def crossover(self, a: dict, b: dict, rng: random.Random) -> dict:
        return {d.name: d.crossover(a[d.name], b[d.name], rng) for d in self.dimensions}

    def key(self, candidate: dict) -> tuple:
        return tuple(_frozen(candidate[d.name]) for d in self.dimensions)

    def candidate(self, record: dict) -> dict:
        return {d.name: record[d.name] for d in self.dimensions}


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


def power_at_least(value: float) -> int:
    return 2 ** math.ceil(math.log2(value))


def longrope(geometry: RotaryGeometry, factor: float, target: int) -> Space:
    """YaRN's, PI's and NTK's frequencies as per-pair factors theta_i / theta_i'."""
    dim = PairFactors(*NAMES["longrope"], "longrope", factor)
    trained = default_inv_freq(geometry)
    seeds = {
        "yarn": (trained / yarn(geometry, factor=factor)[0]).tolist(),
        "pi": [factor] * (geometry.rotary_dim // 2),
        "ntk": (trained / ntk(geometry, factor=factor)[0]).tolist(),
    }
    seeds = {k: {dim.name: dim.legal(v)} for k, v in seeds.items()}
    # causal=False: one group per forward; the answer rows lie past the window, where both
    # schedules use the long factors for every key
    return Space("longrope", "longrope", (dim,), seeds, native=True, scoring={"causal": False})


def dpe(geometry: RotaryGeometry, factor: float, target: int, groups: int = DPE_GROUPS) -> Space:
    """`groups` power-of-two scales up to SCALE_REACH times the smallest uniform one that reaches
    `target`, window L / 8 (dpe's default). Seeds: that uniform scale in every group (SelfExtend
    with a power-of-two group), and with 8 groups the authors' Llama-3-8B scales moved by the ratio
    of that scale to theirs, so their pattern across groups sits at this length."""
    pairs, trained = geometry.rotary_dim // 2, geometry.original_window
    if pairs % groups:
        raise ValueError(f"--groups {groups} does not divide this model's {pairs} frequency pairs into equal groups")
    window = max(1, trained // WINDOW_FRACTION)
    uniform = power_at_least(choose_group(trained, target, window, "reach"))
    dim = PowerScales(*NAMES["dpe"], "dpe", SCALE_REACH * uniform)
    seeds = {"uniform": [uniform] * groups}
    if groups == len(PRESETS["llama3-8b-instruct"]):
        seeds["preset"] = [s * uniform / PRESET_REACH for s in PRESETS["llama3-8b-instruct"]]
    seeds = {k: {dim.name: dim.legal(v)} for k, v in seeds.items()}
    return Space("dpe", "dpe", (dim,), seeds, {"window": window})


def string(geometry: RotaryGeometry, factor: float, target: int) -> Space:
    """The shift S between local + 1 and the most the frequencies cover (S <= max(L, N - S)), the
    local window held at its default for the default shift. Seeds: 0.33 (the default), 0.25 and
    0.4 of N."""
    trained = geometry.original_window
    local = min(LOCAL, int(SHIFT_FRACTION * target) // 2)
    dim = Whole(*NAMES["string"], "string", local + 1, min(target - 1, max(trained, target // 2)))
    seeds = {f"{f:g}N": {dim.name: dim.legal(int(f * target))} for f in SHIFT_FRACTIONS}
    return Space("string", "string", (dim,), seeds, {"local": local})


def self_extend(geometry: RotaryGeometry, factor: float, target: int) -> Space:
    """The group from the smallest that follows the authors' rule at `target` (a smaller one
    reaches the length with a grouped span past 2/3 of L, which they advise against) to
    SCALE_REACH times it, the window at its default. Seeds: that group, and twice it."""
    trained = geometry.original_window
    window = default_window(trained)
    authors = choose_group(trained, target, window, "authors")
    dim = Whole(*NAMES["self_extend"], "self_extend", authors, SCALE_REACH * authors)
    seeds = {"authors": {dim.name: authors}, "twice": {dim.name: dim.legal(2 * authors)}}
    return Space("self_extend", "self_extend", (dim,), seeds, {"window": window})


SPACES = {"longrope": longrope, "dpe": dpe, "string": string, "self_extend": self_extend}


def check_temperature(name: str) -> None:
    """ValueError unless the method of space `name` takes the query temperature."""
    if not REGISTRY[name].takes_query_scales:
        takes = sorted(space for space in SPACES if REGISTRY[space].takes_query_scales)
        raise ValueError(
            f"--temperature: {name} does not take the query temperature; the spaces whose method does: {', '.join(takes)}"
        )


def with_temperature(space: Space) -> Space:
    """`space` with Llama 4's attn_scale as one more dimension: each seed at 0 (the method
    alone), and the first one also at Scout's 0.1."""
    check_temperature(space.method)
    dim = Temperature(TEMPERATURE_NAME, space.method)
    seeds = {name: {**seed, dim.name: 0.0} for name, seed in space.seeds.items()}
    first = next(iter(space.seeds))
    seeds[f"{first}+scout"] = {**space.seeds[first], dim.name: SCOUT_TEMPERATURE}
    return Space(space.name, space.method, (*space.dimensions, dim), seeds, space.fixed, space.native, space.scoring)


def names(name: str, temperature: bool) -> tuple[str, ...]:
    return NAMES[name] + ((TEMPERATURE_NAME,) if temperature else ())


def build(name: str, geometry: RotaryGeometry, factor: float, target: int, temperature: bool, groups: int) -> Space:
    """The space `name` for a model of `geometry` extended `factor` times to `target` tokens."""
    space = dpe(geometry, factor, target, groups) if name == "dpe" else SPACES[name](geometry, factor, target)
    return with_temperature(space) if temperature else space
