"""The models a base answers as, by name and by identity: the base itself and each of its adapters.

What a request's `model` (Workers AI's `lora`) resolves to needs only the base's file and the adapter files: their
names, their identities (what a prompt carries, EncodedPrompt.model) and their temperatures. A Catalog is that part
of runtime/adapters.py's Variants, which adds the loading (llama.cpp's LoRA, the head, the LRU). A PromptEncoder (the
Ray ingress) holds a Catalog of its own built from the same settings as the replicas' Variants, so that both give a
name the same identity and a replica decides what the ingress encoded.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..check.adapter import is_adapter
from ..check.adapter_pair import require_adapter
from ..check.description import ClefDescription
from ..check.metadata import check_temperatures
from ..check.validate import judge_source
from ..errors import IncompleteModelError, RequestError, SettingsError
from ..format.header import GGUFFile
from ..llama.plan import adapter_head_bytes, lora_bytes
from .prompt import Request

# Clef's public model names (System One's `model`, Workers AI's route): a request naming one is the base's.
BASE_NAMES = ("clef", "clef-flash")
ADAPTER_SUFFIX = ".adapter.gguf"  # an adapter folder's files: NAME.adapter.gguf answers as NAME
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@/-]{0,127}")


@dataclass(eq=False)
class Variant:
    """One model the loaded base answers as: the base itself (file None) or an adapter over it."""

    name: str
    identity: str  # what its prompts carry (EncodedPrompt.model)
    temperatures: Mapping[str, float]
    file: GGUFFile | None = None  # the adapter file, mapped while the variant is known
    nbytes: int = 0  # its LoRA's and its head's bytes, loaded
    lora: Any = None  # loaded: its LoRA in llama.cpp (llama.lora.Handle)
    head: Any = None  # loaded: its head (llama.native_head.NativeHead; the base's own for the base)


def _name_of_file(path: Path) -> str:
    """An adapter's name from its file: NAME.adapter.gguf (or NAME.gguf) answers as NAME."""
    return path.name.removesuffix(ADAPTER_SUFFIX).removesuffix(".gguf") or path.name


def adapter_identity(base_identity: str, adapter: GGUFFile) -> str:
    """A model made of a base and an adapter: both files' identities (GGUFFile.identity), hashed together."""
    return hashlib.sha256(f"{base_identity}+{adapter.identity()}".encode()).hexdigest()


def adapter_temperatures(path: str | Path) -> dict[str, float]:
    """An adapter file's own softmax temperatures (clef.decision.temperature.*: calibrate --adapter writes them)."""
    adapter = GGUFFile.open(path)
    try:
        problems, _, temperatures = check_temperatures(adapter.header)
    finally:
        adapter.close()
    if problems:
        raise IncompleteModelError(f"{path}: {problems[0].message}")
    return temperatures


def open_adapter(base: GGUFFile, path: Path) -> GGUFFile:
    """An adapter file, validated (as `clef-gguf validate` judges it) and checked against `base`, mapped."""
    report, header = judge_source(path)
    if not report.ok:
        report.raise_for_verdict()
    if header is None or not is_adapter(header):
        raise SettingsError(f"{path} is not an adapter file (clef-gguf convert CHECKPOINT --base RELEASE --adapter makes one)")
    adapter = GGUFFile.open(path)
    try:
        require_adapter(base, adapter.header, str(path))
    except BaseException:
        adapter.close()
        raise
    return adapter


def _adapter_bytes(base: GGUFFile, adapter: GGUFFile) -> int:
    """What loading an adapter costs (as `plan --adapter` counts it): its LoRA pairs, and a whole head (its tensors
    where it has them, else the base's, with the head's F32 transposed keys)."""
    return lora_bytes(adapter) + adapter_head_bytes(base, adapter)


class Catalog:
    """The base and its adapters, by name and by identity; thread-safe. Adapters are validated against the base
    when first named (the named ones at once: a bad file is refused at load, not on a request)."""

    def __init__(
        self,
        base: GGUFFile,
        description: ClefDescription,
        base_identity: str,
        *,
        adapters: Mapping[str, str | Path] | None = None,
        adapter: str | Path | None = None,
        adapter_dir: str | Path | None = None,
    ) -> None:
        self._base_file = base
        self.base = Variant(description.name, base_identity, description.temperatures)
        self._dir = Path(adapter_dir) if adapter_dir is not None else None
        if self._dir is not None and not self._dir.is_dir():
            raise SettingsError(f"the adapter folder {self._dir} does not exist")
        if adapter is not None and (adapters or adapter_dir is not None):
            raise SettingsError("adapter (one fine-tune answering every request) excludes adapters and adapter_dir")
        self._paths = {name: Path(path) for name, path in (adapters or {}).items()}
        if adapter is not None:
            self._paths[_name_of_file(Path(adapter))] = Path(adapter)
        for name in self._paths:
            self._check_name(name)
        self._known: dict[str, Variant] = {}  # by name: adapters validated (and mapped)
        self._by_identity: dict[str, Variant] = {base_identity: self.base}
        self._lock = threading.Lock()
        self.pinned: Variant | None = None
        try:
            for name in self._paths:
                self.resolve(name)
        except BaseException:
            Catalog.close(self)  # (the files mapped so far; nothing is loaded yet)
            raise
        # With `adapter`, every request is that fine-tune's, whatever model it names (decide/eval --adapter).
        self.pinned = self.resolve(next(iter(self._paths))) if adapter is not None else None

    @property
    def serves_adapters(self) -> bool:
        return bool(self._paths) or self._dir is not None

    def names(self) -> list[str]:
        """The adapters' names: the named ones and the adapter folder's files."""
        found = set(self._paths)
        if self._dir is not None:
            found |= {_name_of_file(p) for p in self._dir.glob(f"*{ADAPTER_SUFFIX}") if p.is_file()}
        return sorted(found)

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name or name in BASE_NAMES:
            raise SettingsError(f"an adapter's name is 1 to 128 letters, digits and ._@/- and not a base name, not {name!r}")

    def of_request(self, request: Request) -> Variant:
        """The model a parsed request names: Workers AI's `lora`, else System One's `model`."""
        return self.resolve(request.lora if request.lora is not None else request.model)

    def resolve(self, name: str | None) -> Variant:
        """The model a request names (None: the base). Without adapters every name is the base's, as before."""
        if self.pinned is not None:
            return self.pinned
        if name is None or not self.serves_adapters or name in (self.base.name, *BASE_NAMES):
            return self.base
        with self._lock:
            known = self._known.get(name)
            if known is not None:
                return known
            path = self._paths.get(name)
            if path is None and self._dir is not None and _NAME.fullmatch(name) and "/" not in name and ".." not in name:
                candidate = self._dir / f"{name}{ADAPTER_SUFFIX}"
                path = candidate if candidate.is_file() else None
            if path is None:
                served = ", ".join([self.base.name, *self.names()])
                raise RequestError(f"no model {name!r} here: this server answers as {served}", "model")
            variant = self._open(name, path)
            self._known[name] = variant
            self._by_identity[variant.identity] = variant
            return variant

    def _open(self, name: str, path: Path) -> Variant:
        """An adapter file checked against the base (check/adapter.py), its identity and temperatures read."""
        temperatures = adapter_temperatures(path)
        adapter = open_adapter(self._base_file, path)
        try:
            # An adapter without temperature keys of its own answers with its base's (calibrate writes its own).
            merged = temperatures or dict(self.base.temperatures)
            identity = adapter_identity(self.base.identity, adapter)
            return Variant(name, identity, merged, adapter, _adapter_bytes(self._base_file, adapter))
        except BaseException:
            adapter.close()
            raise

    def of(self, identity: str) -> Variant | None:
        with self._lock:
            return self._by_identity.get(identity)

    def close(self) -> None:
        """Unmap the adapters' files."""
        with self._lock:
            for variant in self._known.values():
                if variant.file is not None:
                    variant.file.close()
            self._known.clear()
