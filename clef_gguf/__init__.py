"""clef-gguf: Cloudflare's Clef decision models on stock llama.cpp.

import clef_gguf
model = clef_gguf.load("clef-flash-Q8_0.gguf")
model.decide({"model": "clef", "state": "...", "questions": {...}})
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    BackendUnavailableError,
    ClefError,
    ConversionError,
    ModelClosedError,
    ModelFileError,
    OutputError,
    PromptTooLongError,
    ReleaseError,
    RequestError,
)
from .settings import AdapterSet, LoadOptions, ModelSpec  # a model declared once: ClefModel(spec), as load() builds it

if TYPE_CHECKING:
    from .conversion.convert import convert
    from .runtime.model import ClefModel, load

# Loaded on first use: they load llama-cpp-python's libraries, which a build may fail to do on this machine (a CUDA
# build without NVIDIA's driver). `import clef_gguf` then still works, and the first use raises BackendUnavailableError.
_LAZY = {"convert": ".conversion.convert", "ClefModel": ".runtime.model", "load": ".runtime.model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'clef_gguf' has no attribute {name!r}")


__all__ = [
    "AdapterSet",
    "BackendUnavailableError",
    "ClefError",
    "ClefModel",
    "ConversionError",
    "LoadOptions",
    "ModelClosedError",
    "ModelFileError",
    "ModelSpec",
    "OutputError",
    "PromptTooLongError",
    "ReleaseError",
    "RequestError",
    "convert",
    "load",
]
__version__ = "0.2.0"  # pyproject.toml's; tests/test_cli.py checks that they agree
