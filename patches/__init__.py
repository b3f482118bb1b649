"""Model-family adapters. Each answers the same questions: is this model mine, what is it (its
rotary embedding, geometry, shipped scaling and what the probe proved, read in one call), and
how do I swap the rotary module in and out. Most models need no module of their own: the LLaMA
adapter claims any transformers decoder whose rotation patches.probe proves. A family it cannot
prove is one new module here, added to NAMED."""

from __future__ import annotations

from torch import nn

from .chatglm import ChatGLMFamily
from .glm import GlmFamily
from .llama import LlamaFamily

# The named families claim their model types; the probed decoder adapter claims every other model,
# or refuses it with the reason.
NAMED = [GlmFamily(), ChatGLMFamily()]
PROBED = LlamaFamily()
ADAPTERS = [*NAMED, PROBED]


def supported() -> list[str]:
    return [t for adapter in ADAPTERS for t in adapter.model_types]


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under torch.compile's wrapper and a peft wrapper (or the model itself):
    the patch goes to the model the wrappers call."""
    model = getattr(model, "_orig_mod", model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def find_adapter(model: nn.Module):
    """(the adapter for this model, the transformers model under its wrappers), chosen by the
    model type alone (no adapter's code runs), or a ValueError naming what is supported."""
    hf_model = unwrap(model)
    config = getattr(hf_model, "config", None)
    if config is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(
            f"rope_ext cannot patch {type(model).__name__} (model_type={model_type!r}); "
            f"supported model types: {', '.join(supported())}"
        )
    model_type = getattr(config, "model_type", None)
    return next((adapter for adapter in NAMED if model_type in adapter.model_types), PROBED), hf_model
