"""The hook into transformers' AttentionInterface: what family adapters use.

A registered name `rope_ext_<base>` (e.g. `rope_ext_sdpa`) wraps the model's chosen backend: each
attention module carries a `rope_ext_attention` callable, an `AttentionChain` of transforms that
each change (query, key, value, mask) and hand them on; the last one hands them to the backend.
The same mask function as the backend's is registered under the new name, so causal and padding
masks are built exactly as before.

A patch's chain, in order: the rotation inside attention (rope_ext.attention.schedule, or an
attention-side method's own transform), then what a method adds (`Method.attention`:
alibi_hybrid's bias, rope_ext.method.alibi_hybrid). The bias comes last because it is defined on
the queries and keys the backend finally sees.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

PREFIX = "rope_ext_"


class StaticCacheError(ValueError, RuntimeError):
    """A pre-allocated (static) KV cache reached a patch that needs each key's position: the
    cache hands attention its whole allocation, not the keys that were written."""


def passed_cache(kwargs: dict):
    """The KV cache a forward was called with. transformers 5.24 renamed the argument
    `past_key_values` to `cache`, and until 5.40 a decoder called directly with the old name sees it
    under that name (the rename happens inside its forward, after the hooks)."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


class BeforeDecoder:
    """The forward pre-hook an attention chain puts on the decoder: raises StaticCacheError on a
    static cache, and registers the rope-ext wrapper the config names where this process has not
    (a patched model that torch.load unpickled in a new process). An object, not a closure, so
    that a patched model pickles."""

    def __init__(self, method: str):
        self.method = method

    def __call__(self, module, args, kwargs):
        cache = passed_cache(kwargs)
        if getattr(cache, "is_compileable", False):
            raise StaticCacheError(
                f"{self.method}: pre-allocated (static) KV caches are not supported, because the patch needs each "
                "key's position; use the default DynamicCache"
            )
        name = module.config._attn_implementation
        if name.startswith(PREFIX) and name not in ALL_ATTENTION_FUNCTIONS:
            registered_name(base_name(name))


def backend(module: torch.nn.Module, name: str) -> Callable:
    """The attention function transformers would call for `name` on this module."""
    if name == "eager":
        # Each model file defines its own eager function; use the one of this module's model.
        return sys.modules[type(module).__module__].eager_attention_forward
    function = ALL_ATTENTION_FUNCTIONS[name]
    if is_flash_attention_requested(requested_attention_implementation=name):
        return lambda module, *args, **kwargs: function(FlashView(module, name), *args, **kwargs)
    return function


class FlashView:
    """An attention module as transformers' flash backends must see it. They pick the kernel to
    load from `module.config._attn_implementation`, which names the rope-ext wrapper while a patch
    is on (`rope_ext_flash_attention_2` is no kernel); the view shows a config naming the backend
    and passes every other attribute through."""

    def __init__(self, module: torch.nn.Module, name: str):
        self._module = module
        self.config = copy.copy(module.config)
        self.config._attn_implementation_internal = name

    def __getattr__(self, attribute: str):
        return getattr(self._module, attribute)


def registered_name(base: str) -> str:
    """Register (once) and return the rope-ext wrapper name for backend `base`."""
    if base.startswith(PREFIX):
        raise ValueError(f"attention backend {base!r} is already a rope-ext wrapper")
    if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"unknown attention implementation {base!r}")
    if base not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {base!r} has no mask function rope-ext can reuse")
    name = PREFIX + base

    def attention(module, query, key, value, attention_mask, **kwargs):
        return module.rope_ext_attention(module, query, key, value, attention_mask, backend(module, base), **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def base_name(name: str) -> str:
    return name.removeprefix(PREFIX)


class AttentionTransform:
    """One step of an AttentionChain: `__call__(module, query, key, value, attention_mask, attend,
    **kwargs)` returns what `attend` (the rest of the chain, then the backend) returns for the
    tensors it passes on. `attach`/`detach` add and remove what the step keeps on the model
    (hooks, parameters) when the patch is installed and removed. A transform with `rotates` set
    applies the rotary embedding itself and takes the place of RotateInAttention."""

    rotates = False

    def attach(self, site) -> None:
        pass

    def detach(self, site) -> None:
        pass


class AttentionChain:
    """What `module.rope_ext_attention` holds: transforms applied in order, each receiving the rest
    of the chain as its `attend`."""

    def __init__(self, transforms: list[AttentionTransform]):
        if not transforms:
            raise ValueError("an attention chain needs at least one transform")
        self.transforms = tuple(transforms)
        self._hooks: list = []
        self.method = None

    def attach(self, site, method: str) -> None:
        """Let each transform add what it keeps on the model. Every chain needs the positions of
        the cached keys, which a static cache does not give: such a cache is refused."""
        self.method = method
        for transform in self.transforms:
            transform.attach(site)
        self._hooks = [site.decoder.register_forward_pre_hook(BeforeDecoder(method), with_kwargs=True)]

    def detach(self, site) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for transform in self.transforms:
            transform.detach(site)

    def __call__(self, module, query, key, value, attention_mask, attend: Callable, **kwargs):
        """(output, weights): the weights where the backend gives them and the chain keeps one
        softmax per row; asked for (output_attentions) where it has none, a ValueError, since
        transformers would return an empty tuple without a word."""
        for transform in reversed(self.transforms):
            attend = _bind(transform, attend)
        out, weights = attend(module, query, key, value, attention_mask, **kwargs)
        asked = kwargs.get("output_attentions")
        if weights is None and (getattr(module.config, "output_attentions", False) if asked is None else asked):
            raise ValueError(
                f"output_attentions=True: {self.method} under rope-ext returns no attention weights here: methods that "
                "merge one softmax from several attention calls have none, and the others have them on the eager "
                "backend only (model.set_attn_implementation('eager')); call the model without output_attentions"
            )
        return out, weights


def _bind(transform: AttentionTransform, attend: Callable) -> Callable:
    def step(module, query, key, value, attention_mask, **kwargs):
        return transform(module, query, key, value, attention_mask, attend, **kwargs)

    return step
