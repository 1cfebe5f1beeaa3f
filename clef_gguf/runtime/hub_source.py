"""A Hugging Face Hub source (--adapter-source hf://ORG or hf://ORG/REPO): names ORG/REPO[@REVISION][/SUBFOLDER].

Through huggingface-hub's own client (imported here only, when a Hub source is served): HF_ENDPOINT, HF_TOKEN (or
HF_HOME's token) are honoured; the token is sent as the client sends it and never appears in a message. Files are
streamed by its HTTP client into the adapter cache's staging folder, not through huggingface-hub's cache: the adapter
cache's copy is the only one (bounded by --adapter-cache-size), and each download is cut off at --adapter-max-size
and at its deadline, whatever the listing said. What a repository
(or its subfolder) may deliver: one GGUF file (an adapter file, checked against the base by the caller) or a
clef-finetune checkpoint (adapter/adapter_config.json, adapter/adapter_model.safetensors, joint_head.safetensors,
converted by the caller); a release (a merged fine-tune, a full model) is refused as a model file is. Sizes are
read from the repository's listing and refused over the bound before a byte is downloaded (and counted again as the
bytes come).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import ClefError, NotADecisionModelError, RequestError, SettingsError, SourceUnavailableError
from .adapter_files import ADAPTER_SUFFIX
from .sources import HF_SCHEME, Bounds, Delivered, Wanted, too_large

# The Hub's own rule for a namespace or a repository (huggingface-hub's validate_repo_id): letters, digits, ._- ,
# neither first nor last a . or -, no -- or .. (checked in claims), at most 96.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REV = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
NAME = re.compile(rf"(?P<org>{_PART})/(?P<repo>{_PART})(?:@(?P<rev>{_REV}))?(?:/(?P<sub>{_PART}(?:/{_PART})*))?")
COMMIT = re.compile(r"[0-9a-f]{40}")
CHECKPOINT = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "joint_head.safetensors")


def endpoint() -> str:
    from huggingface_hub import constants

    # Read at call time, not import time: HF_ENDPOINT may be set after huggingface_hub was imported.
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


class HubSource:
    """Every repository of ORG, or one repository ORG/REPO."""

    def __init__(self, org: str, repo: str | None) -> None:
        self.org, self.repo, self.remote, self.metered = org, repo, True, True
        self.label = f"{HF_SCHEME}{org}" + (f"/{repo}" if repo else "")

    @classmethod
    def parse(cls, text: str) -> HubSource:
        parts = text.removeprefix(HF_SCHEME).split("/")
        if not 1 <= len(parts) <= 2 or not all(re.fullmatch(_PART, p) for p in parts):
            raise SettingsError(f"the adapter source {text!r} is not one: {HF_SCHEME}ORG or {HF_SCHEME}ORG/REPO")
        return cls(parts[0], parts[1] if len(parts) == 2 else None)

    def well_formed(self, name: str) -> bool:
        """Whether `name` reads as ORG/REPO[@REVISION][/FOLDER] by the Hub's rules, whoever's it is."""
        m = NAME.fullmatch(name)
        return m is not None and ".." not in name and "--" not in f"{m['org']}/{m['repo']}"

    def claims(self, name: str) -> Wanted | None:
        m = NAME.fullmatch(name)
        if not self.well_formed(name) or m is None or m["org"] != self.org or (self.repo is not None and m["repo"] != self.repo):
            return None
        rev = m["rev"]
        key = f"{HF_SCHEME}{m['org']}/{m['repo']}@{rev or 'main'}/{m['sub'] or ''}"
        return Wanted(name, key, pinned=rev is not None and COMMIT.fullmatch(rev) is not None)

    def name_of(self, key: str) -> str | None:
        """The name a request would use for one of this source's cache keys (claims' inverse: branch main's is the bare
        ORG/REPO[/SUB]); None for a key that is not this source's."""
        repo, _, rest = key.removeprefix(HF_SCHEME).partition("@")
        revision, _, sub = rest.partition("/")
        name = repo + ("" if revision == "main" else f"@{revision}") + (f"/{sub}" if sub else "")
        wanted = self.claims(name) if key.startswith(HF_SCHEME) else None
        return name if wanted is not None and wanted.key == key else None

    def local(self, wanted: Wanted) -> Path | None:
        return None

    def revision(self, wanted: Wanted, bounds: Bounds) -> str:
        """The commit `wanted`'s branch (main when it names none) is at now: one request asking the Hub for the sha
        alone, no listing, no download (what --adapter-refresh asks of a name that follows its branch)."""
        from huggingface_hub import HfApi

        m = NAME.fullmatch(wanted.name)
        assert m is not None  # (claims)
        with _hub_errors(wanted.name, m["rev"]):
            info = HfApi(endpoint=endpoint()).model_info(
                f"{m['org']}/{m['repo']}", revision=m["rev"], expand=["sha"], timeout=bounds.timeout_s
            )
        return str(info.sha)

    def fetch(self, wanted: Wanted, into: Path, bounds: Bounds) -> Delivered:
        from huggingface_hub import HfApi, hf_hub_url

        deadline = time.monotonic() + bounds.deadline_s
        m = NAME.fullmatch(wanted.name)
        assert m is not None  # (claims)
        repo_id, prefix = f"{m['org']}/{m['repo']}", f"{m['sub']}/" if m["sub"] else ""
        with _hub_errors(wanted.name, m["rev"]):
            info = HfApi(endpoint=endpoint()).model_info(
                repo_id, revision=m["rev"], files_metadata=True, timeout=bounds.timeout_s
            )
            listed = {s.rfilename.removeprefix(prefix): s.size for s in info.siblings or [] if s.rfilename.startswith(prefix)}
            chosen = choose(wanted.name, listed)
            total = sum(listed[f] or 0 for f in chosen)
            if total > bounds.max_bytes:
                raise too_large(wanted.name, total, bounds.max_bytes)
            folder = into / m["repo"]  # (a checkpoint's folder name is what its conversion names the adapter)
            nbytes = 0
            for file in chosen:
                (folder / file).parent.mkdir(parents=True, exist_ok=True)
                url = hf_hub_url(repo_id, prefix + file, revision=info.sha, endpoint=endpoint())
                nbytes += _download(wanted.name, url, folder / file, bounds, bounds.max_bytes - nbytes, deadline)
        path = folder if len(chosen) > 1 else folder / chosen[0]
        return Delivered(path, str(info.sha), nbytes)


def _download(name: str, url: str, to: Path, bounds: Bounds, budget: int, deadline: float) -> int:
    """One file streamed into `to` (the staging folder: the cache's copy is the only one, none in huggingface-hub's
    cache), cut off past `budget` bytes (a listing's sizes are the Hub's word, not a bound) or past `deadline` (a Hub
    that drips bytes just within each read's timeout); the connection is closed on the way out either way."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    got = 0
    with get_session().stream("GET", url, headers=build_hf_headers(), timeout=bounds.timeout_s, follow_redirects=True) as r:
        if r.is_error:  # (its message read before the status is raised: a stream has no body yet)
            r.read()
            hf_raise_for_status(r)
        if int(r.headers.get("Content-Length") or 0) > budget:
            raise too_large(name, bounds.max_bytes - budget + int(r.headers["Content-Length"]), bounds.max_bytes)
        with open(to, "wb") as f:
            for chunk in r.iter_bytes():  # (as they come: a size would wait for that many bytes)
                got += len(chunk)
                if got > budget:
                    raise too_large(name, bounds.max_bytes - budget + got, bounds.max_bytes, more=True)
                if time.monotonic() > deadline:
                    raise unreachable(name, f"not delivered within {bounds.deadline_s:g} s; abandoned")
                f.write(chunk)
    return got


def choose(name: str, listed: dict[str, int | None]) -> list[str]:
    """The files of a repository (its subfolder's, relative) that make its adapter: a checkpoint's three, or its one
    GGUF file (the one .adapter.gguf among several); a release or anything else refused."""
    if all(f in listed for f in CHECKPOINT):
        return list(CHECKPOINT)
    ggufs = sorted(f for f in listed if "/" not in f and f.endswith(".gguf"))
    adapters = [f for f in ggufs if f.endswith(ADAPTER_SUFFIX)]
    if len(ggufs) == 1 or len(adapters) == 1:
        return adapters or ggufs
    if ggufs:
        raise RequestError(f"{name} holds {len(ggufs)} GGUF files and no one adapter file: name its subfolder", "model")
    if "config.json" in listed or any(f.endswith(".safetensors") for f in listed):
        raise NotADecisionModelError(
            f"{name} is a release (a merged fine-tune or a full model), not an adapter: serve its clef-finetune "
            "checkpoint, or its adapter file (clef-gguf convert CHECKPOINT --base RELEASE --to-adapter makes one)"
        )
    raise RequestError(
        f"{name} holds no adapter: an .adapter.gguf file, or a clef-finetune checkpoint ({', '.join(CHECKPOINT)})", "model"
    )


@contextlib.contextmanager
def _hub_errors(name: str, revision: str | None) -> Iterator[None]:
    """huggingface-hub's errors as ours: what the Hub says of the name a 422, a Hub that cannot answer a 503."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except ClefError:
        raise
    except HFValidationError as e:  # (a name the client refuses to ask for: the request's fault)
        raise RequestError(f"{name} is not a Hugging Face Hub name: {_first_line(e)}", "model") from None
    except RepositoryNotFoundError:
        raise RequestError(f"{name}: no such repository on the Hugging Face Hub (or not open to this server)", "model") from None
    except RevisionNotFoundError:
        raise RequestError(f"{name}: the repository has no revision {revision}", "model") from None
    except EntryNotFoundError:
        raise RequestError(f"{name}: a file of the repository is missing", "model") from None
    except HfHubHTTPError as e:  # (any other answer of the Hub's: a server error, a rate limit, an outage page)
        status = getattr(e.response, "status_code", None)
        raise unreachable(name, f"HTTP {status}" if status else _first_line(e)) from None
    except OSError as e:
        if e.filename is not None:  # (a file of ours: the adapter cache's disk, not the Hub)
            raise
        raise unreachable(name, _first_line(e)) from None
    except (LocalEntryNotFoundError, *_transport_errors()) as e:
        raise unreachable(name, _first_line(e)) from None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's own errors (a refused connection, a timeout): httpx2, httpx or requests, whichever the
    installed huggingface-hub loaded."""
    found: list[type[BaseException]] = []
    for module, error in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(getattr(loaded, error, None), type):
            found.append(getattr(loaded, error))
    return tuple(found)


def unreachable(name: str, why: str) -> SourceUnavailableError:
    return SourceUnavailableError(f"the Hugging Face Hub cannot deliver {name} now ({why})")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
