"""clef-gguf: Cloudflare's Clef decision models on stock llama.cpp.

import clef_gguf
model = clef_gguf.load("clef-flash-Q8_0.gguf")
model.decide({"model": "clef", "state": "...", "questions": {...}})
"""

from .conversion.convert import convert
from .errors import (
    ClefError,
    ConversionError,
    ModelClosedError,
    ModelFileError,
    PromptTooLongError,
    ReleaseError,
    RequestError,
)
from .runtime.model import ClefModel, load

__all__ = [
    "ClefError",
    "ClefModel",
    "ConversionError",
    "ModelClosedError",
    "ModelFileError",
    "PromptTooLongError",
    "ReleaseError",
    "RequestError",
    "convert",
    "load",
]
__version__ = "0.2.0"  # pyproject.toml's; tests/test_cli.py checks that they agree
