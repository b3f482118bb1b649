"""What a transformers model does with its rotary embedding, found by running it, not by reading
its source or its model type.

`probe(model)` proves, or refuses with the reason, each fact an adapter needs:

- the rotary module: the one module holding an `inv_freq` buffer, or `{layer_type}_inv_freq`
  buffers, one set per layer type (no module is refused); of a module kept per layer type, the
  patch replaces the frequencies of the full-attention layers (`PATCHED_TYPE`), whose window a
  patch extends, and keeps the others. Of several modules, each holding one set, one identity run
  per module tells which layers each rotates: the patch replaces the one module of the
  full-attention layers (or the only one in use) and keeps those of sliding-window layers;
- the cos/sin format its attention expects: its output at probe positions compared with
  rope-ext's (cat(freqs, freqs), repeated pairs, half width); a module the model calls with a row
  of positions per axis (M-RoPE: text, height, width) must give that output with every axis at
  the tokens' positions, as a text forward calls it (`Structure.axes`);
- which attention modules rotate, which channels, with which pairing: two short forwards, one as
  the model is, one with the rotary module answering an identity rotation. Each attention call's
  queries and keys are captured where they enter attention; a call whose identity-run queries and
  keys equal the real ones is a layer without RoPE (NoPE), any other must equal rope-ext's
  rotation of its identity-run queries and keys bit for bit, in one pairing and one span of
  channels (the leading ones, or the trailing ones of multi-head latent attention) shared by every
  rotating layer. The identity run attends with the real run's queries
  and keys, so every layer sees the inputs it had, and its logits must equal the real run's: a
  rotation applied anywhere else than on what attention receives is caught there; a module whose
  outputs differ between the two runs (a sparse-attention indexer) takes the rotation elsewhere,
  which the methods rotating inside attention cannot follow. Frequencies kept per layer type get
  one identity run per type, each answering an identity rotation for that type alone: the calls it
  changes are the layers of that type, and only the patched type's must be rope-ext's rotation.
"""

from __future__ import annotations

import inspect
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rope_ext.attention import backend
from rope_ext.attention.parts import attend_with_lse_by_scores
from rope_ext.rotation import apply_rotary, cos_sin, polar

PROBE_LENGTH = 8
# fp32 gap between a backend's attention and rope-ext's on the same inputs (summation order)
PLAIN_TOLERANCE = 1e-5
SCORE_REACH = 30.0  # the largest score the attention check feeds a backend
# Of frequencies kept per layer type, the type a patch replaces: the layers that attend over the
# whole context, whose window it extends (as transformers applies a legacy `rope_scaling` to
# Gemma 3's); sliding-window layers never attend past their window and keep their frequencies.
PATCHED_TYPE = "full_attention"

# The short fixed list of reasons a model is refused for; the census test counts by them.
# The probe attends with transformers' eager attention whatever backend the model names: what it
# proves (where the rotation is applied, what attention computes: sinks, softcaps and masks are in
# eager's reference form too) does not depend on the kernel, and a backend this device cannot run
# (flash or paged attention named on a CPU) must not stop the patch before the method's own checks.
PROBE_BACKEND = "eager"
# The probe's forwards attend through one registered name, whose function hands each call to the
# capture of the probe running in the calling thread: a name per probe would be a registration
# transformers never lets go, and one capture for the name would let a probe of another model in
# another thread take this one's calls.
PROBE_NAME = f"rope_ext_probe_{PROBE_BACKEND}"
_CAPTURE: ContextVar = ContextVar("rope_ext_probe_capture")


def _captured(module, query, key, value, attention_mask, **kwargs):
    return _CAPTURE.get()(module, query, key, value, attention_mask, **kwargs)


REASONS = {
    "no-rotary": "no rotary embedding module (a module with an `inv_freq` buffer)",
    "config": "the config the rotary module was built from holds no rope_parameters with a rope_theta",
    "per-layer-config": "the config keeps attributes per layer (a heterogeneous config), which the patch does not write",
    "several-rotary": "several rotary embedding modules",
    "per-layer-type": f"rotary frequencies kept per layer type, without a set for {PATCHED_TYPE} layers alone",
    "format": "a cos/sin format rope-ext does not produce",
    "frequencies": "the model's rotary module does not hold the frequencies its config describes",
    "forward": "the probe forward failed",
    "outside-attention": "the rotation reaches the model outside transformers' AttentionInterface",
    "rotation": "a rotation rope-ext cannot reproduce on the queries and keys attention receives",
    "mixed": "layers rotate different channels or pairings",
    "no-rope-layer": "no attention layer applies the rotation",
    "attention": (
        "the model's attention is not causal softmax attention of its queries, keys and values (learned sinks, a "
        "score softcap or a mask of its own), which the methods that compute attention themselves (self_extend, "
        "rerope, string, sink_window, dca) do not take; frequency methods, dynamic ones included, apply"
    ),
    "rotation-elsewhere": (
        "the rotation also reaches a module other than the queries and keys attention receives (a sparse-attention "
        "indexer choosing keys by rotated scores), which the methods that rotate inside attention (dynamic ones and "
        "self_extend, rerope, string, sink_window, dca) would hand an identity rotation; static frequency methods apply"
    ),
}
# refused per method, at patch(): the methods that compute attention themselves
ATTENTION_REFUSAL = REASONS["attention"]


class Refused(ValueError):
    """A model the probe cannot prove rope-ext owns every rotation of; `reason` is a REASONS key."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(f"{REASONS[reason]}: {detail}")


@dataclass(frozen=True)
class Structure:
    """The proven facts, as names (so that a deep copy of the model answers for the copy)."""

    rotary: str  # the rotary module's name in the model
    attention: tuple[str, ...]  # attention modules, in call order
    rope: tuple[bool, ...]  # whether each applies the rotation the patch replaces (of `layer_type`)
    layout: str  # "half" or "interleaved"
    channels: str  # "leading" or "trailing" (multi-head latent attention): which rotary_dim channels rotate
    head_dim: int
    rotary_dim: int
    cos_format: str  # "cat", "repeated", "half" or "complex"
    plain_attention: bool  # every attention call is causal softmax attention of its inputs (_plain)
    # Of a rotary module kept per layer type: the patched type, and each attention call's type
    # (None: no rotation); the calls of other types are left alone, as NoPE ones are.
    layer_type: str | None = None
    layer_types: tuple[str | None, ...] = ()
    # Of several rotary modules, each with one set of frequencies: the ones whose layers (of a
    # type other than PATCHED_TYPE) the patch keeps, the ones no attention layer uses, and the base
    # of the patched one, which its own config holds (Granite-SWA: one module per base).
    kept_rotary: tuple[str, ...] = ()
    unused_rotary: tuple[str, ...] = ()
    rope_theta: float | None = None
    # modules other than the rotary one whose output the rotation changes outside attention's inputs
    rotation_elsewhere: tuple[str, ...] = ()
    # Why rope-ext's rotation inside attention cannot stand in for the model's, so that only methods
    # that change the rotary module's output (rotation "static") apply; None when it can.
    static_only: str | None = None
    # M-RoPE (Qwen 3.5): the rows of positions per token the model calls the rotary module with
    # (text, height, width); 0: one position per token
    axes: int = 0
    # The sub-config of model.config the rotary module was built from (a composite model's text
    # config, "text_config"), which the patch reads and writes; "" for model.config itself.
    config: str = ""

    @property
    def rope_attention(self) -> tuple[str, ...]:
        return tuple(name for name, rotates in zip(self.attention, self.rope) if rotates)

    @property
    def nope_attention(self) -> tuple[str, ...]:
        """The attention modules the patch leaves alone: without RoPE, or of a layer type it keeps."""
        return tuple(name for name, rotates in zip(self.attention, self.rope) if not rotates)

    @property
    def kept_types(self) -> tuple[str, ...]:
        """The layer types whose layers rotate with frequencies the patch keeps."""
        return tuple(sorted({t for t, rotates in zip(self.layer_types, self.rope) if t is not None and not rotates}))

    @property
    def patched_types(self) -> tuple[str, ...]:
        """The layer types whose layers rotate with the frequencies the patch replaces."""
        return tuple(sorted({t for t, rotates in zip(self.layer_types, self.rope) if t is not None and rotates}))


def rotary_config(model: nn.Module, rotary: nn.Module) -> str:
    """The name of the sub-config of `model.config` that `rotary` was built from (transformers'
    rotary modules keep it as `config`), or "" for `model.config` itself or a module that keeps none."""
    built_from = getattr(rotary, "config", None)
    for name in getattr(model.config, "sub_configs", None) or {}:
        if built_from is not None and getattr(model.config, name, None) is built_from:
            return name
    return ""


def sub_config(config, name: str):
    """`config`'s sub-config `name` (rotary_config), or `config` itself for ""."""
    return getattr(config, name) if name else config


def typed(name: str, layer_type: str | None) -> str:
    """The attribute of a rotary module (`inv_freq`, `original_inv_freq`, `attention_scaling`) that
    holds `name` for `layer_type` (transformers' `{layer_type}_{name}`), or `name` itself."""
    return name if layer_type is None else f"{layer_type}_{name}"


def rotary_call(rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor, layer_type: str | None):
    """(cos, sin) of `rotary` at `positions`, for `layer_type` where it keeps frequencies per type."""
    return rotary(x, positions) if layer_type is None else rotary(x, positions, layer_type)


def formatted(cos: torch.Tensor, sin: torch.Tensor, cos_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """rope-ext's (cos, sin), laid out cat(freqs, freqs), in the format a model's attention expects."""
    if cos_format == "cat":
        return cos, sin
    half = cos.shape[-1] // 2
    if cos_format == "half":
        return cos[..., :half], sin[..., :half]
    return cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)


def find_rotary(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """The rotary modules: each one's name, the module and the layer types it keeps frequencies
    for (none for a module with one set). Several are taken only if each holds one set."""
    found = {}
    for name, module in model.named_modules():
        buffers = [b for b, _ in module.named_buffers(recurse=False) if b.endswith("inv_freq")]
        if buffers:
            found.setdefault(id(module), (name, module, buffers))
    if not found:
        raise Refused("no-rotary", type(model).__name__)
    if len(found) > 1:
        typed_sets = [
            f"`{name}` holds {', '.join(b)}" for name, _, b in found.values() if set(b) - {"inv_freq", "original_inv_freq"}
        ]
        if typed_sets:
            names = ", ".join(f"`{name}`" for name, _, _ in found.values())
            raise Refused("several-rotary", f"{names}; not one set of frequencies each: {'; '.join(typed_sets)}")
        return [(name, module, ()) for name, module, _ in found.values()]
    name, module, buffers = next(iter(found.values()))
    per_type = [b for b in buffers if b not in ("inv_freq", "original_inv_freq")]
    types = tuple(sorted({b.removesuffix("_inv_freq").removesuffix("_original") for b in per_type}))
    if per_type and (len(per_type) < len(buffers) or PATCHED_TYPE not in types):
        raise Refused("per-layer-type", f"`{name}` holds {', '.join(buffers)}")
    return [(name, module, types)]


def cos_format(rotary: nn.Module, positions: torch.Tensor, layer_type: str | None = None) -> str:
    inv_freq = getattr(rotary, typed("inv_freq", layer_type))
    x = torch.zeros(1, device=inv_freq.device, dtype=torch.float32)
    try:
        out = rotary_call(rotary, x, positions, layer_type)
    except Exception as err:  # any signature or shape rope-ext does not call the module with
        raise Refused("format", f"{type(rotary).__name__}(x, position_ids) raised {type(err).__name__}: {err}") from None
    scale = attention_scaling(rotary, layer_type)
    if torch.is_tensor(out) and out.is_complex():
        if out.shape == (*positions.shape, inv_freq.numel()) and torch.equal(out, polar(inv_freq, scale, positions)):
            return "complex"
        raise Refused("format", f"{type(rotary).__name__}'s complex output of shape {tuple(out.shape)} is not e^(i angle)")
    if not (isinstance(out, tuple) and len(out) == 2 and all(torch.is_tensor(t) and not t.is_complex() for t in out)):
        kind = type(out).__name__ if not torch.is_tensor(out) else f"a {out.dtype} tensor"
        raise Refused("format", f"{type(rotary).__name__} returns {kind}, not a real (cos, sin) pair")
    cos, sin = cos_sin(inv_freq, scale, positions, out[0].dtype)
    for name in ("cat", "repeated", "half"):
        mine = formatted(cos, sin, name)
        if all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(out, mine)):
            return name
    raise Refused(
        "format", f"{type(rotary).__name__}'s (cos, sin) of shape {tuple(out[0].shape)} match no layout rope-ext computes"
    )


def axis_count(rotary: nn.Module, calls: list, positions: torch.Tensor, found_format: str, layer_type: str | None) -> int:
    """The rows of positions per token (M-RoPE's axes: text, height, width) of `calls`, the
    per-axis positions the model called `rotary` with in a text forward at `positions`; 0 for none.
    For text every axis holds the token's position, and M-RoPE is plain RoPE only where the module
    then gives rope-ext's (cos, sin) at those positions in `found_format`, bit for bit: compared,
    whatever split of the frequencies among the axes the module keeps."""
    if not calls:
        return 0
    name = type(rotary).__name__
    axes = calls[0].shape[0]
    equal = positions.expand(axes, *positions.shape)
    if not all(p.shape == equal.shape and torch.equal(p.to(equal.device), equal) for p in calls):
        shapes = sorted({tuple(p.shape) for p in calls})
        raise Refused("format", f"{name} is called with positions per axis {shapes} other than the tokens' own")
    x = torch.zeros(1, device=positions.device, dtype=torch.float32)
    try:
        out = rotary_call(rotary, x, equal, layer_type)
    except Exception as err:  # a module that takes per-axis positions in the model's own call only
        raise Refused("format", f"{name}(x, per-axis positions) raised {type(err).__name__}: {err}") from None
    if found_format == "complex" or not (isinstance(out, tuple) and len(out) == 2):
        raise Refused("format", f"{name} is called with positions per axis and returns {type(out).__name__}")
    scale = attention_scaling(rotary, layer_type)
    cos, sin = cos_sin(getattr(rotary, typed("inv_freq", layer_type)), scale, positions, out[0].dtype)
    if not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(out, formatted(cos, sin, found_format))):
        raise Refused("format", f"{name} with its {axes} axes at the tokens' positions is not RoPE at those positions")
    return axes


def attention_scaling(rotary: nn.Module, layer_type: str | None = None) -> float:
    return float(getattr(rotary, typed("attention_scaling", layer_type), 1.0))


class _Capture:
    """The attention function of the probe forwards: records each call's module, queries and keys,
    and attends with the queries and keys `replay` gives for the call (the real run's), if any."""

    def __init__(self, base: str, replay: list | None = None):
        self.base, self.replay, self.calls, self.plain = base, replay, [], []
        self.positions = []  # the positions the rotary module is called with (identity run)

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        index = len(self.calls)
        self.calls.append((module, query.detach().clone(), key.detach().clone()))
        if self.replay is not None:
            if index >= len(self.replay) or self.replay[index][0] is not module:
                raise Refused("outside-attention", "the identity-rotation run called attention in another order")
            _, query, key = self.replay[index]
        attend = backend(module, self.base)
        if self.replay is None:
            self.plain.append(_plain(module, attend, query, key, value, attention_mask, kwargs))
        return attend(module, query, key, value, attention_mask, **kwargs)


def _plain(module, attend, query, key, value, attention_mask, kwargs) -> bool:
    """Whether an attention call is causal softmax attention of its queries, keys and values, the
    attention that methods computing attention themselves (rope_ext's two-part, sink-window and
    chunked attention) reproduce: its mask only hides later keys (Doge adds a learned bias of its
    own), and its output, with queries scaled up so that scores reach tens, is the plain one
    (learned sinks add to the softmax's denominator, a softcap bends large scores)."""
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        allowed = mask if mask.dtype == torch.bool else mask == 0
        blocked = mask.dtype == torch.bool or bool((mask[~allowed] == torch.finfo(mask.dtype).min).all())
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=mask.device).tril()
        if not blocked or not torch.equal(allowed.expand(*allowed.shape[:-2], *causal.shape), causal.expand_as(allowed)):
            return False
    # In fp32 whatever the model's dtype: scores of tens rounded to bf16 move probabilities by
    # percents, which would hide a softcap and fail plain attention alike.
    query, key, value = query.float(), key.float(), value.float()
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    scores = query @ key.repeat_interleave(query.shape[1] // key.shape[1], 1).transpose(-1, -2)
    loud = query * (SCORE_REACH / scores.abs().max().clamp_min(1e-6))
    theirs, _ = attend(module, loud, key, value, attention_mask, **{**kwargs, "scaling": 1.0})
    mine, _ = attend_with_lse_by_scores(loud, key, value, causal=True, scale=1.0)
    mine = mine.transpose(1, 2)
    return mine.shape == theirs.shape and torch.allclose(mine, theirs, rtol=PLAIN_TOLERANCE, atol=PLAIN_TOLERANCE)


def probe_ids(model: nn.Module, length: int, device) -> torch.Tensor:
    """The probe's input: `length` token ids spread over the vocabulary, the same at any length."""
    config = model.config
    vocab = getattr(config, "vocab_size", None) or getattr(config.get_text_config(), "vocab_size", 2)
    return (torch.arange(length, device=device) * 7 + 3) % vocab


class _Keys:
    """An attention function that records which keys each call's mask lets each query see
    (`keys_seen`), then attends as the probe's backend does."""

    def __init__(self, base: str):
        self.base, self.calls = base, []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append((module, keys_seen(attention_mask, query.shape[-2], key.shape[-2])))
        return backend(module, self.base)(module, query, key, value, attention_mask, **kwargs)


def keys_seen(mask: torch.Tensor | None, q_len: int, k_len: int) -> int | None | bool:
    """What an attention mask lets the queries (the last q_len positions of k_len) see, alike in
    every row and head: None, every earlier key and itself; w, the last w of them (transformers'
    sliding window of w tokens: key j for query i where i - w < j <= i); False, anything else (a
    chunk, a key selection, padding, a bias)."""
    if mask is None:
        return None
    mask = mask[..., :k_len]
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        if not bool((mask[~allowed] == torch.finfo(mask.dtype).min).all()):
            return False
    allowed = allowed.expand(*allowed.shape[:-2], q_len, k_len).reshape(-1, q_len, k_len)
    if not bool((allowed == allowed[:1]).all()):
        return False
    allowed = allowed[0]
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=allowed.device).tril(k_len - q_len)
    if torch.equal(allowed, causal):
        return None
    width = int(allowed[-1].sum())
    band = causal & ~torch.ones_like(causal).tril(k_len - q_len - width)
    return width if width > 0 and torch.equal(allowed, band) else False


def keys_at(model: nn.Module, length: int) -> list[tuple[str, int | None | bool]]:
    """Each attention call of a forward of `length` tokens, as (module name, `keys_seen` of its
    mask): what the probe's forward of PROBE_LENGTH tokens cannot show past a window, a chunk or a
    key selection longer than it. Refused("forward") when the model does not run at that length."""
    ids = probe_ids(model, length, next(model.parameters()).device)
    capture, training = _Keys(PROBE_BACKEND), model.training
    model.eval()
    try:
        _run(model, ids[None], capture, None)
    finally:
        model.train(training)
    names = {id(module): name for name, module in model.named_modules()}
    return [(names[id(module)], seen) for module, seen in capture.calls]


def _tensors(output) -> list[torch.Tensor]:
    if torch.is_tensor(output):
        return [output.detach().clone()]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [tensor for item in output for tensor in _tensors(item)]
    return []


class _Outputs:
    """Each module's tensor outputs in a forward, by name (a module called twice, twice)."""

    def __init__(self, model: nn.Module, skip: list[nn.Module]):
        self.seen: dict[str, list] = {}
        self._hooks = [
            module.register_forward_hook(self._hook(name))
            for name, module in model.named_modules()
            if all(module is not other for other in skip)
        ]

    def _hook(self, name):
        def record(module, args, output):
            self.seen.setdefault(name, []).append(_tensors(output))

        return record

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _changed(real: _Outputs, identity: _Outputs) -> tuple[str, ...]:
    """The innermost modules whose outputs differ between the two runs (not the ones holding them)."""

    def same(a, b):
        return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))

    changed = [
        name
        for name, outputs in real.seen.items()
        if len(outputs) != len(identity.seen.get(name, ())) or not all(map(same, outputs, identity.seen[name]))
    ]
    return tuple(name for name in changed if not any(other.startswith(f"{name}.") for other in changed if name))


def _run(model, ids, capture: _Capture, identity_of: nn.Module | None, layer_type: str | None = None):
    """The logits of a forward through `capture`; with `identity_of`, that rotary module answers an
    identity rotation (for `layer_type` alone, where it keeps frequencies per layer type)."""
    config = model.config
    ALL_ATTENTION_FUNCTIONS.register(PROBE_NAME, _captured)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_NAME, ALL_MASK_ATTENTION_FUNCTIONS[PROBE_BACKEND])
    if identity_of is not None:
        real = type(identity_of).forward
        signature = inspect.signature(real)

        def identity(*args, **kwargs):
            capture.positions.append(kwargs.get("position_ids", args[1] if len(args) > 1 else None))
            out = real(identity_of, *args, **kwargs)
            if layer_type is not None and signature.bind(identity_of, *args, **kwargs).arguments.get("layer_type") != layer_type:
                return out
            if torch.is_tensor(out):  # complex: e^(i 0) = 1
                return torch.ones_like(out)
            cos, sin = out
            return torch.ones_like(cos), torch.zeros_like(sin)

        identity_of.forward = identity
    # Setting a composite config's backend sets its sub-configs' too, which may differ (a text config
    # on sdpa beside an eager one): each gets its own back.
    configs = [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {})]
    saved = [(each, each._attn_implementation_internal) for each in configs if each is not None]
    config._attn_implementation = PROBE_NAME
    token = _CAPTURE.set(capture)
    try:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits
    except Refused:
        raise
    except Exception as err:  # a model this short input does not run: nothing can be proven
        raise Refused("forward", f"{type(err).__name__}: {err}") from None
    finally:
        _CAPTURE.reset(token)
        for each, backend in saved:
            each._attn_implementation_internal = backend
        if identity_of is not None:
            del identity_of.forward


def _rotation(real, identity, cos, sin, upcast: bool = False):
    """The (layout, channels) under which rope-ext's rotation of `identity` gives `real` bit for
    bit, None when the tensors are equal (no rotation), or False. With `upcast`, the rotation in
    fp32 cast back to `real`'s dtype (what some models do at half precision)."""
    if torch.equal(real, identity):
        return None
    spans = ("leading", "trailing") if identity.shape[-1] > cos.shape[-1] else ("leading",)
    for channels in spans:
        for layout in ("half", "interleaved"):
            if upcast:
                rotated = apply_rotary(identity.float(), cos.float(), sin.float(), layout, channels).to(real.dtype)
            else:
                rotated = apply_rotary(identity, cos, sin, layout, channels)
            if torch.equal(rotated, real):
                return layout, channels
    return False


def probe(model: nn.Module) -> Structure:
    """The structure of `model` (a transformers PreTrainedModel, unwrapped), or Refused."""
    candidates = find_rotary(model)
    rotary_name, rotary, types = candidates[0]
    several = len(candidates) > 1
    config_name = rotary_config(model, rotary)
    rope_config = sub_config(model.config, config_name)
    parameters = getattr(rope_config, "rope_parameters", None)
    entries = [parameters.get(t) if isinstance(parameters, dict) else None for t in types] if types else [parameters]
    if not all(isinstance(entry, dict) and "rope_theta" in entry for entry in entries):
        raise Refused("config", f"{type(rope_config).__name__}.rope_parameters is {parameters!r}")
    if getattr(rope_config, "is_heterogeneous", False):
        raise Refused("per-layer-config", f"per-layer {', '.join(sorted(rope_config.per_layer_attributes))}")
    patched = PATCHED_TYPE if types else None
    device = getattr(rotary, typed("inv_freq", patched)).device
    positions = torch.arange(PROBE_LENGTH, device=device)[None]
    if not several:
        found_format = cos_format(rotary, positions, patched)
    config = model.config
    ids = probe_ids(model, PROBE_LENGTH, device)
    training = model.training
    model.eval()
    base = PROBE_BACKEND
    try:
        real, real_outputs = _Capture(base), _Outputs(model, [module for _, module, _ in candidates])
        try:
            logits = _run(model, ids[None], real, None)
        finally:
            real_outputs.remove()
        if not real.calls:
            raise Refused("outside-attention", "no attention call went through transformers' AttentionInterface")
        kept = {}  # the layer types (or the other rotary modules) the patch keeps: which calls each rotates
        kept_rotary, unused_rotary = (), ()
        if several:
            runs = {name: _identity(model, ids, real, logits, module, None) for name, module, _ in candidates}
            rotary_name, kept_rotary, unused_rotary = _served(model, real, runs)
            rotary = model.get_submodule(rotary_name)
            ident, ident_outputs = runs.pop(rotary_name)
            kept = {name: run for name, (run, _) in runs.items()}
            found_format = cos_format(rotary, positions)
        else:
            ident, ident_outputs = _identity(model, ids, real, logits, rotary, patched)
        per_axis = [p for p in ident.positions if torch.is_tensor(p) and p.dim() > 2]
        axes = axis_count(rotary, per_axis, positions, found_format, patched)
        for layer_type in types:
            if layer_type != patched:
                kept[layer_type] = _Capture(base, real.calls)
                _run(model, ids[None], kept[layer_type], rotary, layer_type)
    finally:
        model.train(training)
    # e.g. DeepSeek-V3.2's indexer: it ranks keys by its own rotated scores, all of them at this length
    elsewhere = _changed(real_outputs, ident_outputs)
    names = {id(module): name for name, module in model.named_modules()}
    modules = [module for module, _, _ in real.calls]
    if len({id(m) for m in modules}) != len(modules):
        raise Refused("outside-attention", "an attention module is called more than once in a forward")
    inv_freq = getattr(rotary, typed("inv_freq", patched))
    rotary_dim = 2 * inv_freq.numel()
    scale = attention_scaling(rotary, patched)
    rope, layouts, head_dims, layer_types, unreproduced, upcast = [], set(), set(), [], [], []
    for index, ((module, q, k), (_, q_id, k_id)) in enumerate(zip(real.calls, ident.calls)):
        cos, sin = cos_sin(inv_freq, scale, positions, q.dtype)
        found = {_rotation(q, q_id, cos, sin), _rotation(k, k_id, cos, sin)}
        rotated_by = [t for t, run in kept.items() if not _unchanged(run.calls[index], q, k)]
        if found == {None}:
            rope.append(False)
            if len(rotated_by) > 1:
                raise Refused("rotation", f"`{names[id(module)]}` rotates with the frequencies of {rotated_by}")
            layer_types.append((_layer_type(config, module) if several else rotated_by[0]) if rotated_by else None)
            continue
        if found_format == "complex" and not rotated_by:
            # The model multiplies queries and keys, viewed as complex pairs of adjacent channels, by
            # the module's output itself: a static patch reaches it through that output alone.
            if found != {("interleaved", "leading")}:
                unreproduced.append(names[id(module)])
            found = {("interleaved", "leading")}
        if rotated_by:
            raise Refused(
                "rotation",
                f"`{names[id(module)]}` rotates with the frequencies of {rotated_by} besides those the patch replaces",
            )
        if len(found) != 1 or False in found or None in found:
            # A norm or another step between the rotation and attention (HunYuan), or another sign of
            # rotate_half (nanochat): rope-ext cannot rotate for the model, but the model rotates
            # itself with the module's output, which the format check proved is rope-ext's (cos, sin).
            # At half precision a model may rotate in fp32 and cast back (Cohere, OLMo 2): named so.
            unreproduced.append(names[id(module)])
            if q.dtype != torch.float32:
                # cos and sin as fp32 angles (OLMo 2), or as the module's output upcast (Cohere)
                for pair in (cos_sin(inv_freq, scale, positions, torch.float32), (cos, sin)):
                    if len({_rotation(q, q_id, *pair, True), _rotation(k, k_id, *pair, True)} - {None, False}) == 1:
                        upcast.append(names[id(module)])
                        break
        else:
            layouts |= found
        rope.append(True)
        layer_types.append(_layer_type(config, module) if several else patched)
        head_dims.add(q.shape[-1])
    if not any(rope):
        rotated = f" with the {patched} frequencies" if patched else ""
        raise Refused("no-rope-layer", f"{len(modules)} attention calls, none rotated{rotated}")
    if len(layouts) > 1 or len(head_dims) > 1:
        raise Refused("mixed", f"pairings {sorted(layouts)}, head sizes {sorted(head_dims)}")
    # Where no layer's rotation is rope-ext's, only static methods apply and rope-ext never rotates
    # for the model: the pairing is the one the module's format is laid out for.
    layout, channels = layouts.pop() if layouts else ("interleaved" if found_format == "repeated" else "half", "leading")
    static_only = None
    if unreproduced and len(upcast) == len(unreproduced) and found_format != "complex":
        dtype = str(real.calls[0][1].dtype).removeprefix("torch.")
        static_only = (
            f"in {len(upcast)} of its {sum(rope)} rotating layers (`{upcast[0]}`, ...) the model rotates queries and keys "
            f"in float32 and casts them back to {dtype}, which rope-ext's rotation in {dtype} does not give bit for bit; "
            "loaded in float32 the model takes every method, bit for bit"
        )
    elif unreproduced and found_format != "complex":
        static_only = (
            f"in {len(unreproduced)} of its {sum(rope)} rotating layers (`{unreproduced[0]}`, ...) attention receives "
            "queries and keys that rope-ext's rotation does not give bit for bit (a norm or another step between the "
            "rotation and attention, or a pairing other than halves or interleaved pairs of the leading or trailing "
            f"channels); the model rotates them itself with `{rotary_name}`'s output"
        )
    if found_format == "complex":
        static_only = (
            f"`{rotary_name}` returns complex freqs_cis, which the model multiplies with its queries and keys itself, "
            "in fp32 at any model dtype"
        )
        if unreproduced:
            static_only += (
                f"; in {len(unreproduced)} of its {sum(rope)} rotating layers (`{unreproduced[0]}`, ...) attention receives "
                "queries and keys that rope-ext's rotation does not give bit for bit (the complex product rounds "
                "otherwise, or a norm follows the rotation)"
            )
    return Structure(
        rotary=rotary_name,
        attention=tuple(names[id(m)] for m in modules),
        rope=tuple(rope),
        layout=layout,
        channels=channels,
        head_dim=head_dims.pop(),
        rotary_dim=rotary_dim,
        cos_format=found_format,
        plain_attention=all(real.plain),
        layer_type=patched,
        layer_types=tuple(layer_types) if types or several else (),
        kept_rotary=kept_rotary,
        unused_rotary=unused_rotary,
        rope_theta=_own_theta(rotary) if several else None,
        rotation_elsewhere=elsewhere,
        static_only=static_only,
        axes=axes,
        config=config_name,
    )


def _identity(model, ids, real: _Capture, logits, rotary: nn.Module, layer_type: str | None):
    """The capture and module outputs of a forward in which `rotary` answers an identity rotation
    (for `layer_type` alone), attending with the real run's queries and keys; Refused when its
    logits differ from the real run's (the rotation reaches the model elsewhere too)."""
    ident, outputs = _Capture(real.base, real.calls), _Outputs(model, [rotary])
    try:
        if not torch.equal(_run(model, ids[None], ident, rotary, layer_type), logits):
            raise Refused("outside-attention", "an identity rotation fed to attention's own inputs changes the logits")
    finally:
        outputs.remove()
    return ident, outputs


def _layer_type(config, attention: nn.Module) -> str | None:
    """An attention layer's type in the config's `layer_types` (None where it states none)."""
    types, index = getattr(config, "layer_types", None), getattr(attention, "layer_idx", None)
    return types[index] if isinstance(types, (list, tuple)) and isinstance(index, int) and 0 <= index < len(types) else None


def _served(model: nn.Module, real: _Capture, runs: dict) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """Of several rotary modules (name -> its identity run): the one the patch replaces, those it
    keeps, those no attention layer uses. The calls a module's identity run changes are the layers
    it rotates; the patch takes one module rotating full-attention layers (or the only module any
    layer uses), and keeps the others only if each rotates layers of a stated type other than
    PATCHED_TYPE (sliding-window ones, which never attend past their window)."""
    names = {id(module): name for name, module in model.named_modules()}
    serves = {
        name: [index for index, (_, q, k) in enumerate(real.calls) if not _unchanged(run.calls[index], q, k)]
        for name, (run, _) in runs.items()
    }
    kinds = [_layer_type(model.config, module) for module, _, _ in real.calls]
    used = [name for name, calls in serves.items() if calls]
    unused = tuple(name for name, calls in serves.items() if not calls)
    kept = tuple(name for name in used if all(kinds[i] not in (None, PATCHED_TYPE) for i in serves[name]))
    replaced = [name for name in used if name not in kept]
    if len(used) == 1:
        return used[0], (), unused
    if len(replaced) == 1:
        return replaced[0], kept, unused
    if not used:
        raise Refused("no-rope-layer", f"{len(real.calls)} attention calls, none rotated by {', '.join(serves)}")
    found = "; ".join(
        f"`{name}` rotates "
        + (", ".join(f"`{names[id(real.calls[i][0])]}` ({kinds[i] or 'type not stated'})" for i in calls) or "no layer")
        for name, calls in serves.items()
    )
    raise Refused(
        "several-rotary",
        f"{len(replaced)} of them rotate full-attention layers (or layers of no stated type), where the patch takes one "
        f"and keeps only modules of sliding-window layers: {found}",
    )


def _own_theta(rotary: nn.Module) -> float | None:
    """The base a rotary module, one of several, was built with from a config of its own."""
    rope = getattr(getattr(rotary, "config", None), "rope_parameters", None)
    return float(rope["rope_theta"]) if isinstance(rope, dict) and "rope_theta" in rope else None


def _unchanged(call, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether an identity-run attention call received the real run's queries and keys."""
    _, q_id, k_id = call
    return torch.equal(q_id, query) and torch.equal(k_id, key)
