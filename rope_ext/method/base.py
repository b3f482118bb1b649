"""The contract every context-extension method meets.

A method is a `Method`: a name, its parameters as data (`Param`s: kind, bounds, default, and the
`constraints` between them, which `Method.validate` checks for every method alike), and one pure
frequency function `(geometry, seq_len, *, factor, **params) -> (inv_freq, attention_factor)`.
What a method may add is declared on it, never special-cased by the orchestration
(rope_ext.patching):

- `bind(params)`: the method for these parameters, for a method whose parameter set depends on
  one of them (alibi_hybrid's `rope`);
- `resolve(facts, geometry, factor, params)`: parameters derived from the model (self_extend's
  group and window, alibi_hybrid's bias-free distance), and the checks of parameters against
  the model (alibi_hybrid's heads, its `w` on flash attention);
- `attention(rotary, facts, params)`: transforms run inside attention (rope_ext.attention), with what
  they keep on the model;
- `native(geometry, factor, params, rope)`: the transformers `rope_parameters` that reproduce the
  method on a plain reload, or None (`native_over_linear`: the same on a checkpoint that keeps
  its own linear scaling);
- `load_state(model, path, params)`: state a saved checkpoint holds beyond the config;
- `notes(geometry, factor, params)`: what the method states about the parameters it resolved, as
  data for PatchInfo.notes (self_extend: whether its authors' rule holds);
- `kv_cache(config, params)`: the KV cache that chunked prefill, perplexity and generation fill
  (rope_ext.chunked), for a method that can let keys go (sink_window); None: transformers'
  DynamicCache;
- `takes_query_scales`: the method has the query scales QUERY_SCALE_PARAMS (`logn`, `attn_scale`,
  `floor_scale`), for a method whose attention rotates each query itself at its own position
  (rope_ext.attention.RotateInAttention).

Two facts say how the rotation runs, and the flags the orchestration reads follow from them:

- `rotation`: "static", the rotary module's (cos, sin) rotate queries and keys before the KV cache
  as in the unpatched model; or "attention", the cache keeps keys before rotation and attention
  rotates queries and keys at every forward (`dynamic`), so that a key's angle may change as the
  input grows and decode still equals one forward;
- `follows_length`: the frequencies follow the length a query has seen (dynamic NTK, dynamic
  YaRN), which needs the rotation inside attention and brings the causal schedule's parameters
  (SCHEDULE_PARAMS);
- `window_step`: the frequencies that follow the length take one value inside the trained window
  and one past it (longrope's short and long factors), so the schedule has two lengths and no
  granularity.

`needs_attention_interface` follows from the method having attention transforms; attention-side
methods (rope_ext.method.attention_side) declare what they add on top of this contract there.

What a method requires of a model whatever its parameters is one value, `requires` (`Requires`:
derived from the facts above, with what attention-side methods and alibi_hybrid add), and what the
family adapter found is another (`ModelFacts`); `refusal(method, facts, length)` checks one against
the other, the one place that decides whether a method runs on a model, with the reason.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from rope_ext.geometry import RotaryGeometry

FrequencyFn = Callable[..., "tuple[torch.Tensor, float]"]

# How a dynamic method's length is chosen (read by the rotary module, not by the math):
# causal=True gives each token the scaling for the length it has seen, so a full forward equals
# token-by-token decoding; causal=False uses one scaling per forward from its longest position, as
# transformers does. granularity=g re-scales every g tokens past the window instead of every token;
# None, the default, is 1/GRANULARITY_PARTS of the trained window (`default_granularity`).
# SCHEDULE_PARAMS (below, with the Params): their defaults.
# A forward past the window attends in one group per scaling, each against its whole key prefix, so
# its cost grows as the number of groups: at granularity 1 a 9216-token prompt over an 8192 window
# took 70.8 s on an H200 where plain takes 0.1 (docs/gpu.md). At window / 8 a prompt at 4x the
# window is 24 groups and one at 8x 56 (docs/benchmarks.md, the causal schedule's default); the
# scaling a row uses is that of a length at most window / 8 past what it has seen.
GRANULARITY_PARTS = 8


def default_granularity(window: int) -> int:
    return max(1, window // GRANULARITY_PARTS)


ROTATIONS = ("static", "attention")

# Scales of each query by its position, read by the attention (RotateInAttention), not by the math,
# so they need a per-query hook: only methods with `takes_query_scales` have them.
# - `logn`, Qwen's log-n scale (docs/logn.md): True multiplies a query at position p past the trained
#   window L by log(p + 1) / log(L);
# - `attn_scale` and `floor_scale`, Llama 4's attention temperature (transformers' Llama4TextAttention,
#   its config's attn_scale and floor_scale; docs/logn.md): the rotated query at position p times
#   1 + attn_scale * log1p(floor((p + 1) / floor_scale)); attn_scale 0 is off, floor_scale None is L.
# QUERY_SCALE_PARAMS (below, with the Params): their defaults.

# Bounds that keep the arithmetic finite: positions and windows are int64 tensors that a product
# of two such sizes must not overflow; the max_length of factor x window must be an int; cos/sin
# scaled by attention_factor scale both queries and keys, so logits grow by its square.
# Attention backends whose mask cannot be sliced into the causal schedule's groups of queries
# (flex attention's BlockMask: "Cannot use mask_mod from a sliced BlockMask")
UNGROUPED_BACKENDS = ("flex_attention",)

MAX_POSITIONS = 2**31 - 1
MAX_FACTOR = 2.0**20
MAX_ATTENTION_FACTOR = 100.0


PARAM_KINDS = ("bool", "number", "float", "size", "choice", "list")


@dataclass(frozen=True)
class Param:
    """One parameter of a method, as data (the shape of peft's LoraConfig fields): `Method.validate`
    checks every parameter by its Param (`checked`), so a method declares its parameters and writes
    no check.

    - `kind` (PARAM_KINDS): "bool", True or False; "number", an int or float, kept as given (numpy
      scalars and 0-d tensors as the Python number they hold); "float", a number as a float;
      "size", an int in [lo, MAX_POSITIONS] (a token count, a group size); "choice", one of
      `choices`; "list", a non-empty list (or 1-D tensor or array) of `item`s, or the name of one
      of its `presets`;
    - `lo`, `hi`: the bounds of a number (either may be None), `lo_open`/`hi_open` leaving them out;
      a size's `lo` (its hi is MAX_POSITIONS);
    - `nullable`: None is a value (by default where the default is None); `required`: a default
      None that the caller must replace;
    - `words`: strings a number also takes (rerope's leak "auto"); `distinct`, `sort`: of a list;
    - `doc`: what the parameter is, said in messages (how else one reads it: NONE_READS, BOUNDS_READ)."""

    name: str
    default: object = None
    kind: str = "number"
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    nullable: bool | None = None
    required: bool = False
    choices: tuple = ()
    words: tuple = ()
    item: Param | None = None
    presets: tuple = ()  # (name, values) pairs
    distinct: bool = False
    sort: bool = False
    doc: str = ""

    def __post_init__(self):
        if self.kind not in PARAM_KINDS:
            raise ValueError(f"parameter {self.name}: kind must be one of {PARAM_KINDS}, got {self.kind!r}")
        if self.nullable is None:
            object.__setattr__(self, "nullable", self.default is None and not self.required)
        if (self.kind == "list") != (self.item is not None):
            raise ValueError(f"parameter {self.name}: a list, and only a list, has an item")


# How the messages of `checked` read a parameter where the default wording does not fit, by its
# name (a name reads alike in every method): what None stands for, and how a number's bounds read,
# from {interval} ("(0, 1]"), {lower} ("> 0"), {upper} ("<= 1"), in place of "a finite number in
# {interval}" (or "a finite number {lower}" of a bound on one side).
NONE_READS = {
    **dict.fromkeys(("group", "window", "chunk_size", "local_size", "shift", "local"), "the default"),
    "leak": "ReRoPE",
    "w": "the original window",
    "heads": "all heads",
    "floor_scale": "the trained window",
}
BOUNDS_READ = {
    **dict.fromkeys(("attention_factor", "partial_rotary_factor"), "in {interval}"),
    **dict.fromkeys(("alpha", "leak"), "a finite number {lower} and {upper}"),
}


def checked(spec: Param, method: str, value, name: str | None = None):
    """`value` checked against `spec` and in its canonical form (a Python number, a list);
    ValueError naming `method` and the parameter (`name`, for an item of a list) otherwise."""
    name = name or spec.name
    none = NONE_READS.get(spec.name, "")
    if value is None and spec.nullable:
        return None
    if spec.kind == "bool":
        if not isinstance(value, bool):
            accepted = "True, False or None" if spec.nullable else "True or False"
            raise ValueError(f"{method}: {name} must be {accepted}, got {value!r}")
        return value
    if spec.kind == "size":
        note = f" (or None for {none})" if spec.nullable and none else ""
        return as_size(value, f"{method}: {name}{note}", 1 if spec.lo is None else spec.lo)
    if spec.kind == "choice":
        if isinstance(value, bool) or value not in spec.choices:
            accepted = ("None or " if spec.nullable else "") + "one of " + ", ".join(map(repr, spec.choices))
            raise ValueError(f"{method}: {name} must be {accepted}, got {value!r}")
        return value
    if spec.kind == "list":
        return _checked_list(spec, method, name, value, none)
    return _checked_number(spec, method, name, value, none)


def _checked_number(spec: Param, method: str, name: str, value, none: str):
    if isinstance(value, str) and value in spec.words:
        return value
    try:
        number = as_number(value, f"{method}: parameter {name}")
    except ValueError:
        if not (spec.words or none):
            raise
        accepted = ([f"None ({none})"] if spec.nullable and none else []) + [repr(w) for w in spec.words]
        lower = "" if spec.lo is None else f" {'>' if spec.lo_open else '>='} {_shown(spec.lo)}"
        raise ValueError(f"{method}: {name} must be {', '.join(accepted)} or a number{lower}, got {value!r}") from None
    inside = math.isfinite(number) and (
        (spec.lo is None or (number > spec.lo if spec.lo_open else number >= spec.lo))
        and (spec.hi is None or (number < spec.hi if spec.hi_open else number <= spec.hi))
    )
    if not inside:
        if spec.lo is None and spec.hi is None:
            raise ValueError(f"{method}: parameter {name}={number!r} must be a finite number")
        why = f" ({spec.doc})" if spec.doc else ""
        raise ValueError(f"{method}: {name} must be {_bounds(spec)}{why}, got {value!r}")
    return float(number) if spec.kind == "float" else number


def _bounds(spec: Param) -> str:
    """How the bounds of a number read in a message."""
    lower = "" if spec.lo is None else f"{'>' if spec.lo_open else '>='} {_shown(spec.lo)}"
    upper = "" if spec.hi is None else f"{'<' if spec.hi_open else '<='} {_shown(spec.hi)}"
    interval = (
        f"{'(' if spec.lo_open else '['}{_shown(spec.lo)}, {_shown(spec.hi)}{')' if spec.hi_open else ']'}"
        if lower and upper
        else ""
    )
    phrase = BOUNDS_READ.get(spec.name) or (
        f"a finite number in {interval}" if lower and upper else f"a finite number {lower or upper}"
    )
    return phrase.format(interval=interval, lower=lower, upper=upper)


def _checked_list(spec: Param, method: str, name: str, value, none: str) -> list:
    presets = dict(spec.presets)
    if presets and isinstance(value, str):
        if value not in presets:
            raise ValueError(f"{method}: unknown {name} preset {value!r}; presets: {', '.join(presets)}")
        return list(presets[value])
    if hasattr(value, "tolist") and getattr(value, "ndim", None) == 1:
        value = value.tolist()
    items = (
        [checked(spec.item, method, item, f"{name}[{i}]") for i, item in enumerate(value)]
        if (isinstance(value, (list, tuple)) and value)
        else None
    )
    if items is None or (spec.distinct and len(set(items)) != len(items)):
        nouns = ("distinct " if spec.distinct else "") + ("ints" if spec.item.kind == "size" else "numbers")
        accepted = (f"None ({none}) or " if spec.nullable and none else "") + f"a non-empty list of {nouns}"
        why = f" ({spec.doc})" if spec.doc else ""
        preset = f" or a preset ({', '.join(presets)})" if presets else ""
        raise ValueError(f"{method}: {name} must be {accepted}{why}{preset}, got {value!r}")
    return sorted(items) if spec.sort else items


def with_defaults(fn: FrequencyFn, *params: Param) -> tuple[Param, ...]:
    """`params` with the defaults the frequency function `fn` states for its keyword parameters:
    a default is written once, in the function that computes with it."""
    stated = {name: p.default for name, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}
    return tuple(replace(p, default=stated[p.name], nullable=None) if p.name in stated else p for p in params)


def _shown(bound) -> str:
    """A bound as a message shows it: an int as itself, a float as %g where that is exact, else
    as the integer it is or 1/N."""
    if isinstance(bound, int) or float(f"{bound:g}") == bound:
        return f"{bound:g}" if isinstance(bound, float) else str(bound)
    if float(bound).is_integer():
        return str(int(bound))
    if 0 < bound < 1 and (1 / bound).is_integer():
        return f"1/{int(1 / bound)}"
    return repr(bound)


@dataclass(frozen=True)
class Ordered:
    """A constraint between parameters: params[names[0]] > params[names[1]] > ... > 0 (yarn's
    beta_fast > beta_slow, llama3's high_freq_factor > low_freq_factor)."""

    names: tuple[str, ...]

    def check(self, method: str, factor, params: dict) -> None:
        values = [params[name] for name in self.names]
        if not all(a > b for a, b in zip(values, [*values[1:], 0])):
            raise ValueError(f"{method}: need {' > '.join(self.names)} > 0, got {', '.join(map(str, values))}")


@dataclass(frozen=True)
class AtLeast:
    """A size's floor beyond its kind's (self_extend's group >= 2), with the reason."""

    name: str
    value: int
    why: str

    def check(self, method: str, factor, params: dict) -> None:
        if params[self.name] is not None and params[self.name] < self.value:
            raise ValueError(f"{method}: {self.name} must be >= {self.value} ({self.why}), got {params[self.name]}")


@dataclass(frozen=True)
class FactorOr:
    """Without a factor, parameter `name` must give the length (self_extend's group, rerope's leak):
    the values in `without` do not, each with why (or "")."""

    name: str
    alternative: str  # what the caller may give instead, with an example
    without: tuple = ((None, ""),)

    def check(self, method: str, factor, params: dict) -> None:
        reasons = dict(self.without)
        value = params[self.name]
        if factor is not None or isinstance(value, bool) or value not in reasons:
            return
        why = reasons[value]
        raise ValueError(f"{method} needs a factor (e.g. factor=4){f': {why}; or give' if why else ' or'} {self.alternative}")


SCHEDULE = (
    Param("causal", True, "bool", doc="each query at the scaling of the length it has seen"),
    Param("granularity", None, "size", lo=1, doc="re-scale every this many tokens; None: 1/8 of the trained window"),
)
SCHEDULE_PARAMS = {p.name: p.default for p in SCHEDULE}
QUERY_SCALES = (
    Param("logn", False, "bool", doc="Qwen's log-n scale of queries past the trained window"),
    Param("attn_scale", 0.0, "float", lo=0, doc="0: no temperature"),
    Param("floor_scale", None, "size", lo=1),
)
QUERY_SCALE_PARAMS = {p.name: p.default for p in QUERY_SCALES}


@dataclass(frozen=True)
class ModelFacts:
    """What the family adapter found about the model a method patches: what `refusal` checks a
    method's `Requires` against, and what a method's `resolve` may read. The fields after `config`
    are what the probe proved of the structure (patches/probe.py), as the reason where a method
    cannot run on it; their defaults are a model that takes every method."""

    family: str
    backend: str  # the attention implementation, without a rope-ext wrapper prefix
    num_heads: int
    causal: bool  # every attention layer is causal
    attention_interface: bool  # attention runs through transformers' AttentionInterface
    config: dict = field(default_factory=dict)  # the model's config, for settings a checkpoint states for a method
    # Why rope-ext's rotation inside attention cannot stand in for the model's, so that only
    # methods that change the rotary module's output (rotation "static") apply; None when it can.
    static_only: str | None = None
    # Why the model's attention is not causal softmax attention of its queries, keys and values,
    # which the methods that compute attention themselves need; None when it is.
    not_plain_attention: str | None = None
    # Where the rotation reaches besides the queries and keys attention receives (with the
    # reason), which the methods that rotate inside attention would hand an identity; None: nowhere.
    rotation_elsewhere: str | None = None
    # What attention hides from a query within a length besides later keys and its sliding window's
    # (a chunk, an indexer's top-k), proven by a forward past the sizes the config declares, which
    # runs only when asked (the patch's length decides how far); None: it hides nothing else.
    keys_hidden: Callable[[int], str | None] | None = None
    # The window of the model's sliding-window layers below a length, shown by a forward past the
    # window its config declares (the one that keys_hidden runs); None: every layer attends every
    # earlier key within that length, or nothing is known of a window.
    sliding_window: Callable[[int], int | None] | None = None


@dataclass(frozen=True)
class Requires:
    """What a method requires of the model it patches, declared as data (`Method.requires`, derived
    from the method's declared facts) and checked against the model's `ModelFacts` in one place,
    `refusal`, before anything changes."""

    attention_interface: bool = False  # it runs transforms inside transformers' AttentionInterface
    rotation_in_attention: bool = False  # it rotates queries and keys inside attention (keys cached before rotation)
    sliced_mask: bool = False  # it attends a forward's queries in groups, slicing the attention mask per group
    backends: tuple[str, ...] | None = None  # the attention backends it runs on; None: any
    causal: bool = False  # it is defined for causal attention only
    # It computes attention itself over every key it places: the model's attention must be plain
    # causal softmax attention over every key of the patch's length.
    own_attention: bool = False
    # It chooses the keys each query attends by their positions: no sliding window may hide a key
    # within the patch's length.
    keys_by_position: bool = False


def refusal(method: Method, facts: ModelFacts, length: int) -> str | None:
    """Why `method` cannot run on the model of `facts` for a patch meant for `length` tokens, or
    None when it can: the one check of what a method requires (`method.requires`) against what
    the model is, which `rope_ext.patch` runs before the model changes (and the adapter again when
    a patched model switches its attention backend)."""
    requires, name = method.requires, method.name
    if requires.attention_interface and not facts.attention_interface:
        return (
            f"{name} needs attention that runs through transformers' AttentionInterface "
            f"(transformers-native families); the {facts.family!r} family does not"
        )
    if requires.backends is not None and facts.backend not in requires.backends:
        *others, last = requires.backends
        listed = f"{', '.join(others)} or {last}" if others else last
        return f"{name} runs on the {listed} attention backend, not {facts.backend!r}"
    if requires.sliced_mask and facts.backend in UNGROUPED_BACKENDS:
        return (
            f"{name} attends the queries of a forward in groups by the length each has seen, slicing the "
            f"attention mask per group, which the {facts.backend} backend's mask does not allow; use sdpa or eager"
        )
    # A window no shorter than the patch's length hides no key inside it (Phi-3.5's 262144 over
    # 4096 x s); past that length one_sequence refuses the mask that hides keys, at run time.
    if requires.keys_by_position and facts.sliding_window is not None and (window := facts.sliding_window(length)) is not None:
        return (
            f"{name}: the model's layers attend through a sliding window of {window} tokens (config sliding_window), "
            f"shorter than the {length} the patch is meant for, which {name} cannot keep: it chooses the keys "
            "each query attends by their positions"
        )
    if requires.causal and not facts.causal:
        return f"{name} is defined for causal attention only"
    if requires.rotation_in_attention and facts.static_only is not None:
        return (
            f"{name} rotates queries and keys inside attention, and {facts.static_only}; methods that change the "
            "rotary module's output (linear, ntk, yarn, llama3, ...) apply"
        )
    if requires.own_attention and facts.not_plain_attention is not None:
        return f"{name}: {facts.not_plain_attention}"
    if (requires.rotation_in_attention or requires.own_attention) and facts.rotation_elsewhere is not None:
        return f"{name}: {facts.rotation_elsewhere}"
    if requires.own_attention and facts.keys_hidden is not None and (hidden := facts.keys_hidden(length)) is not None:
        return (
            f"{name}: the model's attention selects keys: {hidden}, which {name} would not keep, since it computes "
            "attention itself over every key it places; methods that change the rotary module's output apply"
        )
    return None


@dataclass(frozen=True)
class Method:
    """A registered method: its frequency function, parameters as data (`params`, given as a
    sequence of `Param`s and kept by name; `constraints` between them), and how it behaves."""

    name: str
    fn: FrequencyFn
    summary: str
    formula: str
    params: dict = field(default_factory=dict)  # {name: Param}
    constraints: tuple = ()  # Ordered, AtLeast, FactorOr, ...: checked after every Param
    rotation: str = "static"  # ROTATIONS: where queries and keys are rotated
    follows_length: bool = False  # the frequencies depend on the length a query has seen
    window_step: bool = False  # ... only on whether it is past the trained window
    factor_required: bool = True
    factor_one: bool = False  # the patch may also be for the trained window itself (factor 1)
    takes_query_scales: bool = False

    def __post_init__(self):
        if not isinstance(self.params, dict):
            object.__setattr__(self, "params", {p.name: p for p in self.params})
        if self.rotation not in ROTATIONS:
            raise ValueError(f"{self.name}: rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.follows_length and self.rotation != "attention":
            # keys cached after rotation would keep the angles of the length they were written at
            raise ValueError(f"{self.name}: frequencies that follow the length need rotation='attention'")
        if self.window_step and not self.follows_length:
            raise ValueError(f"{self.name}: window_step is a kind of follows_length")

    @property
    def dynamic(self) -> bool:
        """Whether the KV cache keeps keys before rotation (attention rotates them)."""
        return self.rotation == "attention"

    @property
    def needs_attention_interface(self) -> bool:
        """Whether the method runs transforms inside attention (transformers' AttentionInterface)."""
        return type(self).attention is not Method.attention

    @property
    def requires(self) -> Requires:
        """What the method requires of the model (checked by `refusal`), from its declared facts."""
        return Requires(
            attention_interface=self.needs_attention_interface,
            rotation_in_attention=self.dynamic,
            sliced_mask=self.follows_length,
        )

    @property
    def schedule(self) -> tuple[str, ...]:
        """The SCHEDULE_PARAMS that apply to this method."""
        if self.window_step:
            return ("causal",)
        return tuple(SCHEDULE_PARAMS) if self.follows_length else ()

    def by_forward(self, params: dict) -> str | None:
        """What the method bound to `params` does to every query of a forward by that forward's own
        length (causal=False), so that an input split across forwards is not computed as one
        forward; None: each query by its own position."""
        if "causal" in self.schedule and params.get("causal", True) is False and self.follows_length:
            return "scales every query of a forward for that forward's longest position"
        return None

    @property
    def specs(self) -> dict:
        """{name: Param} of every parameter the method takes: its own, the schedule's that apply,
        the query scales where it takes them."""
        return {
            **self.params,
            **{p.name: p for p in SCHEDULE if p.name in self.schedule},
            **({p.name: p for p in QUERY_SCALES} if self.takes_query_scales else {}),
        }

    @property
    def all_params(self) -> dict:
        """{name: default} of every parameter the method takes."""
        return {name: spec.default for name, spec in self.specs.items()}

    def bind(self, params: dict) -> Method:
        return self

    def validate(self, factor, params: dict) -> dict:
        """Checked parameters with defaults filled in, numbers as Python ints and floats; raises
        ValueError on anything wrong. Every method's check: the factor (where one is given or
        needed), the names, each parameter by its Param, then the `constraints`."""
        if factor is not None or self.factor_required:
            self.accept_factor(factor)
        self._check_known(params)
        specs = self.specs
        for name, spec in specs.items():
            if spec.required and params.get(name) is None:
                raise ValueError(f"{self.name}: {name} is required ({spec.doc})")
        merged = {name: checked(spec, self.name, params.get(name, spec.default)) for name, spec in specs.items()}
        for constraint in self.constraints:
            constraint.check(self.name, factor, merged)
        return merged

    def accept_factor(self, factor) -> float:
        """`factor` as a float: the length the patch is meant for over the trained window, > 1
        (or 1, for a method with `factor_one`)."""
        if self.factor_one and factor == 1 and not isinstance(factor, bool):
            return 1.0
        return check_factor(factor)

    def _check_known(self, params: dict) -> None:
        unknown = sorted(set(params) - set(self.all_params))
        if unknown:
            allowed = ", ".join(self.all_params) or "none"
            raise ValueError(f"unknown parameter(s) {unknown} for method {self.name!r}; allowed: {allowed}")

    def resolve(self, facts: ModelFacts, geometry: RotaryGeometry, factor: float | None, params: dict) -> tuple[float, dict]:
        if "granularity" in self.schedule and params.get("granularity") is None:
            params = {**params, "granularity": default_granularity(geometry.original_window)}
        return factor, params

    def attention(self, rotary, facts: ModelFacts, params: dict) -> list:
        return []

    def native(self, geometry: RotaryGeometry, factor: float, params: dict, rope: dict) -> dict | None:
        return None

    def native_over_linear(self, geometry: RotaryGeometry, factor: float, ratio: float, rope: dict) -> dict | None:
        """`native` for a checkpoint trained with its positions divided by `ratio` (a linear
        scaling it keeps under the patch), or None where the two do not compose into one type."""
        return None

    def load_state(self, model, path, params: dict) -> None:
        pass

    def notes(self, geometry: RotaryGeometry, factor: float, params: dict) -> dict:
        if not self.follows_length or self.window_step or not params.get("causal", True):
            return {}
        step = params["granularity"]
        chosen = " (the default, 1/8 of the trained window)" if step == default_granularity(geometry.original_window) else ""
        return {
            "schedule_cost": (
                f"causal schedule, granularity {step}{chosen}: a forward with R query rows past the trained window attends "
                f"them in about R / {step} groups, each against its whole key prefix rotated at its own scaling, in "
                f"every layer, so its time grows as R x length / {step} (docs/architecture.md, the causal schedule's "
                "cost); its memory stays O(length). A larger granularity divides the groups; decoding is one group "
                "a step; causal=False is one group a forward (transformers' schedule)"
            )
        }

    def kv_cache(self, config, params: dict):
        return None

    def __call__(self, geom: RotaryGeometry, seq_len: int | None, factor: float, params: dict):
        math_params = {k: v for k, v in params.items() if k not in SCHEDULE_PARAMS and k not in QUERY_SCALE_PARAMS}
        return self.fn(geom, seq_len, factor=factor, **math_params)


def as_number(value, what: str) -> int | float:
    """`value` as a Python int or float: numpy scalars and 0-d tensors count as the number they
    hold; a bool, a string or anything else is a ValueError that starts with `what`."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype != torch.bool and not value.dtype.is_complex:
        value = value.item()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and hasattr(value, "item"):
        value = value.item()  # numpy scalars
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return value


def as_size(value, what: str, minimum: int = 1) -> int:
    """`value` as a Python int in [minimum, MAX_POSITIONS] (a token count or a group size)."""
    try:
        number = as_number(value, what)
    except ValueError:
        number = None
    if not isinstance(number, int) or not minimum <= number <= MAX_POSITIONS:
        raise ValueError(f"{what} must be an int in [{minimum}, {MAX_POSITIONS}], got {value!r}")
    return number


def check_factor(factor) -> float:
    """`factor` as a float in (1, MAX_FACTOR]; ValueError naming what is accepted."""
    accepted = f"factor must be a finite number > 1 and <= {MAX_FACTOR:.0f}"
    try:
        number = as_number(factor, "factor")
    except ValueError:
        raise ValueError(f"{accepted}, got {factor!r}") from None
    if not math.isfinite(number) or not 1 < number <= MAX_FACTOR:
        raise ValueError(f"{accepted}, got {factor!r}")
    return float(number)


def default_inv_freq(geom: RotaryGeometry, base: float | torch.Tensor | None = None) -> torch.Tensor:
    """theta_i = base^(-2i/D): the frequencies the model was trained with."""
    exponents = torch.arange(0, geom.rotary_dim, 2, dtype=torch.int64).float() / geom.rotary_dim
    return 1.0 / ((geom.base if base is None else base) ** exponents)
