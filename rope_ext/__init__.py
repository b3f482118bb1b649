"""rope-ext: extend the context window of a loaded HuggingFace model by swapping its rotary
position embedding for a scaled variant, reversibly.

    info = rope_ext.patch(model, method="yarn", factor=4)
    rope_ext.unpatch(model)
"""

from .chunked import chunked_forward, chunked_generate, chunked_nll
from .lora import load_finetuned
from .patching import PatchInfo, describe, from_pretrained, method_specs, patch, unpatch

__version__ = "0.1.0"


def methods() -> dict[str, dict]:
    """Every method with its summary, formula, parameters (with defaults) and whether it is dynamic."""
    return {
        name: {"summary": m.summary, "formula": m.formula, "params": {"factor": None, **m.all_params}, "dynamic": m.dynamic}
        for name, m in method_specs().items()
    }


__all__ = [
    "PatchInfo", "chunked_forward", "chunked_generate", "chunked_nll", "describe", "from_pretrained", "load_finetuned", "methods", "patch",
    "unpatch",
]
