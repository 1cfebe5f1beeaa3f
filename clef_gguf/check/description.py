"""What validate read from a complete Clef file: the runtime builds from it without parsing again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..format import contract as C
from ..format.header import GGUFFile, TensorInfo
from ..format.template import PromptTemplate


@dataclass(frozen=True)
class ClefDescription:
    path: Path
    name: str  # general.name, else the file's stem
    shape: C.BackboneShape
    head: C.HeadConfig
    template: PromptTemplate  # the systemone template, compiled once
    nfc: bool  # NFC-normalize prompts (Qwen's tokenizer.json does; llama.cpp's tokenizer does not)
    tensors: Mapping[str, TensorInfo]  # the header's tensor table, read-only
    temperatures: Mapping[str, float]  # the softmax temperatures by name (temperatures.temperature_of)


@dataclass(frozen=True)
class ValidatedFile:
    """A mapped Clef GGUF that a header-only validation judged complete, and its description."""

    file: GGUFFile
    description: ClefDescription

    def close(self) -> None:
        self.file.close()
