"""Small random-weight models for tests that check plumbing and exactness (not quality), and the
checks and references that several test modules share."""

from __future__ import annotations

import copy
import functools
import math
import sys
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import rope_ext
from rope_ext import attention
from rope_ext.attention import AttentionChain, AttentionTransform

WINDOW = 64

# yarn's parameters as a patch at factor 4 with beta_fast=16 records them, as JSON: result files and
# records keep these bytes (tests/contract/test_patch.py, tests/method/test_method_check.py).
YARN_PARAMS = {
    "beta_fast": 16,
    "beta_slow": 1.0,
    "truncate": True,
    "attention_factor": None,
    "mscale": None,
    "mscale_all_dim": None,
}

# The methods whose keys are cached before rotation: attention rotates them at each forward.
DYNAMIC_METHODS = ["dynamic", "dynamic_yarn", "self_extend"]

SHAPES = {
    "llama": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
    "mistral": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, sliding_window=None),
    "mixtral": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_local_experts=2,
        num_experts_per_tok=1,
        head_dim=16,
    ),
    "qwen2": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
    "qwen3": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, head_dim=16),
}


def random_config(model_type: str = "llama", attn: str = "sdpa", rope_parameters: dict | None = None, **overrides):
    shape = {"max_position_embeddings": WINDOW, **SHAPES[model_type], **overrides}
    config = AutoConfig.for_model(
        model_type,
        num_hidden_layers=2,
        vocab_size=97,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        **shape,
    )
    config._attn_implementation = attn
    return config


def in_another_thread(call) -> Future:
    """call() run to its end in a new thread while this one waits (from a forward hook: inside this
    thread's forward, at a layer boundary): its Future, whose result() is call's or raises its error."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(call)


def random_ids(length: int, seed: int = 0) -> torch.LongTensor:
    """[1, length] token ids of the random models' vocabulary, seeded."""
    return torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(seed))


def random_model(model_type: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(random_config(model_type, attn, **overrides)).eval()


def glm_model():
    """A random GLM: interleaved pairs, half of each head's channels rotated (partial rotary)."""
    config = AutoConfig.for_model(
        "glm",
        num_hidden_layers=2,
        vocab_size=97,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=WINDOW,
        partial_rotary_factor=0.5,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def native_twin(model, rope_parameters: dict, max_position_embeddings: int | None = None):
    """A model with the same weights, built by transformers from a config carrying `rope_parameters`."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "rope_ext"):
        del config.rope_ext
    config.rope_parameters = rope_parameters
    config.max_position_embeddings = max_position_embeddings or config.max_position_embeddings
    config._attn_implementation = "sdpa"
    twin = AutoModelForCausalLM.from_config(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


@torch.no_grad()
def logits(model, ids):
    return model(ids).logits


def load_llama(path, **kwargs):
    """The checkpoint at `path` (the tiny model) in fp32 and eval mode, through plain transformers."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def greedy(model, prompt, new_tokens, **kwargs):
    return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)


def cli_error_line(argv, capsys) -> str:
    """The one error line of a command that must exit 2 (a usage error)."""
    from rope_ext import cli

    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


N_SEQUENCES = 16  # evenly spaced over the four held-out plays


def heldout_sequences(ids: torch.LongTensor, length: int, n: int = N_SEQUENCES) -> torch.LongTensor:
    """n evenly spaced slices of length+1 tokens: inputs and their next-token targets."""
    starts = torch.linspace(0, len(ids) - length - 1, n).long().tolist()
    return torch.stack([ids[s : s + length + 1] for s in starts])


@torch.no_grad()
def token_nll(model, sequences: torch.LongTensor) -> torch.Tensor:
    """Per-token next-token NLL, [n, length]."""
    logits = model(input_ids=sequences[:, :-1]).logits
    return F.cross_entropy(logits.transpose(1, 2), sequences[:, 1:], reduction="none")


def ppl(nll: torch.Tensor) -> float:
    return math.exp(nll.mean().item())


@torch.no_grad()
def ppl_past_window(path, passages: torch.LongTensor, method: str, window: int = 128, **params) -> float:
    """Perplexity over the positions past `window` of each passage [n, T + 1], the mean of the
    passages' mean NLL, for the checkpoint at `path` unpatched ("plain") or with `method` x4 and
    `params`."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    if method != "plain":
        rope_ext.patch(model, method, factor=4, **params)
    nll = [F.cross_entropy(model(row[None, :-1]).logits[0, window:], row[window + 1 :]) for row in passages]
    return math.exp(torch.stack(nll).mean().item())


@torch.no_grad()
def cached_logits(model, ids: torch.LongTensor, step: int, prefill: int = 0) -> torch.Tensor:
    """Logits of ids[:, prefill:] fed `step` tokens per forward through one DynamicCache, after one
    forward of ids[:, :prefill]: chunked prefill, or with step 1 token-by-token decoding."""
    cache = DynamicCache(config=model.config)
    if prefill:
        model(ids[:, :prefill], cache=cache, use_cache=True)
    return torch.cat([model(chunk, cache=cache, use_cache=True).logits for chunk in ids[:, prefill:].split(step, dim=1)], dim=1)


def assert_refused_unchanged(method: str, kwargs: dict, message: str, model=None) -> None:
    """rope_ext.patch(model, method, **kwargs) raises a ValueError matching `message` and leaves the
    model's logits and patch state as they were; `model` defaults to a fresh random one."""
    import pytest

    model = random_model() if model is None else model
    x = random_ids(2 * WINDOW)
    with torch.no_grad():
        before = model(x).logits
    with pytest.raises(ValueError, match=message):
        rope_ext.patch(model, method, **kwargs)
    assert rope_ext.describe(model) is None
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


def assert_refuses_other_backends(method: str) -> None:
    """`method` refuses a backend other than eager/sdpa at patch time, naming itself and the backend."""
    import pytest

    model = random_model()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=f"{method} runs on the eager or sdpa attention backend, not 'flex_attention'"):
        rope_ext.patch(model, method, factor=4)


def assert_refuses_padded_batches(method: str) -> None:
    """`method`, patched, refuses a padded batch when run."""
    import pytest

    model = random_model()
    rope_ext.patch(model, method, factor=4)
    x = random_ids(2 * WINDOW).expand(2, -1)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    with pytest.raises(ValueError, match="unpadded"), torch.no_grad():
        model(x, attention_mask=mask)


def assert_saves_reloads_and_unpatches(model, method: str, params: dict, ids: torch.LongTensor, path) -> None:
    """Patched with `method` and `params`, `model` saves to `path` with a warning that plain
    transformers loads the unpatched model; rope_ext.from_pretrained gives back the patch (its
    record, every parameter given, the logits bit for bit), plain transformers the unpatched model,
    and unpatch restores the model, its config and its attention modules exactly."""
    import pytest

    with torch.no_grad():
        plain = model(ids).logits
        config = copy.deepcopy(model.config.to_dict())
        rope_ext.patch(model, method, **params)
        patched = model(ids).logits
        with pytest.warns(UserWarning, match=f"'{method}' patch .* load it with rope_ext.from_pretrained"):
            model.save_pretrained(path)
        reloaded = rope_ext.from_pretrained(path, dtype=torch.float32).eval()
        assert rope_ext.describe(reloaded) == rope_ext.describe(model)
        stored = rope_ext.describe(reloaded)["params"]
        for name, value in params.items():
            if name != "factor" and value != "auto":  # "auto" is resolved to a value when patching
                assert stored[name] == value and type(stored[name]) is type(value), (name, stored[name])
        assert torch.equal(reloaded(ids).logits, patched)
        plain_reload = type(model).from_pretrained(path, dtype=torch.float32).eval()
        assert torch.equal(plain_reload(ids).logits, plain)  # transformers alone: the unpatched model
        rope_ext.unpatch(model)
        assert torch.equal(model(ids).logits, plain)
    assert rope_ext.describe(model) is None
    assert model.config.to_dict() == config
    assert not any(hasattr(layer.self_attn, "rope_ext_attention") for layer in model.model.layers)
    assert method in rope_ext.methods()


# References and probes inside attention: rope_ext.attention's transforms.


def left_padded(ids: torch.LongTensor, pad: int) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
    """(batch, attention_mask, position_ids) of two rows: `ids` [1, S], and `pad` pad tokens followed
    by `ids` without its first `pad` tokens, from position 0."""
    batch = torch.cat((ids, torch.cat((torch.zeros(1, pad, dtype=ids.dtype), ids[:, pad:]), dim=1)))
    padding = torch.ones_like(batch)
    padding[1, :pad] = 0
    return batch, padding, (padding.cumsum(-1) - 1).clamp(min=0)


def rotate(x, positions, base, dim):
    """x [B, H, S, dim] rotated to `positions` [S], pairs (i, i + dim/2): written out independently."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def set_chain(model, transforms):
    """Every layer's attention runs through `transforms` in place of the patch's own."""
    chain = AttentionChain(transforms)
    for layer in model.model.layers:
        layer.self_attn.rope_ext_attention = chain


class CountCalls(AttentionTransform):
    """Passes everything on, counting the calls that reach the backend."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        self.calls += 1
        return attend(module, query, key, value, attention_mask, **kwargs)


def count_lse_calls(monkeypatch) -> dict:
    """Counts the calls of rope_ext.attention.attend_with_lse, in {"calls": n}, under every name a
    loaded rope_ext module imported it as (the methods import it into their own namespace)."""
    counted = {"calls": 0}
    original = attention.attend_with_lse

    def counting(*args, **kwargs):
        counted["calls"] += 1
        return original(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("rope_ext") and getattr(module, "attend_with_lse", None) is original:
            monkeypatch.setattr(module, "attend_with_lse", counting)
    return counted


# the parameters a method requires beside its defaults, for a model that rotates `pairs` pairs;
# longrope's sets differ from each other and from pair to pair, so that a wrong set shows
REQUIRED = {
    "ntk_alpha": lambda pairs: {"alpha": 8.0},
    "longrope": lambda pairs: {
        "long_factor": torch.linspace(1.0, 8.0, pairs).tolist(),
        "short_factor": torch.linspace(1.0, 1.3, pairs).tolist(),
    },
}


def required_params(name: str, pairs: int) -> dict:
    """What `patch(model, name)` needs beside the defaults, for a model rotating `pairs` pairs."""
    return REQUIRED[name](pairs) if name in REQUIRED else {}


def patch_params(name: str, model) -> dict:
    """required_params for `model`, its rotated pairs read off its rotary module's frequencies."""
    pairs = next(buffer.numel() for key, buffer in model.named_buffers() if key.endswith("rotary_emb.inv_freq"))
    return required_params(name, pairs)


def registered(where=lambda method: True) -> list[str]:
    """The registered methods for which `where(method)` holds, in the registry's order. A family test
    parametrizes over these, filtered by what a method declares (its rotation, `requires`: what it
    needs of a model), so a new method is tested wherever its declarations let it run."""
    from rope_ext.method import REGISTRY

    return [name for name, method in REGISTRY.items() if where(method)]


def frequency_scaling(method) -> bool:
    """The method changes the rotary frequencies alone (static, or following the length)."""
    return not method.needs_attention_interface


def takes_a_factor_alone(method) -> bool:
    """The method needs no parameter beside the factor (not ntk_alpha's alpha, longrope's lists)."""
    return not any(spec.required for spec in method.specs.values())


def rotates_inside_attention(method) -> bool:
    return method.requires.rotation_in_attention


def computes_attention(method) -> bool:
    return method.requires.own_attention


@functools.cache
def leaves_the_trained_window(name: str) -> bool:
    """Whether `name` at factor 4 leaves the logits of a random LLaMA's trained window as they were,
    bit for bit: what a family test then expects of it on that family too (string, which moves
    distances past a shift inside the window, and longrope, whose short factors rescale it, do not)."""
    model = random_model()
    x = random_ids(WINDOW)
    before = logits(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the window taken from the config alone, as every random model's
        rope_ext.patch(model, name, factor=4, **patch_params(name, model))
    return torch.equal(logits(model, x), before)


def glm(rope_parameters: dict, max_positions: int = 256):
    """A tiny GLM, which rotates half of each head, with these rope_parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "glm",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        rope_parameters={**rope_parameters, "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        pad_token_id=0,
        eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def linear_glm(max_positions: int = 256):
    """A converted ChatGLM2-6B-32K: a GLM whose checkpoint divides its positions by 4 (docs/chatglm.md)."""
    return glm({"rope_type": "linear", "factor": 4.0}, max_positions)


@functools.cache
def takes_a_partial_rotation(name: str) -> bool:
    """Whether `name` patches a model that rotates part of each head (a GLM): a family test expects
    one that does not (proportional, which chooses which pairs of a whole head turn) to refuse such
    a family too, naming itself."""
    model = glm({"rope_type": "default"})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the window taken from the config alone
            rope_ext.patch(model, name, factor=4, **patch_params(name, model))
    except ValueError:
        return False
    return True


def decode_logits(model, cache, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits[:, -1]


def full_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[:, -1]


def assert_kept_keys_follow_the_cache(model, rows: torch.Tensor, end: int) -> None:
    """Decoding two sequences (`rows`) up to `end` through a DynamicCache changed between steps
    (a crop, a deepcopy of the cache, beams swapped, then repeated), and through a deepcopy of
    the model while the original's store holds that cache's keys, each step
    equals the full forward of what the cache holds. A step that served the rotated keys of the
    cache as it was would not: the swap keeps the cache's length and shape."""
    rotary = model.model.rotary_emb
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(rows[:, : end - 2], cache=cache, use_cache=True)
    decode_logits(model, cache, rows[:, end - 2 : end - 1])
    decode_logits(model, cache, rows[:, end - 1 : end])
    cache.crop(-2)  # the last two keys go: the next step is position end - 2 again
    step = decode_logits(model, cache, rows[:, end - 2 : end - 1])
    torch.testing.assert_close(step, full_logits(model, rows[:, : end - 1]), rtol=0, atol=1e-4)

    copied = copy.deepcopy(cache)
    rotary.copy_positions(cache, copied, end - 1)
    step = decode_logits(model, copied, rows[:, end - 1 : end])
    torch.testing.assert_close(step, full_logits(model, rows[:, :end]), rtol=0, atol=1e-4)

    twin = copy.deepcopy(model)  # a copy of the model, its store empty, decodes on a cache of its own
    twin_cache = DynamicCache(config=model.config)
    decode_logits(twin, twin_cache, rows[:, : end - 1])
    step = decode_logits(twin, twin_cache, rows[:, end - 1 : end])
    torch.testing.assert_close(step, full_logits(model, rows[:, :end]), rtol=0, atol=1e-4)

    cache.reorder_cache(torch.tensor([1, 0]))  # beams swap: row 0 now holds the second sequence
    swapped = rows.flip(0)
    step = decode_logits(model, cache, swapped[:, end - 1 : end])
    torch.testing.assert_close(step, full_logits(model, swapped[:, :end]), rtol=0, atol=1e-4)

    cache.batch_repeat_interleave(2)  # the key positions follow the cache's own operation
    repeated = swapped.repeat_interleave(2, dim=0)
    step = decode_logits(model, cache, repeated[:, end : end + 1])
    torch.testing.assert_close(step, full_logits(model, repeated[:, : end + 1]), rtol=0, atol=1e-4)
