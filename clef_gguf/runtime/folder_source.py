"""A folder of NAME.adapter.gguf files as an adapter source (--adapter-source DIR): runtime/sources.py's Source, read in
place (what --adapter-dir serves)."""

from __future__ import annotations

from pathlib import Path

from ..errors import SettingsError
from .adapter_files import ADAPTER_SUFFIX, servable
from .source_seam import Bounds, Delivered, Wanted


class FolderSource:
    """A folder of NAME.adapter.gguf files (what --adapter-dir serves), read in place."""

    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise SettingsError(f"the adapter source {folder} is not a folder (a folder, hf://ORG or hf://ORG/REPO)")
        self.folder, self.label, self.remote, self.metered = folder, str(folder), False, False

    def claims(self, name: str) -> Wanted | None:
        return Wanted(name, f"{self.folder}/{name}") if self.well_formed(name) else None

    def well_formed(self, name: str) -> bool:
        return servable(name) and "/" not in name

    def name_of(self, key: str) -> str | None:
        return None  # (its files are read in place, never kept in the disk cache)

    def local(self, wanted: Wanted) -> Path | None:
        return self.folder / f"{wanted.name}{ADAPTER_SUFFIX}"

    def fetch(self, wanted: Wanted, into: Path, bounds: Bounds) -> Delivered:  # pragma: no cover - local() answers
        raise AssertionError("a folder's files are read in place")
