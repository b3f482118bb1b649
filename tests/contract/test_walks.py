"""Short walks: how many of rope-ext's files a call passes through. `patch()` enters no method module
it does not use and walks a few files in six steps (issue #52, item 3), and one decode step of a
method that rotates inside attention enters a few files and calls per layer (issue #39, item 4),
its first layer computing what the forward shares in one call (issue #52, item 4). The walk is
recorded with `sys.setprofile`; run this file as a script
to print the measures (`cd tests && PYTHONPATH=. ../.venv/bin/python contract/test_walks.py`).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch
from transformers import DynamicCache

import rope_ext
import rope_ext.evals
import rope_ext.patches
import rope_ext.rotation
from rope_ext.patches.base import FamilyAdapter

from helpers import WINDOW, random_ids, random_model

# The directories whose files are rope-ext's: the package and the two that install into it.
ROOTS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (rope_ext, rope_ext.patches, rope_ext.evals))


def ours(filename: str) -> str | None:
    """`filename` relative to rope-ext's roots (e.g. 'rope_ext/rotary.py'), or None outside them."""
    path = os.path.abspath(filename)
    for root in ROOTS:
        if path.startswith(root):
            return os.path.join(os.path.basename(root.rstrip(os.sep)), path[len(root) :])
    return None


class Walk:
    """The Python calls made inside a `with` block, in order: (file, function) of each call into
    rope-ext's files with the file it came from (None: from outside rope-ext), and the index of
    each decoder layer of `layers` as it is entered."""

    def __init__(self, layers=()):
        self.layers = {id(layer): i for i, layer in enumerate(layers)}
        self.events: list[tuple] = []  # ("call", file, function, caller's file) or ("layer", index)

    def _profile(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if self.layers and code.co_name == "forward":
            index = self.layers.get(id(frame.f_locals.get("self")))
            if index is not None:
                self.events.append(("layer" if event == "call" else "end", index))
                return
        if event == "return":
            return
        name = ours(code.co_filename)
        if name is not None:
            caller = frame.f_back and ours(frame.f_back.f_code.co_filename)
            self.events.append(("call", name, code.co_name, caller))

    def __enter__(self):
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._previous)

    def calls(self) -> list[tuple[str, str]]:
        return [event[1:3] for event in self.events if event[0] == "call"]

    def crossing(self) -> list[tuple[str, str, str]]:
        """(file, function, caller's file) of each call from one rope-ext file into another."""
        return [event[1:] for event in self.events if event[0] == "call" and event[3] not in (None, event[1])]

    def files(self) -> set[str]:
        return {file for file, _ in self.calls()}

    def by_layer(self) -> list[list[tuple[str, str]]]:
        """The calls outside the layers (before, between and after them), then those inside each layer."""
        parts: list[list] = [[]]
        inside = None
        for event in self.events:
            if event[0] == "layer":
                parts.append([])
                inside = parts[-1]
            elif event[0] == "end":
                inside = None
            else:
                (parts[0] if inside is None else inside).append(event[1:3])
        return parts


def patch_walk(method: str, **params) -> Walk:
    model = random_model()
    patch = rope_ext.patch  # imported before the walk: loading modules is no part of it
    with Walk() as walk:
        patch(model, method, original_window=WINDOW, **params)
    return walk


def decode_walk(method: str, prefill: int = 100, **params) -> Walk:
    """The walk of one decode step (one token, DynamicCache) after a prefill of `prefill` tokens, on
    the two-layer random LLaMA (its window 64 tokens: by default the step is past it)."""
    model = random_model()
    rope_ext.patch(model, method, original_window=WINDOW, **params)
    ids = random_ids(prefill + 1)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache, use_cache=True)
        with Walk(model.model.layers) as walk:
            model(ids[:, -1:], cache=cache, use_cache=True)
    return walk


def layer_files(walk: Walk) -> list[int]:
    """Distinct rope-ext files entered inside each layer."""
    return [len({file for file, _ in calls}) for calls in walk.by_layer()[1:]]


# The adapter modules patch() of the random LLaMA may enter: the probed decoder's and its probe (the
# contract, patches/base.py, holds no code a patch runs).
FAMILY_MODULES = {"patches/llama.py", "patches/probe.py"}
# The method modules each method's patch() may enter: its own, and what it builds on.
PATCH_MODULES = {
    "yarn": {"rope_ext/method/base.py", "rope_ext/method/stated.py", "rope_ext/method/rope.py"},
    "self_extend": {
        "rope_ext/method/base.py",
        "rope_ext/method/stated.py",
        "rope_ext/method/attention_side.py",
        "rope_ext/method/self_extend.py",
    },
    # dpe's group is chosen in attention_side, which it builds on as self_extend does
    "dpe": {
        "rope_ext/method/base.py",
        "rope_ext/method/stated.py",
        "rope_ext/method/attention_side.py",
        "rope_ext/method/dpe.py",
    },
}


@pytest.mark.parametrize("method", sorted(PATCH_MODULES))
def test_patch_enters_no_method_module_it_does_not_use(method):
    """patch(model, "yarn") on a LLaMA passes through yarn's module and what it builds on, and the
    adapter that claims the model: no other method's module, no other family's adapter (choosing the
    adapter asks each family whether the model is its own without entering its module)."""
    files = patch_walk(method, factor=4).files()
    methods = {f for f in files if f.startswith("rope_ext/method/") and not f.endswith("__init__.py")}
    families = {f for f in files if f.startswith("patches/") and not f.endswith("__init__.py")}
    assert methods <= PATCH_MODULES[method], sorted(methods - PATCH_MODULES[method])
    assert families <= FAMILY_MODULES, sorted(families - FAMILY_MODULES)


# patch() in six steps: check (rope_ext.method), read (the adapter, once: one value with what the
# model is), resolve (the method), refusal (rope_ext.method.base), build (the adapter's rotary module
# and the attention chain), install (the adapter, then the record). The files it may enter: the
# orchestration and the record (patching, record, shipped), the adapter (patches/__init__, llama,
# probe, and the rotation and attention the probe proves the model's by: rotation, attention/interface,
# attention/parts), the rotary module and its geometry (checked as the adapter reads it), and the
# method's modules (PATCH_MODULES) with method/__init__; an attention-side method also its
# transform's rotator (attention/rotator) and the chain install attaches (attention/interface), not
# the rotator's key store (attention/keys), which the first forward that keeps keys makes.
PATCH_FILES = {"yarn": 14, "self_extend": 16, "dpe": 16}
# What patch() may ask the adapter: each method of the contract.
ADAPTER_CALLS = {name for name, value in vars(FamilyAdapter).items() if callable(value) and not name.startswith("_")}


@pytest.mark.parametrize("method", sorted(PATCH_FILES))
def test_patch_walks_a_few_files_in_six_steps(method):
    """patch() asks the adapter once what the model is (read), then to build and to install: no
    question per fact, and no other call into an adapter from the orchestration."""
    walk = patch_walk(method, factor=4)
    assert len(walk.files()) <= PATCH_FILES[method], sorted(walk.files())
    assert "rope_ext/attention/keys.py" not in walk.files()
    asked = Counter(
        function for file, function, caller in walk.crossing() if caller == "rope_ext/patching.py" and file.startswith("patches/")
    )
    assert {function: n for function, n in asked.items() if function in ADAPTER_CALLS} == {"read": 1, "build": 1, "install": 1}


def test_the_family_contract_is_a_few_methods():
    """FamilyAdapter: where the rotary lives (site), what the model is (read), build, install,
    uninstall; what a site answers (config, installed, layer_types) is the site's."""
    assert FamilyAdapter.__abstractmethods__ == {"site", "read", "build", "install", "uninstall"}


# A decode step past the trained window of a method that rotates inside attention, in each layer:
# the attention interface, the rotator (attention/rotator.py), the transform's own module (an
# attention-side method's, or the dynamic methods' schedule), the rotation function (rotation.py)
# and, for the attention-side methods, the attention parts they merge (attention/parts.py). The
# first layer of a forward also computes what every layer shares (the frequencies, the method's
# schedule and positions, their cos/sin): (files of the first layer, files of every other layer,
# calls of every other layer) at most.
LAYER_FILES = {
    "self_extend": (7, 5, 31),
    "rerope": (7, 5, 31),
    "dca": (6, 5, 32),
    "dpe": (7, 5, 31),
    "sink_window": (6, 5, 28),
    "dynamic": (7, 4, 22),
}


@pytest.mark.parametrize("method", sorted(LAYER_FILES))
def test_a_decode_step_enters_a_few_files_per_layer(method):
    """The attention transform reads what a forward hands it (the rotator's frame, pending cache,
    kept keys and pairing) as values, not through calls into rotary.py, geometry.py or the kept
    keys' store (attention/keys.py) in every layer."""
    first, *others = decode_walk(method, factor=4).by_layer()[1:]
    bound_first, bound, calls = LAYER_FILES[method]
    assert len({f for f, _ in first}) <= bound_first, sorted({f for f, _ in first})
    for layer in others:
        files = {f for f, _ in layer}
        assert len(layer) <= calls, Counter(f for f, _ in layer)
        assert len(files) <= bound and not files & {"rope_ext/rotary.py", "rope_ext/geometry.py", "rope_ext/attention/keys.py"}, (
            sorted(files)
        )


@pytest.mark.parametrize("method", sorted(LAYER_FILES))
def test_the_first_layer_computes_what_the_forward_shares_in_one_call(method):
    """A decode step's later layers make the first layer's calls less one run: the call in which the
    first computes what every layer of the forward shares (the transform's `shared`: frequencies,
    the method's schedule and positions, the queries' and the new keys' cos/sin), which the others
    read as one value."""
    first, steady = decode_walk(method, factor=4).by_layer()[1:3]
    same = next(i for i, (a, b) in enumerate(zip(first, steady)) if a != b)
    run = len(first) - len(steady)
    assert first[:same] + first[same + run :] == steady
    assert "shared" in {function for _, function in first[same : same + 2]}, first[same : same + 2]


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(32, 32), (32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", ["leading", "trailing"])
def test_the_one_rotation_has_transformers_bits(layout, head_dim, rotary_dim, dtype, channels):
    """apply_rotary, now the one rotation (rotate_prepared) on unprepared (cos, sin), is
    transformers' x * cos + rotate_half(x) * sin bit for bit, in both layouts, both dtypes, on the
    leading or trailing channels."""
    from transformers.models.glm.modeling_glm import rotate_half as rotate_interleaved
    from transformers.models.llama.modeling_llama import rotate_half

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 7, head_dim, generator=generator) * 100).to(dtype)
    positions = torch.arange(7)[None].expand(2, -1) * 37.3
    cos, sin = rope_ext.rotation.cos_sin(torch.rand(rotary_dim // 2, generator=generator), 0.9, positions, dtype)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    turn = rotate_half
    if layout == "interleaved":
        c, s, turn = (
            c[..., : rotary_dim // 2].repeat_interleave(2, -1),
            s[..., : rotary_dim // 2].repeat_interleave(2, -1),
            rotate_interleaved,
        )
    split = head_dim - rotary_dim if channels == "trailing" else rotary_dim
    rotated, passed = (x[..., split:], x[..., :split]) if channels == "trailing" else (x[..., :split], x[..., split:])
    turned = rotated * c + turn(rotated) * s
    expected = torch.cat((passed, turned) if channels == "trailing" else (turned, passed), dim=-1)
    assert torch.equal(rope_ext.rotation.apply_rotary(x, cos, sin, layout, channels), expected)


def report() -> None:
    for method in ("yarn", "self_extend", "dpe"):
        walk = patch_walk(method, factor=4)
        crossing = walk.crossing()
        print(
            f"patch(model, {method!r}): {len(walk.files())} files, {len(walk.calls())} calls,"
            f" {len(crossing)} from one rope-ext file into another"
        )
        for file in sorted(walk.files()):
            print("   ", file, sorted({function for f, function, _ in crossing if f == file}))
    for method in sorted(LAYER_FILES):
        walk = decode_walk(method, factor=4)
        pre, *layers = walk.by_layer()
        print(
            f"decode step of {method}: {len(walk.files())} files, files per layer {layer_files(walk)},"
            f" calls per layer {[len(c) for c in layers]}, outside layers {len(pre)} calls in"
            f" {len({f for f, _ in pre})} files"
        )
        for file, n in sorted(Counter(f for f, _ in layers[1]).items()):
            print(f"    layer 1: {file}: {n} calls {sorted({fn for f, fn in layers[1] if f == file})}")
        for file, n in sorted(Counter(f for f, _ in layers[0]).items()):
            print(f"    layer 0: {file}: {n}")
        for file, n in sorted(Counter(f for f, _ in pre).items()):
            print(f"    outside: {file}: {n} {sorted({fn for f, fn in pre if f == file})}")


if __name__ == "__main__":
    report()
