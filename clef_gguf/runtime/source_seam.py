"""What an adapter source is (Source: runtime/sources.py's seam), what it is asked for (Wanted), what it delivers
(Delivered) and within which bounds (Bounds: AdapterSet's --adapter-max-size, --adapter-fetch-timeout, the fetch caps
and --adapter-refresh). A source may also say which commit a name's branch is at now, cheaply (`revision(wanted,
bounds) -> str`, as runtime/hub_source.py's): then a name that names no commit follows its branch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..settings import AdapterSet


@dataclass(frozen=True)
class Wanted:
    """A requested name as the source that claims it reads it."""

    name: str  # as the request named it
    key: str  # what the disk cache keeps it under: the source and exactly what it names
    pinned: bool = False  # it names an exact revision (a commit): a verdict on it is final


@dataclass(frozen=True)
class Delivered:
    """What a source delivered into a staging folder: an adapter file, or a clef-finetune checkpoint folder."""

    path: Path
    revision: str  # what was delivered (a commit)
    nbytes: int


@dataclass(frozen=True)
class Bounds:
    max_bytes: int  # the largest adapter a source may deliver
    timeout_s: float  # how long a first use may take (and each request to a source)
    new_per_minute: int = AdapterSet.adapter_fetch_rate  # fetches started a minute (each asks a source, with its token)
    max_fetches: int = AdapterSet.adapter_fetches  # fetches at once (each a thread and a connection)
    deadline_factor: float = 5.0  # a fetch is abandoned after this many timeout_s in all (a Hub that drips bytes)
    refresh_s: float = AdapterSet.adapter_refresh  # a name following a branch is looked up again at this age (0: never)

    @property
    def deadline_s(self) -> float:
        return self.timeout_s * self.deadline_factor


class Source(Protocol):
    label: str  # as the operator named it (hf://ORG, a folder)
    remote: bool  # it fetches (`fetch`), or it names files read in place (`local`)
    metered: bool  # its fetches ask someone outside, with the server's token: --adapter-fetch-rate counts them

    def claims(self, name: str) -> Wanted | None: ...

    def well_formed(self, name: str) -> bool: ...  # a name of its kind, whether it claims it or not

    def name_of(self, key: str) -> str | None: ...  # the name claims() keys as `key` (None: not its key)

    def local(self, wanted: Wanted) -> Path | None: ...

    def fetch(self, wanted: Wanted, into: Path, bounds: Bounds) -> Delivered: ...
