"""rope-ext: extend the context window of a loaded HuggingFace model by swapping its position
handling for a context-extension method, reversibly.

    info = rope_ext.patch(model, method="yarn", factor=4)
    rope_ext.unpatch(model)

The names below load their module (and torch) on first use, so that `rope-ext --help` and
`rope-ext --version` start without them.
"""

from importlib import import_module

__version__ = "0.1.0"

# public name -> (module, attribute)
_API = {
    "PatchInfo": ("patching", "PatchInfo"),
    "describe": ("patching", "describe"),
    "lora_targets": ("patching", "lora_targets"),
    "methods": ("patching", "listing"),
    "patch": ("patching", "patch"),
    "reapply": ("patching", "reapply"),
    "unpatch": ("patching", "unpatch"),
    "from_pretrained": ("saving", "from_pretrained"),
    "load_finetuned": ("saving", "load_finetuned"),
    "check_adapter_base": ("saving", "check_adapter_base"),
    "chunked_forward": ("chunked", "chunked_forward"),
    "chunked_generate": ("chunked", "chunked_generate"),
    "copy_prefix": ("chunked", "copy_prefix"),
    "chunked_nll": ("chunked", "chunked_nll"),
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        module, attribute = _API[name]
        value = getattr(import_module(f".{module}", __name__), attribute)
        globals()[name] = value
        return value
    try:
        return import_module(f".{name}", __name__)
    except ModuleNotFoundError:
        raise AttributeError(f"module 'rope_ext' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
