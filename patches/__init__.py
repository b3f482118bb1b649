"""Model-family adapters. Each answers the same questions: is this model mine, where is its
rotary embedding and what is its geometry, and how do I swap the rotary module in and out.
Most models need no module of their own: the LLaMA adapter claims any transformers decoder whose
rotation patches.probe proves. A family it cannot prove is one new module here, added to ADAPTERS."""

from __future__ import annotations

from .chatglm import ChatGLMFamily
from .glm import GlmFamily
from .llama import LlamaFamily

# Named families first; the probed decoder adapter claims every other model, or refuses it with the reason.
ADAPTERS = [GlmFamily(), ChatGLMFamily(), LlamaFamily()]


def supported() -> list[str]:
    return [t for adapter in ADAPTERS for t in adapter.model_types]


def find_adapter(model):
    """The adapter for this model (also through a peft wrapper), or a ValueError naming what is supported."""
    for adapter in ADAPTERS:
        if adapter.matches(model):
            return adapter
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    raise ValueError(
        f"rope_ext cannot patch {type(model).__name__} (model_type={model_type!r}); "
        f"supported model types: {', '.join(supported())}"
    )
