"""rope-ext: extend the context window of a loaded HuggingFace model by swapping its position
handling for a context-extension method, reversibly.

    info = rope_ext.patch(model, method="yarn", factor=4)
    rope_ext.unpatch(model)

The names below load their module (and torch) on first use, so that `rope-ext --help` and
`rope-ext --version` start without them.
"""

import warnings
from importlib import import_module, metadata

__version__ = "0.1.0"

# The transformers versions rope-ext accepts (docs/compatibility.md: .ci/floors tests the floor);
# pyproject.toml pins the same range.
TRANSFORMERS = ">=5.24,<6"
NEWEST_TESTED = "5.25"  # the newest transformers minor release .ci/floors has passed on


def check_transformers(found: str) -> None:
    """ImportError, with the reason, unless transformers `found` is in the accepted range (a
    development build of a version in it counts); a warning for a release in it newer than any
    the suite has passed on."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if SpecifierSet(TRANSFORMERS).contains(found, prereleases=True):
        if Version(found).release[:2] > Version(NEWEST_TESTED).release[:2]:
            warnings.warn(
                f"rope-ext's suite has passed on transformers up to {NEWEST_TESTED}, not on {found}: "
                f"`.ci/floors transformers=={found}` in a checkout runs its cache and decode tests on it",
                stacklevel=2,
            )
        return
    if Version(found) < Version("5.24"):
        reason = (
            "before 5.24 transformers passes the KV cache as `past_key_values` and ignores the `cache` argument "
            "rope-ext passes, so chunked prefill and decoding would give wrong numbers without an error"
        )
    else:
        reason = "a major version rope-ext has not been tested with"
    raise ImportError(
        f"rope-ext is tested with transformers{TRANSFORMERS}, found transformers {found} ({reason}); "
        f"install one in range: pip install 'transformers{TRANSFORMERS}'"
    )


try:
    check_transformers(metadata.version("transformers"))
except metadata.PackageNotFoundError:
    pass  # rope-ext's modules that need transformers fail on their own import of it

# public name -> (module, attribute)
_API = {
    "PatchInfo": ("patching", "PatchInfo"),
    "describe": ("patching", "describe"),
    "lora_targets": ("patching", "lora_targets"),
    "methods": ("patching", "listing"),
    "patch": ("patching", "patch"),
    "patch_config": ("export.twin", "patch_config"),
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
