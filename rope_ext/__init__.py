"""rope-ext: extend the context window of a loaded HuggingFace model by swapping its rotary
position embedding for a scaled variant, reversibly.

    info = rope_ext.patch(model, method="yarn", factor=4)
    rope_ext.unpatch(model)
"""

from .chunked import chunked_forward, chunked_generate, chunked_nll
from .patching import PatchInfo, describe, lora_targets, patch, reapply, unpatch
from .patching import listing as methods
from .saving import from_pretrained, load_finetuned

__version__ = "0.1.0"

__all__ = [
    "PatchInfo", "chunked_forward", "chunked_generate", "chunked_nll", "describe", "from_pretrained", "load_finetuned",
    "lora_targets", "methods", "patch", "reapply", "unpatch",
]
