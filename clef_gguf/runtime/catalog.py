"""The models a base answers as, by name and by identity: the base itself and each version of its adapters.

What a request's `model` (Workers AI's `lora`) resolves to needs only the base's file and the adapter files: their
names, their identities (what a prompt carries, EncodedPrompt.model) and their temperatures. A Catalog is that part
of runtime/adapters.py's Variants, which adds the loading (llama.cpp's LoRA, the head, the LRU). A PromptEncoder (the
Ray ingress) holds a Catalog of its own built from the same settings as the replicas' Variants, so that both give a
name the same identity and a replica decides what the ingress encoded.

An adapter file's version (runtime/adapter_files.py) is read once into a private copy, validated, and named by the
identity of those bytes. Each resolve stats the file (no lock held): a file changed since is a new version, read and
validated again, with a new identity, so that no state cached for the old one serves it; prompts encoded for the old
version are answered by it while it is loaded, else refused (AdapterUnavailableError). Reading and validating happen
outside the catalog's lock, once per name at a time: the base and the other names never wait on a file.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..check.description import ClefDescription
from ..check.metadata import check_temperatures
from ..errors import AdapterUnavailableError, ClefError, CorruptModelError, IncompleteModelError, RequestError, SettingsError
from ..format.header import GGUFFile, Signature, signature_of
from ..inputs import file_kind
from .adapter_files import ADAPTER_SUFFIX, AdapterCopy, FolderListing, PrivateFolder, Version, read_version, servable
from .adapter_files import unknown_name_message as _unknown_message
from .prompt import EncodedPrompt, Request

# Clef's public model names (System One's `model`, Workers AI's route): a request naming one is the base's.
BASE_NAMES = ("clef", "clef-flash")
JEV_ALIAS = "jev-latest"  # the SDKs' default model name (typesafe-sdk's): it means the loaded model, the base
RETIRED_KEPT = 64  # replaced versions a prompt encoded before the change may still name (a busy folder churns)
REFUSED_KEPT = 1 << 16  # folder files known not to load, by name, until they change


@dataclass(eq=False)
class Variant:
    """One model the loaded base answers as: the base itself (source None) or one version of an adapter over it."""

    name: str
    identity: str  # what its prompts carry (EncodedPrompt.model)
    temperatures: Mapping[str, float]
    source: Path | None = None  # the adapter file as named (read again, and checked, when it is loaded again)
    signature: Signature | None = None  # that file's (st_dev, st_ino, st_size, st_mtime_ns) when this version was read
    copy: AdapterCopy | None = None  # this version's bytes, private: while it is read, or loaded
    nbytes: int = 0  # its LoRA's and its head's bytes, loaded
    lora: Any = None  # loaded: its LoRA in llama.cpp (llama.lora.Handle)
    head: Any = None  # loaded: its head (llama.native_head.NativeHead; the base's own for the base)
    current: bool = True  # False once its name's file is another version: then it is never loaded again

    @property
    def file(self) -> GGUFFile | None:
        """The private copy, mapped (while loaded)."""
        return self.copy.file if self.copy is not None else None


def _name_of_file(path: Path) -> str:
    """An adapter's name from its file: NAME.adapter.gguf (or NAME.gguf) answers as NAME."""
    return path.name.removesuffix(ADAPTER_SUFFIX).removesuffix(".gguf") or path.name


def adapter_temperatures(path: str | Path) -> dict[str, float]:
    """An adapter file's own softmax temperatures (clef.decision.temperature.*: calibrate --adapter writes them)."""
    adapter = GGUFFile.read(path)  # (read, not mapped: the file may change while a command runs)
    try:
        problems, _, temperatures = check_temperatures(adapter.header)
    finally:
        adapter.close()
    if problems:
        raise IncompleteModelError(f"{path}: {problems[0].message}")
    return temperatures


def adapter_file_identity(base: GGUFFile, base_identity: str, path: Path, base_head: bool = False) -> str:
    """What `base` with the adapter file at `path` answers as (ClefModel's identity with adapter=path): the file
    read once, validated against the base as loading validates it. OSError when it cannot be read."""
    into = PrivateFolder()
    try:
        version = read_version(base, base_identity, path, into, base_head=base_head)
        version.copy.close()
        return version.identity
    finally:
        into.close()


def _adapter_folder(adapter_dir: str | Path | None) -> Path | None:
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


class Catalog:
    """The base and its adapters, by name and by identity; thread-safe. The named adapters are validated against the
    base at once (a bad file is refused at load, not on a request); a folder's files when first named."""

    def __init__(
        self,
        base: GGUFFile,
        description: ClefDescription,
        base_identity: str,
        *,
        adapters: Mapping[str, str | Path] | None = None,
        adapter: str | Path | None = None,
        adapter_dir: str | Path | None = None,
        base_head: bool = False,
    ) -> None:
        self._base_file, self.base_head = base, base_head
        self.base = Variant(description.name, base_identity, description.temperatures)
        # Every name the base answers to, whatever adapters are served: no adapter may take one.
        self.base_names = frozenset((description.name, *BASE_NAMES, JEV_ALIAS))
        if adapter is not None and (adapters or adapter_dir is not None):
            raise SettingsError("adapter (one fine-tune answering every request) excludes adapters and adapter_dir")
        self._dir = _adapter_folder(adapter_dir)
        self._paths = {name: Path(path) for name, path in (adapters or {}).items()}
        for name in self._paths:
            self._check_name(name)
        if adapter is not None:  # (its name is only what answers say: a request cannot pick another)
            self._paths[_name_of_file(Path(adapter))] = Path(adapter)
        self._listing = FolderListing(self._dir, self.base_names) if self._dir is not None else None
        self._private = PrivateFolder()
        self._lock = threading.Lock()  # guards the dicts below, and never is held across I/O
        self._known: dict[str, tuple[Signature, Variant]] = {}  # by name: the file's version last read, and its variant
        self._by_identity: dict[str, Variant] = {base_identity: self.base}
        self._retired: deque[Variant] = deque()  # versions replaced since, newest last
        self._reading: dict[str, Future[Variant]] = {}  # by name: the read in progress (one per name)
        self._refused: dict[str, tuple[Signature, type[ClefError], str]] = {}  # by name: files that do not load
        self.pinned: Variant | None = None
        try:
            for name, path in self._paths.items():
                try:
                    self._read(name, path, None, str(path))
                except OSError as e:  # (at load: the path is the operator's own, so the message names it)
                    raise CorruptModelError(f"{path}: cannot read ({e.strerror or e})") from None
        except BaseException:
            Catalog.close(self)
            raise
        # With `adapter`, every request is that fine-tune's, whatever model it names (decide/eval --adapter).
        self.pinned = self._known[next(iter(self._paths))][1] if adapter is not None else None

    @property
    def serves_adapters(self) -> bool:
        return bool(self._paths) or self._dir is not None

    def _check_name(self, name: str) -> None:
        if not servable(name) or name in self.base_names:
            taken = ", ".join(sorted(self.base_names))
            rule = f"1 to 128 letters, digits and ._@/-, and none of the base's names ({taken})"
            raise SettingsError(f"an adapter's name is {rule}, not {name!r}")

    def _candidates(self) -> list[str]:
        """Every name a request may try besides the base's, sorted: the named adapters and the folder's files."""
        listed = self._listing.names() if self._listing is not None else []
        return sorted(set(self._paths) | set(listed)) if self._paths else listed

    def names(self) -> list[str]:
        """The adapters' names that load (what /v1/models lists): the named ones, and the adapter folder's files that
        validate against the base (each read once per version of its file: cached by its signature)."""
        if self.pinned is not None:
            return [self.pinned.name]
        found = []
        for name in self._candidates():
            try:
                self.resolve(name)
            except ClefError:
                continue
            found.append(name)
        return found

    def of_request(self, request: Request) -> Variant:
        """The model a parsed request names: Workers AI's `lora`, else System One's `model`."""
        return self.resolve(request.named)

    def name_of(self, prompt: EncodedPrompt) -> str | None:
        """The name a prompt's answer and the metrics give its model (None: an identity this catalog does not know):
        an adapter's name the request asked for (one file may answer to two names), else the variant's own (the base's
        whatever name reached it; a pinned adapter's whatever the request named)."""
        variant = self.of(prompt.model)
        if variant is None:
            return None
        asked = prompt.request.named
        return asked if variant is not self.base and self.pinned is None and isinstance(asked, str) else variant.name

    def resolve(self, name: str | None) -> Variant:
        """The model a request names (None: the base), its file's current version. Without adapters every name is the
        base's, as before. RequestError (a 422) for a name nothing answers as or a file that never loads;
        AdapterUnavailableError (a 503) for an adapter whose file is gone or broken now."""
        if self.pinned is not None:
            return self.pinned
        if name is None or not self.serves_adapters or name in self.base_names:
            return self.base
        source = self._source_of(name)
        try:
            st = os.stat(source)
        except OSError as e:
            raise self._missing(name, source, e) from None
        found = signature_of(st)
        with self._lock:
            known, refused = self._known.get(name), self._refused.get(name)
        if known is not None and known[0] == found:
            return known[1]
        if refused is not None and refused[0] == found:
            raise refused[1](refused[2], "model") if issubclass(refused[1], RequestError) else refused[1](refused[2])
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:  # refused at once: never opened
            reason = "is empty" if stat.S_ISREG(st.st_mode) else f"is {file_kind(st.st_mode)}, not a regular file"
            raise self._refuse(name, source, found, known, f"{source.name} {reason}")
        return self._read_once(name, source, found, known)

    def _source_of(self, name: str) -> Path:
        path = self._paths.get(name)
        if path is not None:
            return path
        if self._dir is not None and servable(name) and "/" not in name:
            return self._dir / f"{name}{ADAPTER_SUFFIX}"
        raise RequestError(self._unknown(name), "model")

    def _unknown(self, name: str) -> str:
        return _unknown_message(name, self.base.name, self._candidates())

    def _missing(self, name: str, source: Path, e: OSError) -> ClefError:
        """A name whose file cannot be stat'ed: an adapter served before is unavailable, any other name unknown."""
        with self._lock:
            known = name in self._known
        if not known and name not in self._paths and isinstance(e, FileNotFoundError | NotADirectoryError):
            return RequestError(self._unknown(name), "model")
        why = "is gone" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror})"
        return AdapterUnavailableError(f"the adapter {name!r} cannot be used now: its file {source.name} {why}")

    def _refuse(self, name: str, source: Path, found: Signature, known: tuple[Signature, Variant] | None, why: str) -> ClefError:
        """A file that does not load: remembered until it changes. For an adapter that loaded before (or a named one)
        a 503, for it may be a file being replaced; else a 422 naming the file (never the server's path)."""
        if known is not None or name in self._paths:
            kind, message = AdapterUnavailableError, f"the adapter {name!r} cannot be used now: {why}"
        else:
            kind, message = RequestError, why
        with self._lock:
            if len(self._refused) >= REFUSED_KEPT:
                self._refused.clear()
            self._refused[name] = (found, kind, message)
        return RequestError(message, "model") if kind is RequestError else AdapterUnavailableError(message)

    def _read_once(self, name: str, source: Path, found: Signature, known: tuple[Signature, Variant] | None) -> Variant:
        """_read, once at a time per name: a second request for a name being read waits for that read (and only it)."""
        with self._lock:
            now, pending = self._known.get(name), self._reading.get(name)
            if now is not None and now[0] == found:
                return now[1]  # (read meanwhile by another request)
            mine = pending is None
            if pending is None:
                pending = self._reading[name] = Future()
        if not mine:
            return pending.result()
        try:
            try:
                variant = self._read(name, source, known, source.name)
            except OSError as e:
                raise self._read_failed(name, source, known, e) from None
            except ClefError as e:
                raise self._refuse(name, source, found, known, str(e)) from None
            pending.set_result(variant)
            return variant
        except BaseException as e:
            pending.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._reading[name]

    def _read_failed(self, name: str, source: Path, known: tuple[Signature, Variant] | None, e: OSError) -> ClefError:
        """A file that could not be read: gone, not regular (swapped since the stat), unreadable, or changing."""
        if isinstance(e, FileNotFoundError):  # (deleted since the stat)
            return self._missing(name, source, e)
        why = f"{source.name} cannot be read: {e.strerror or e}"
        if known is not None or name in self._paths or e.errno == errno.EAGAIN:  # (EAGAIN: changed while it was read)
            return AdapterUnavailableError(f"the adapter {name!r} cannot be used now: {why}")
        return RequestError(why, "model")  # (not remembered: a permission may be fixed without a new mtime)

    def _version(self, source: Path, label: str) -> Version:
        """`source` read into a private copy and validated (adapter_files.read_version); messages call it `label`."""
        return read_version(self._base_file, self.base.identity, source, self._private, label=label, base_head=self.base_head)

    def _read(self, name: str, source: Path, known: tuple[Signature, Variant] | None, label: str) -> Variant:
        """A new version of `name`'s file, read, validated and registered (the copy dropped: loading reads it again)."""
        version = self._version(source, label)
        version.copy.close()
        signature = version.copy.signature
        # An adapter without temperature keys of its own answers with its base's (calibrate writes its own).
        temperatures = version.temperatures or dict(self.base.temperatures)
        new = Variant(name, version.identity, temperatures, source, signature, None, version.nbytes)
        with self._lock:
            variant = self._by_identity.get(new.identity, new)
            if variant is not new:  # the same bytes again (a file restored, or one file under two names)
                variant.source, variant.signature, variant.current = source, signature, True
            self._by_identity[variant.identity] = variant
            self._known[name] = (signature, variant)
            self._refused.pop(name, None)
            if known is not None and known[1] is not variant:
                self._retire(known[1])
        return variant

    def _retire(self, old: Variant) -> None:
        """(Under the lock) `old` is no name's current version any more: kept for the prompts encoded for it while it
        is loaded or among the RETIRED_KEPT newest replaced; never loaded again."""
        if any(v is old for _, v in self._known.values()):
            return  # (another name's file is that version still)
        old.current = False
        self._retired.append(old)
        while len(self._retired) > RETIRED_KEPT:
            dropped = self._retired.popleft()
            if not dropped.current and dropped.head is None and self._by_identity.get(dropped.identity) is dropped:
                del self._by_identity[dropped.identity]

    def forget(self, variant: Variant) -> None:
        """(Once unloaded) A replaced version no longer kept: prompts that name it are another model's now."""
        with self._lock:
            if not variant.current and variant not in self._retired and self._by_identity.get(variant.identity) is variant:
                del self._by_identity[variant.identity]

    def reread(self, variant: Variant) -> AdapterCopy:
        """The private copy of a version about to be loaded (again): its file read and validated again, and refused
        (AdapterUnavailableError) unless it is still that version, byte for byte as its signature and identity say."""
        with self._lock:
            source, signature, current = variant.source, variant.signature, variant.current
        assert source is not None
        changed = f"the adapter {variant.name!r} changed after this request named it: send the request again"
        if not current:
            raise AdapterUnavailableError(changed)
        try:
            again = self._version(source, source.name)
        except (OSError, ClefError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise AdapterUnavailableError(f"the adapter {variant.name!r} cannot be loaded now: {reason}") from None
        if again.copy.signature != signature or again.identity != variant.identity:
            again.copy.close()
            raise AdapterUnavailableError(changed)
        return again.copy

    def of(self, identity: str) -> Variant | None:
        with self._lock:
            return self._by_identity.get(identity)

    def close(self) -> None:
        """Drop the adapters' private copies."""
        with self._lock:
            for variant in list(self._by_identity.values()):
                if variant.copy is not None:
                    variant.copy.close()
                    variant.copy = None
            self._known.clear()
        self._private.close()
