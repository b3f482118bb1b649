"""What a forward of a method that rotates inside attention computes once and holds: cos/sin of the
positions once per forward, not once per layer, and, for the dynamic methods' causal schedule,
O(length) of them at any number of groups. Results stay those of the full forward
(test_dynamic_cache.py, test_attention_methods.py)."""

import copy
import gc
import sys
import weakref

import pytest
import torch
from transformers import DynamicCache

import rope_ext
import rope_ext.attention.rotator
import rope_ext.attention.schedule
import rope_ext.rotation

from helpers import assert_kept_keys_follow_the_cache, load_llama, random_ids, random_model


class CosSinCalls:
    """Counts the calls of rope_ext's cos_sin (in every rope_ext module that calls it) and keeps
    weak references to what they return, to tell what is still held."""

    def __init__(self, monkeypatch):
        self.calls, self.outputs, self.peak = 0, [], 0
        original = rope_ext.rotation.cos_sin

        def counted(*args, **kwargs):
            self.calls += 1
            result = original(*args, **kwargs)
            self.outputs += [weakref.ref(t) for t in result]
            self.peak = max(self.peak, self.held())
            return result

        for module in [m for name, m in sys.modules.items() if name.startswith("rope_ext")]:
            if getattr(module, "cos_sin", None) is original:
                monkeypatch.setattr(module, "cos_sin", counted)

    def held(self) -> int:
        """Elements of the cos/sin tensors still alive (`peak`: the most alive at once, as each
        call returned)."""
        return sum(t.numel() for t in (ref() for ref in self.outputs) if t is not None)


def decode_step_calls(model, ids, monkeypatch) -> int:
    """cos_sin calls of one decode step after a prefill of `ids`."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache, use_cache=True)
        counter = CosSinCalls(monkeypatch)
        model(ids[:, -1:], cache=cache, use_cache=True)
    monkeypatch.undo()
    return counter.calls


@pytest.mark.parametrize(
    "method, params",
    [
        ("self_extend", {"factor": 4}),
        ("rerope", {"factor": 4}),
        ("dca", {"factor": 4}),
        ("string", {"factor": 4, "local": 16}),
        ("sink_window", {"factor": 4}),
    ],
)
def test_a_decode_step_computes_cos_sin_once_not_per_layer(tiny_path, heldout_ids, monkeypatch, method, params):
    """A decode step past the window rotates the cache by the same distances in every layer: the
    4-layer tiny model computes as many cos/sin as its first layer alone."""
    ids = heldout_ids[None, :300]  # past the 128-token window
    calls = {}
    for layers in (1, 4):
        model = load_llama(tiny_path, num_hidden_layers=layers)
        rope_ext.patch(model, method, **params)
        calls[layers] = decode_step_calls(model, ids, monkeypatch)
    assert calls[4] == calls[1]


def prefill_calls(model, ids, monkeypatch) -> int:
    """cos_sin calls of one forward over `ids`."""
    counter = CosSinCalls(monkeypatch)
    with torch.no_grad():
        model(ids)
    monkeypatch.undo()
    return counter.calls


@pytest.mark.parametrize("method, params", [("dca", {"factor": 4}), ("dca", {"factor": 4, "temperature": True})])
def test_a_prefill_computes_cos_sin_once_not_per_layer(tiny_path, heldout_ids, monkeypatch, method, params):
    """A prefill past the window rotates every chunk's queries and keys by the same positions in
    every layer: the 4-layer tiny model computes as many cos/sin as its first layer alone."""
    ids = heldout_ids[None, :300]  # several chunks past the 128-token window
    calls = {}
    for layers in (1, 4):
        model = load_llama(tiny_path, num_hidden_layers=layers)
        rope_ext.patch(model, method, **params)
        calls[layers] = prefill_calls(model, ids, monkeypatch)
    assert calls[4] == calls[1]


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_causal_schedule_holds_cos_sin_of_a_few_groups(tiny_model, heldout_ids, monkeypatch, method, backend):
    """A prompt 96 tokens past the window at granularity 1 is 97 groups, each rotating its whole
    key prefix; the forward never holds one cos/sin set per group at once: on sdpa, whose groups go
    without masks, and on eager, which attends group by group and keeps HELD_GROUPS of them."""
    tiny_model.config._attn_implementation = backend
    rope_ext.patch(tiny_model, method, factor=4)
    window = tiny_model.config.max_position_embeddings
    length = window + 96
    counter = CosSinCalls(monkeypatch)
    with torch.no_grad():
        tiny_model(heldout_ids[None, :length])
    one_set = 2 * length * tiny_model.config.head_dim  # cos and sin of every key
    held = counter.peak / one_set
    # the most alive at once, not what outlives the forward (nothing does): 2.9 sets on eager, 7.5
    # on sdpa (its mask-free groups), where one set per group would be ~50
    assert held <= 8, held


class RotatedRows:
    """Counts the rows (tokens) rope_ext's attention rotates, queries and keys."""

    def __init__(self, monkeypatch):
        self.rows = 0
        for module in (rope_ext.attention.rotator, rope_ext.attention.schedule):
            original = module.rotate_prepared

            def counted(x, *args, original=original, **kwargs):
                self.rows += x.shape[-2]
                return original(x, *args, **kwargs)

            monkeypatch.setattr(module, "rotate_prepared", counted)


@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
@pytest.mark.parametrize("prefill, granularity", [(100, 1), (200, 8)])
def test_a_decode_step_rotates_only_its_new_keys_while_the_scaling_holds(
    tiny_model, heldout_ids, monkeypatch, method, prefill, granularity
):
    """Inside the trained window, and past it within one granularity step (the 128-token window +
    72 = 9 steps of 8: tokens 200-207 share a scaling), a dynamic method's angles do not change from
    step to step: a decode step rotates its query and its new key in each layer, not the whole
    cache again."""
    rope_ext.patch(tiny_model, method, factor=4, granularity=granularity)
    layers = tiny_model.config.num_hidden_layers
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        tiny_model(heldout_ids[None, :prefill], cache=cache, use_cache=True)
        tiny_model(heldout_ids[None, prefill : prefill + 1], cache=cache, use_cache=True)
        counter = RotatedRows(monkeypatch)
        tiny_model(heldout_ids[None, prefill + 1 : prefill + 2], cache=cache, use_cache=True)
    assert counter.rows == 2 * layers


@pytest.mark.parametrize("method", ["dynamic", "dynamic_yarn"])
def test_kept_rotated_keys_follow_crops_copies_reorders_and_repeats(tiny_model, heldout_ids, method):
    """The rotated keys kept between steps are those of the cache as it is: after a crop, a deepcopy,
    a beam reorder and a batch repeat, each next step equals the full forward of what the cache
    holds, inside the window and past it (where the schedule changes the angles)."""
    rope_ext.patch(tiny_model, method, factor=4)
    rows = torch.stack((heldout_ids[:200], heldout_ids[300:500]))
    for end in (90, 160):  # inside the 128-token window, and past it
        assert_kept_keys_follow_the_cache(tiny_model, rows, end)


@pytest.mark.parametrize("method", ["dynamic", "rerope"])
def test_a_dropped_cache_is_freed_at_once_and_a_copy_follows_its_own_rows(method):
    """The patch keeps each cache's key positions and hooks the cache's row operations on the
    cache object itself; nothing it adds there may reference the cache back, or each cache is a
    reference cycle whose keys wait for the cyclic collector (with it off here, they would never
    go). A deepcopy's hooks move the copy's rows, not the original's."""
    model = random_model()
    rope_ext.patch(model, method, factor=4)
    ids = torch.cat((random_ids(40), random_ids(40, seed=1)))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    rotary = model.model.rotary_emb
    assert isinstance(vars(cache)["reorder_cache"], rope_ext.rotary.FollowedOperation)

    copied = copy.deepcopy(cache)
    rotary.copy_positions(cache, copied, 40)
    first_keys = cache.layers[0].keys.clone()
    copied.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[0].keys, first_keys)
    assert torch.equal(copied.layers[0].keys, first_keys.flip(0))

    freed = [weakref.ref(cache), weakref.ref(copied)]
    gc.disable()
    try:
        del cache, copied
        assert [ref() for ref in freed] == [None, None]
    finally:
        gc.enable()


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(32, 32), (32, 16), (64, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", ["leading", "trailing"])
def test_the_prepared_rotation_is_apply_rotary_bit_for_bit(layout, head_dim, rotary_dim, dtype, channels):
    """rotate_prepared (what the kept keys and the queries of attention-side methods go through)
    rounds as apply_rotary, full and partial rotary (the leading channels, or MLA's trailing ones),
    in both layouts, at fractional positions; written into a strided view of a buffer (`out`, how a
    decode step's new keys reach the kept keys), the same bits, and nothing else in the buffer moves."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 7, head_dim, generator=generator) * 100).to(dtype)
    positions = torch.arange(7)[None].expand(2, -1) * 37.3
    cos, sin = rope_ext.rotation.cos_sin(torch.rand(rotary_dim // 2, generator=generator), 0.9, positions, dtype)
    prepared = rope_ext.rotation.prepared(cos, sin, layout)
    expected = rope_ext.rotation.apply_rotary(x, cos, sin, layout, channels)
    assert torch.equal(rope_ext.rotation.rotate_prepared(x, *prepared, layout, channels), expected)
    buffer = torch.full((2, 3, 12, head_dim), 7.0, dtype=dtype)
    written = rope_ext.rotation.rotate_prepared(x, *prepared, layout, channels, out=buffer.narrow(-2, 3, 7))
    assert torch.equal(written, expected) and torch.equal(buffer[:, :, 3:10], expected)
    assert bool((buffer[:, :, :3] == 7).all()) and bool((buffer[:, :, 10:] == 7).all())


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [False, True])
def test_the_cos_sin_of_several_position_maps_are_each_maps_own_bit_for_bit(layout, dtype, grouped):
    """Rotator.factors computes the (cos, sin) of all the position maps a step rotates to in one
    computation (a decode step's queries and new key at their own and distant positions): each
    map's bits are those it has computed alone, at integer and fractional positions, with an
    attention factor, for every count of positions (vectorized kernels take a tail of a row apart)."""
    rotator = rope_ext.attention.rotator.Rotator.__new__(rope_ext.attention.rotator.Rotator)
    rotator.layout = layout
    generator = torch.Generator().manual_seed(0)
    inv_freq = torch.rand(20, generator=generator)
    for count in (1, 2, 3, 7, 33):
        own = torch.arange(5000, 5000 + count)[None]
        maps = [own, own // 3 + 17, own.float() / 2.7]
        if grouped:  # the own positions as one group (dpe's), the others one per group
            maps = [own[..., None]] + [at[..., None] + torch.tensor([0.0, 0.5, 1.0, 1.5]) for at in maps[1:]]
        together = rotator.factors(maps, inv_freq, 0.9, dtype, grouped)
        for index, at in enumerate(maps):
            alone = rotator.factors([at], inv_freq, 0.9, dtype, grouped)
            assert all(torch.equal(t[:, :, index : index + 1], a) for t, a in zip(together, alone)), (count, index)
