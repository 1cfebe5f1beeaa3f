"""What a request's model name means, before any file is read (runtime/catalog.py's first part): one of the base's
names, an adapter the operator named (AdapterSet.adapters) or a file of the adapter folder (AdapterSet.adapter_dir),
or nothing here, refused with the near matches among the names served (adapter_files.unknown_name_message)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import RequestError, SettingsError
from ..inputs import file_kind
from ..settings import AdapterSet
from .adapter_files import ADAPTER_SUFFIX, FolderListing, servable, unknown_name_message
from .sources import AdapterSources

# Clef's public model names (System One's `model`, Workers AI's route): a request naming one is the base's.
BASE_NAMES = ("clef", "clef-flash")
JEV_ALIAS = "jev-latest"  # the SDKs' default model name (typesafe-sdk's): it means the loaded model, the base


def name_of_file(path: Path) -> str:
    """An adapter's name from its file: NAME.adapter.gguf (or NAME.gguf) answers as NAME."""
    return path.name.removesuffix(ADAPTER_SUFFIX).removesuffix(".gguf") or path.name


def adapter_folder(adapter_dir: str | Path | None) -> Path | None:
    """AdapterSet.adapter_dir, refused (SettingsError) unless it is a folder."""
    if adapter_dir is None:
        return None
    folder = Path(adapter_dir)
    try:
        mode = os.stat(folder).st_mode
    except OSError as e:
        raise SettingsError(f"the adapter folder {folder} cannot be used: {e.strerror or 'does not exist'}") from None
    if not stat.S_ISDIR(mode):
        kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
        raise SettingsError(f"the adapter folder {folder} is {kind}, not a folder")
    return folder


class Names:
    """The names a base answers to, and the file each adapter name stands for; thread-safe (the folder's listing
    has its own lock)."""

    def __init__(self, base_name: str, adapter_set: AdapterSet) -> None:
        self.base_name = base_name
        # Every name the base answers to, whatever adapters are served: no adapter may take one.
        self.base_names = frozenset((base_name, *BASE_NAMES, JEV_ALIAS))
        self.serves_adapters = adapter_set.serves_adapters  # (settings.AdapterSet's: a request may name a fine-tune)
        self.folder = adapter_folder(adapter_set.adapter_dir)
        self.named = {name: Path(path) for name, path in (adapter_set.adapters or {}).items()}
        for name in self.named:
            self._check(name)
        self._listing = FolderListing(self.folder, self.base_names) if self.folder is not None else None
        self.sources: AdapterSources | None = None  # (AdapterSet.adapter_sources: where any other name may come from)

    def _check(self, name: str) -> None:
        if not servable(name) or name in self.base_names:
            taken = ", ".join(sorted(self.base_names))
            rule = f"1 to 128 letters, digits and ._@/-, and none of the base's names ({taken})"
            raise SettingsError(f"an adapter's name is {rule}, not {name!r}")

    def is_base(self, name: str | None) -> bool:
        """Whether a request naming `name` (None: none) is the base's: without adapters served, every name is."""
        return name is None or not self.serves_adapters or name in self.base_names

    def source(self, name: str) -> Path:
        """The file an adapter name stands for (which may not exist); RequestError (a 422) for a name that names none."""
        path = self.named.get(name)
        if path is not None:
            return path
        if self.folder is not None and servable(name) and "/" not in name:
            return self.folder / f"{name}{ADAPTER_SUFFIX}"
        if self.sources is not None and servable(name) and name not in self.base_names:
            # (fetched, converted and checked on first use: FetchPending while it is, inside sources.not_waiting())
            found = self.sources.locate(name)
            if found is not None:
                return found
        raise self.unknown(name)

    def candidates(self) -> list[str]:
        """Every name a request may try besides the base's, sorted: the named adapters and the folder's files."""
        listed = self._listing.names() if self._listing is not None else []
        if self.sources is not None:  # (the names its sources delivered in this process)
            listed = sorted(set(listed) | set(self.sources.names()))
        return sorted(set(self.named) | set(listed)) if self.named else listed

    def unknown(self, name: str) -> RequestError:
        """The 422 for a name nothing here answers as, with the nearest names served."""
        return RequestError(unknown_name_message(name, self.base_name, self.candidates()), "model")
