"""Every setting of `load()` and `clef-gguf serve`, once: its name, its default and the help the CLI shows; and the
defaults of other commands whose own modules are heavy to import (eval's target precisions).

A setting has one name from the CLI flag to the place it is used (--max-queue is max_queue in ServeSettings,
create_app and a Ray config's `args`). The CLI reads its defaults and help from these tables (cli/options.py), and
this module imports nothing of the package but errors and table_checks, so that `--help` shows them without llama.cpp.
A model is declared once, as a ModelSpec: its file, its LoadOptions and its AdapterSet.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from .errors import SettingsError
from .table_checks import check_table, check_value

MAX_PARALLEL = 64  # (llama.cpp's LLAMA_MAX_SEQ is 256)
# Bounds where llama.cpp would abort or a C type would wrap, checked before anything is loaded. A prompt's positions
# (llama_pos) and a batch's token count are int32, and llama.cpp pads n_ctx (a uint32) up to 256 cells.
INT32_MAX = (1 << 31) - 1  # the largest prompt limit
# Measured on llama-cpp-python 0.3.36: a qwen35 context with n_ubatch 28672 builds, one of 32768 aborts in ggml.
MAX_UBATCH = 28672
MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS (many more: the CPU backend crashes creating its threads)
# A JSON Lines record's largest size: the server's body limit at the default context (65536 tokens x 16 bytes), read
# from files as from sockets. The CLI's --max-line-bytes defaults to the server's for its --max-prompt-tokens, --mmproj.
MAX_LINE_BYTES = 1 << 20
DEFAULT_UBATCH = 1024  # (docs/benchmarks.md, "Memory on an 8 GB card": what a ubatch's compute buffer costs)
LogFormat = Literal["text", "json"]


def _setting(default: Any, help: str, **bounds: float) -> Any:
    """A field with its help and its bounds (pydantic's names: ge, gt, le), which both the CLI and a Ray config's
    `args` (server/ray_serve.py, validated by pydantic, which reads them from the metadata) hold it to."""
    return field(default=default, metadata={"help": help, **bounds})


def help_of(table: type, name: str) -> str:
    """The help text of setting `name` in `table` (one of this module's dataclasses)."""
    return next(f.metadata["help"] for f in fields(table) if f.name == name)


def bounds_of(table: type, name: str) -> dict[str, float]:
    """Setting `name`'s bounds in `table`, as typer's options take them (min, max)."""
    metadata = next(f.metadata for f in fields(table) if f.name == name)
    return {typer: metadata[key] for key, typer in (("ge", "min"), ("le", "max")) if key in metadata}


# Offload for every load that does not name it: a service whose command line is fixed (as llama-server's
# LLAMA_ARG_N_GPU_LAYERS), and the test suite's device set (`pytest --on-device`), which sets this one value.
N_GPU_LAYERS_ENV = "CLEF_GGUF_N_GPU_LAYERS"


def offload_default(unset: int = 0) -> int:
    """n_gpu_layers where none is given: $CLEF_GGUF_N_GPU_LAYERS (an integer, -1 for every layer), else `unset` (0 for a
    load, the CPU alone; plan's -1). Read whenever options are made, never cached: the environment of the moment."""
    value = os.environ.get(N_GPU_LAYERS_ENV, "").strip()
    if not value:
        return unset
    layers = int(value) if re.fullmatch(r"[+-]?[0-9]+", value) else None
    if layers is None or not -1 <= layers <= INT32_MAX:  # (named here: LoadOptions' bounds would name n_gpu_layers)
        raise SettingsError(f"{N_GPU_LAYERS_ENV} must be an integer from -1 (every layer) to {INT32_MAX}, not {value!r}")
    return layers


# pydantic's configuration of each table, when a Ray config's `args` are validated into it: a mistyped name is refused.
_STRICT = {"extra": "forbid"}


@dataclass(frozen=True)
class LoadOptions:
    """How `clef_gguf.load(path, ...)` loads and runs the base (its fine-tunes: AdapterSet)."""

    __pydantic_config__ = _STRICT

    # None: the one default, offload_default() (CLEF_GGUF_N_GPU_LAYERS, else 0), fixed when the options are made.
    n_gpu_layers: int | None = _setting(
        None,
        "Backbone layers to offload to the GPU (-1: all; 0: the CPU alone); the head and the vision tower follow them. "
        f"Default: ${N_GPU_LAYERS_ENV}, else 0.", ge=-1, le=INT32_MAX,
    )
    # Clef's context. Device memory is its KV cache plus one ubatch's compute buffer, whatever the prompt
    # (docs/benchmarks.md, "Memory on an 8 GB card").
    max_prompt_tokens: int = _setting(
        65536, "Largest prompt accepted (the context, at least --parallel; default Clef's). It sizes the KV cache.", ge=1,
        le=INT32_MAX,
    )
    ubatch: int | None = _setting(
        None,
        "Prefill in ubatches of this many tokens (state carried over): device memory bounded by the ubatch, "
        f"not the prompt. Default: {DEFAULT_UBATCH} (or the context if smaller); --ubatch = --ctx is one batch.",
        ge=1, le=MAX_UBATCH,
    )
    parallel: int = _setting(
        4,
        "Requests prefilled together when they wait at once (llama.cpp sequences; llama-server's -np), their tokens "
        "fitting one ubatch. Each takes a recurrent state of its own in the context.",
        ge=1,
        le=MAX_PARALLEL,
    )
    n_threads: int | None = _setting(
        None,
        "llama.cpp CPU threads (default: the physical cores this process may use, less those other processes keep busy "
        "when it loads; with --ray, 1 per replica).",
        ge=1,
        le=MAX_THREADS,
    )
    state_cache: int = _setting(
        1 << 30,  # two 8k-token states of Clef-flash
        "Host memory for the backbone states of recent requests' states (e.g. 512MiB; 0 turns it off): a request "
        "repeating a state prefills only its schema. Default: 1GiB.",
        ge=0,
    )
    mmproj: str | Path | None = _setting(
        None,
        "The vision tower (llama.cpp's mmproj GGUF, which convert writes beside the model): requests may carry up to "
        "4 images. Without it, requests with images are refused.",
    )

    def __post_init__(self) -> None:
        if self.n_gpu_layers is None:  # (frozen: set once, here)
            object.__setattr__(self, "n_gpu_layers", offload_default())
        # Here, where load(), every command and a Ray config's `args` build the options: llama.cpp aborts the process
        # (GGML_ASSERT) on a context of fewer cells than sequences, since it reserves an output per sequence.
        check_table(self)
        if self.parallel > self.max_prompt_tokens:
            raise SettingsError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) must be at least parallel ({self.parallel}): "
                "each sequence decoded together needs a cell of the context (raise max_prompt_tokens or lower parallel)"
            )
        if self.ubatch is not None and self.ubatch > self.max_prompt_tokens:
            raise SettingsError(f"ubatch ({self.ubatch}) cannot exceed max_prompt_tokens ({self.max_prompt_tokens})")


@dataclass(frozen=True)
class AdapterSet:
    """The fine-tunes a loaded base answers as besides itself (runtime/catalog.py names them, runtime/decider.py loads
    them): a request names its model; each is an adapter file over this base. Its settings keep load()'s keywords and
    the flags' names (adapters: serve's --adapter NAME=FILE; adapter: decide's and eval's --adapter FILE)."""

    __pydantic_config__ = _STRICT

    adapters: dict[str, str | Path] | None = _setting(
        None,
        "A fine-tune over this base, NAME=FILE (an adapter file: convert CHECKPOINT --base RELEASE --to-adapter); repeatable.",
    )
    adapter_dir: str | Path | None = _setting(
        None, "A folder of NAME.adapter.gguf files: an adapter is loaded when a request first names it."
    )
    max_adapters: int = _setting(8, "At most this many adapters loaded at once (least recently used unloaded first).", ge=1)
    adapter_memory: int | None = _setting(
        None,
        "At most this much memory for loaded adapters' LoRAs and heads (e.g. 2GiB). Default: no bound but --max-adapters.",
        ge=1,
    )
    base_head: bool = _setting(
        False,
        "Let an adapter without a head of its own (llama-server's variant: convert --to-adapter --llama-server) decide with "
        "the base's head. Without it such an adapter is refused: its answers would not be the fine-tune's.",
    )
    adapter: str | Path | None = _setting(
        None,
        "A fine-tune over MODEL (an adapter file: convert CHECKPOINT --base RELEASE --to-adapter) that answers every request.",
    )

    adapter_sources: list[str] | None = _setting(
        None,
        "Where an adapter a request names may come from, if not named otherwise (the allow list; repeatable): a folder, "
        "hf://ORG (its repositories: ORG/REPO[@REVISION][/FOLDER]) or hf://ORG/REPO. Nothing is fetched from elsewhere.",
    )
    adapter_cache: str | Path | None = _setting(
        None, "The folder fetched adapters are kept in (converted, checked), reused after a restart. Default: a private one."
    )
    adapter_cache_size: int = _setting(16 << 30, "Disk for --adapter-cache (least recently used go first).", ge=1)
    adapter_max_size: int = _setting(4 << 30, "The largest adapter (GGUF, or checkpoint files) a source may deliver.", ge=1)
    adapter_fetch_timeout: float = _setting(120.0, "Seconds a first use may take (fetch, convert, check): then a 503.", gt=0)
    adapter_fetches: int = _setting(4, "Adapters fetched at once (a thread, a connection each); more new ones: 503.", ge=1, le=64)
    adapter_fetch_rate: int = _setting(
        60, "Fetches (and --adapter-refresh checks) started a minute, each asking a source with its token; more: 503.", ge=1
    )
    adapter_refresh: float = _setting(
        600.0,
        "Seconds after which a name without @COMMIT (a branch: ORG/REPO) is checked again at its source when next used: a "
        "new commit is fetched while the version held answers (0: never).",
        ge=0,
    )
    adapter_base_release: str | Path | None = _setting(
        None,
        "The release the base was converted from (a folder or repo id): a clef-finetune checkpoint a source delivers is "
        "converted over it (as convert CHECKPOINT --base RELEASE --to-adapter). Without it checkpoints are refused.",
    )
    pins: list[str] | None = _setting(None, "An adapter kept resident (never unloaded, nor evicted from the cache); repeatable.")

    def __post_init__(self) -> None:
        # (here, not where they are used: load(), the CLI and a Ray config's `args` build the same set, refused alike)
        check_table(self)
        if any(not isinstance(p, (str, Path)) or p == "" for p in (self.adapters or {}).values()):
            raise SettingsError(f"adapters maps each name to an adapter file's path, not {self.adapters!r}")
        if self.adapter_fetch_timeout <= 0 or min(self.adapter_cache_size, self.adapter_max_size) < 1:
            raise SettingsError("adapter_fetch_timeout must be > 0 s, adapter_cache_size and adapter_max_size > 0 bytes")
        if self.pins and len(self.pins) >= self.max_adapters:
            raise SettingsError(f"{len(self.pins)} pinned adapters leave no room under max_adapters ({self.max_adapters})")
        if self.max_adapters < 1 or (self.adapter_memory is not None and self.adapter_memory < 1):
            raise SettingsError(
                f"max_adapters must be >= 1 and adapter_memory > 0 bytes, not {self.max_adapters}, {self.adapter_memory}"
            )
        if self.adapter is not None and (self.adapters or self.adapter_dir is not None or self.adapter_sources or self.pins):
            raise SettingsError("adapter (one fine-tune answering every request) excludes adapters, adapter_dir and sources")

    @property
    def serves_adapters(self) -> bool:
        """Whether a request may name a fine-tune (else every name is the base's, or the pinned adapter's)."""
        return bool(self.adapters) or self.adapter_dir is not None or bool(self.adapter_sources)


@dataclass(frozen=True)
class ModelSpec:
    """A model, declared once: its file, how it loads and runs, and the fine-tunes it answers as. What `load()`, the
    CLI, `serve` and Ray's replicas and actors build a model from (runtime/model.py's ClefModel, and its encoding part
    alone, runtime/encoder.py's PromptEncoder, for the Ray ingress). Frozen and picklable: it travels to Ray's
    processes as it is."""

    path: str | Path
    options: LoadOptions = field(default_factory=LoadOptions)
    adapter_set: AdapterSet = field(default_factory=AdapterSet)

    def __post_init__(self) -> None:
        check_value("path", self.path, str | Path, {})  # load(None), `serve ''`: not a file to read, nor the folder "."

    @classmethod
    def of(cls, path: str | Path, **keywords: Any) -> ModelSpec:
        """The spec of `load(path, **keywords)`: each keyword is a setting of LoadOptions or AdapterSet, by its name."""
        tables = [(table, {f.name for f in fields(table)}) for table in (LoadOptions, AdapterSet)]
        unknown = sorted(set(keywords).difference(*(names for _, names in tables)))
        if unknown:
            raise TypeError(f"load() got an unexpected keyword argument {unknown[0]!r}")
        options, adapter_set = (table(**{k: v for k, v in keywords.items() if k in names}) for table, names in tables)
        return cls(path, options, adapter_set)

    def placed(self) -> ModelSpec:
        """The same spec with absolute paths (the model's, the vision tower's, the adapters'): as every node of a Ray
        cluster sees them."""

        def absolute(path: str | Path | None) -> str | None:
            return None if path is None else str(Path(path).resolve())

        a = self.adapter_set
        adapters = {name: str(Path(path).resolve()) for name, path in a.adapters.items()} if a.adapters else None
        placed = replace(a, adapters=adapters, adapter_dir=absolute(a.adapter_dir), adapter=absolute(a.adapter))
        return ModelSpec(str(Path(self.path).resolve()), replace(self.options, mmproj=absolute(self.options.mmproj)), placed)


@dataclass(frozen=True)
class DataFiles:
    """How decide's dataset mode, eval, compare and calibrate read a JSON Lines file (runtime/dataset_file.py)."""

    max_line_bytes: int | None = _setting(
        None,
        "JSON Lines: a record longer than this (e.g. 4MiB) is refused unread, an error line (decide) or a line not "
        "counted (eval). Default: the server's body limit, 16 bytes a prompt token (1MiB at the default "
        "--max-prompt-tokens), plus 13MiB with --mmproj.",
    )


@dataclass(frozen=True)
class FileOptions:
    """How decide's dataset mode runs over a JSON Lines file, locally (runtime/dataset_file.decide_file) or on Ray
    (runtime/dataset_ray.decide_file_on_ray): the same options, the same answers file."""

    resume: bool = False  # continue the answers file, skipping the requests it answers
    force: bool = False  # overwrite the answers file
    sort_by_state: bool = False  # each window of requests decided grouped by state (the answers stay in order)
    images_anywhere: bool = False  # image paths may leave the input's folder
    max_line_bytes: int = MAX_LINE_BYTES  # a longer record gets the server's 413 error line, unread


def default_ubatch(max_prompt_tokens: int) -> int:
    """The ubatch when none is given: DEFAULT_UBATCH, or the whole prompt when the limit is smaller."""
    return min(DEFAULT_UBATCH, max_prompt_tokens)


@dataclass(frozen=True)
class HttpLimits:
    """What a connection may send, and how slowly (server/protocol.py and server/body.py enforce them)."""

    __pydantic_config__ = _STRICT

    max_head_bytes: int = 16 * 1024  # request line and headers (Node's default; h11's too)
    max_url_bytes: int = 8 * 1024  # the request target (nginx's default line buffer)
    header_timeout: float = _setting(10.0, "Seconds a connection has to send a request's headers; then 408.", ge=0.1)
    # Long enough for a slow link to send the largest text body.
    body_timeout: float = _setting(30.0, "Seconds a request has to send its whole body; then 408.", ge=0.1)
    # Kestrel's MinRequestBodyDataRate: a client trickling its body holds its intake slot for the grace period,
    # not the whole body timeout. 240 B/s is 2 kbit/s: any real link sends faster.
    min_body_rate: float = _setting(
        240.0, "Bytes/s a body must average once --body-grace has passed, or 408 (Kestrel's rule; 0: none).", ge=0
    )
    body_grace: float = _setting(5.0, "Seconds before --min-body-rate applies to a body.", ge=0)
    # A body takes an intake slot (--max-queue) only once whole: while it arrives it costs a connection and the bytes
    # it sent, bounded by these two. 64 MiB: 64 text bodies at the 1 MiB cap of the default --ctx, or 4 with images.
    max_body_buffer: int = _setting(
        64 << 20,
        "Bytes the request bodies still arriving may hold in all (e.g. 64MiB); a body that does not fit gets 503. "
        "Default: 64MiB.",
        ge=1,
    )
    # nginx's default worker_connections: far above the --max-queue (64) bodies a server reads honestly at once.
    max_body_readers: int = _setting(
        512, "Request bodies read at once (uvicorn's --limit-concurrency, for bodies); more get 503.", ge=1
    )
    keep_alive: float = _setting(5.0, "Seconds an idle connection is kept after an answer.", ge=0.1)  # uvicorn's default


@dataclass(frozen=True)
class ServeSettings:
    """Where and how `clef-gguf serve` takes requests, whichever decides them (one process, or Ray replicas)."""

    __pydantic_config__ = _STRICT

    host: str = _setting("127.0.0.1", "Interface to bind; the default keeps the server on this machine.")
    port: int = _setting(8000, "TCP port.", ge=1, le=65535)
    api_key: str | None = _setting(None, "Require Authorization: Bearer KEY on /v1 and /accounts (default: none; header ignored)")
    max_queue: int = _setting(
        64, "Whole bodies prepared at once, and requests admitted to decide (running + waiting); more get 503.", ge=1
    )
    drain_timeout: float = _setting(60.0, "Seconds SIGTERM waits for admitted requests to finish.", ge=0)
    limits: HttpLimits = field(default_factory=HttpLimits)  # (on Ray, its proxy's own, but for the body and keep-alive)
    log_format: LogFormat = _setting(
        "text", "The access log's lines on stderr, one per request: text (key=value) or json (one object per line)."
    )
    ui: bool = _setting(True, "Serve the page at / that asks the model and shows each option's probability (--no-ui: none).")
    # Web pages are the server's other clients (server/guard.py): it answers only its own names and its own page.
    allowed_hosts: tuple[str, ...] = _setting(
        (),
        "A name (Host) to answer as, besides localhost, IP addresses and --host: a reverse proxy's (clef.example.com; "
        ".example.com: its subdomains; *: any). Repeatable.",
    )
    allowed_origins: tuple[str, ...] = _setting(
        (),
        "A site whose pages may call this server, besides its own page (https://app.example.com; *: any). Repeatable.",
    )
    metrics_adapter_cap: int = _setting(64, "Adapters labelled by name in /metrics; later ones share adapter=_other.", ge=1)

    def __post_init__(self) -> None:
        # (here, where the CLI and a Ray config's `args` build the same table: refused alike)
        for name in self.allowed_hosts:
            if not re.fullmatch(r"\*|\.?[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]", name):
                example = "e.g. clef.example.com, .example.com, *"
                raise SettingsError(f"allowed_hosts (--allowed-host): {name!r} is not a host name ({example})")
        for origin in self.allowed_origins:
            if not re.fullmatch(r"\*|https?://[A-Za-z0-9._-]+(:\d+)?/?|https?://\[[0-9A-Fa-f:.]+\](:\d+)?/?", origin):
                example = "scheme://name[:port], e.g. https://app.example.com, or *"
                raise SettingsError(f"allowed_origins (--allowed-origin): {origin!r} is not an origin ({example})")


API_KEY_ENV = "CLEF_GGUF_API_KEY"  # --api-key's environment variable, read by `serve` and a Ray config alike
LOADER_ENV = "CLEF_GGUF_LOADER"  # how llama.cpp reads a model: auto, cookie (glibc) or portable (llama/loader.py)

# eval's, compare's and calibrate's auto-decide coverage (quality/metrics.py), at these precisions by default.
DEFAULT_TARGET_PRECISIONS = (0.99, 0.95)


@dataclass(frozen=True)
class RayScale:
    """How many replicas, on which cluster: `serve --ray`'s own options."""

    __pydantic_config__ = _STRICT

    replicas: int | None = _setting(None, "With --ray: model replicas (default 1).", ge=1)
    autoscale: str | None = _setting(None, "With --ray: autoscale between MIN and MAX replicas.")  # "MIN:MAX"
    gpus: float = _setting(0.0, "With --ray: GPUs Ray reserves per replica.", ge=0)
    address: str | None = _setting(
        None, "With --ray: the Ray cluster to deploy on (default: a local one, started here, on loopback)."
    )


# --- sizes: the largest body worth reading (a SIZE flag's text: table_checks.parse_size) -----------------------
# The decoded body is capped at the model's token limit times this many bytes, so that a body no prompt
# could fit is refused while it is decoded (in milliseconds), never tokenized. On Qwen3.5's vocabulary (the Clef
# backbone's), text of any script costs a few bytes per token as UTF-8, and about three times as many as the
# \uXXXX escapes json.dumps writes by default: 16 is above both. Only runs of one character (a token covers
# up to 128 spaces) go past it: such a body is refused as too large.
BYTES_PER_TOKEN = 16

# With a vision tower, room for the images on top (Workers AI's: 8 MiB of image files, base64 in JSON, and a
# request body of at most 13 MiB in all).
IMAGE_ALLOWANCE = 13 << 20


def body_limit(max_prompt_tokens: int, images: bool = False) -> int:
    """The largest decoded (and raw) body worth reading for a model with this token limit (and images): the server's
    body limit (server/body.py), and the default of --max-line-bytes."""
    return max_prompt_tokens * BYTES_PER_TOKEN + (IMAGE_ALLOWANCE if images else 0)
