"""Options that several commands share, named as llama-server names them where it has them."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer

from ..errors import SettingsError
from ..settings import (
    AdapterSet,
    DataFiles,
    LoadOptions,
    LogFormat,
    ModelSpec,
    ServeSettings,
    body_limit,
    bounds_of,
    help_of,
    offload_default,
)
from ..table_checks import parse_size
from .errors import fail


def _load(name: str, table: type = LoadOptions) -> Any:
    """A load option's help and bounds, as its table (settings.LoadOptions, or AdapterSet) gives them."""
    return {"help": help_of(table, name), **bounds_of(table, name)}


def gpu_layers_default(unset: int) -> Callable[[int | None], int]:
    """-ngl's value: the flag's, else settings.offload_default(unset) (CLEF_GGUF_N_GPU_LAYERS), whose refusal (no
    integer in -ngl's bounds) is one line naming the variable, exit 2: no flag was given to show usage for."""

    def value(given: int | None) -> int:
        if given is not None:
            return given
        try:
            return offload_default(unset)
        except SettingsError as e:
            fail(str(e))

    return value


GpuLayers = Annotated[
    int | None,
    typer.Option(
        "--n-gpu-layers",
        "-ngl",
        help=help_of(LoadOptions, "n_gpu_layers"),
        show_default=False,
        callback=gpu_layers_default(0),
    ),
]
MaxPrompt = Annotated[
    int,
    typer.Option(
        "--max-prompt-tokens",
        "--ctx",
        **_load("max_prompt_tokens"),
    ),
]
Mmproj = Annotated[
    Path | None,
    typer.Option(
        "--mmproj",
        help=help_of(LoadOptions, "mmproj"),
        show_default=False,
    ),
]
Ubatch = Annotated[
    int | None,
    typer.Option(
        "--ubatch",
        **_load("ubatch"),
        show_default=False,
    ),
]
Parallel = Annotated[
    int,
    typer.Option(
        "--parallel",
        "-np",
        **_load("parallel"),
    ),
]


Threads = Annotated[
    int | None,
    typer.Option("--threads", **_load("n_threads"), show_default=False),
]


def file_path(text: str | Path) -> Path:
    """A file argument's parser (a model's): '' is refused, never Path(''), which is the working directory."""
    if str(text) == "":
        raise typer.BadParameter("an empty path names no file")
    return Path(text)


def size_flag(value: str | int) -> int:
    """A SIZE flag's parser: 8GiB, 512MiB, or bytes (table_checks.parse_size); its default as it is."""
    if isinstance(value, int):  # the default, which click hands to the parser too
        return value
    try:
        return parse_size(value)
    except SettingsError as e:
        raise typer.BadParameter(str(e)) from None


def state_cache_option(default: str | None = None) -> Any:
    """--state-cache, whose default LoadOptions' help gives unless the command has its own."""
    text = help_of(LoadOptions, "state_cache")
    return typer.Option(
        "--state-cache",
        metavar="SIZE",
        parser=size_flag,
        help=text if default is None else text.rsplit(" Default:", 1)[0] + f" Default: {default}.",
        show_default=False,
    )


MaxLineBytes = Annotated[
    int | None,
    typer.Option(
        "--max-line-bytes", metavar="SIZE", parser=size_flag, help=help_of(DataFiles, "max_line_bytes"), show_default=False
    ),
]


def line_limit(max_line_bytes: int | None, max_prompt_tokens: int, mmproj: Path | None) -> int:
    """--max-line-bytes, or the server's body limit for these settings (settings.body_limit)."""
    if max_line_bytes is not None:
        if max_line_bytes < 1:
            fail("--max-line-bytes must be at least 1 byte")
        return max_line_bytes
    return body_limit(max_prompt_tokens, mmproj is not None)


def check_ubatch(ubatch: int | None, max_prompt_tokens: int) -> None:
    if ubatch is not None and ubatch > max_prompt_tokens:
        fail(f"--ubatch ({ubatch}) cannot exceed --max-prompt-tokens ({max_prompt_tokens})")


LogFormatOption = Annotated[
    LogFormat,
    typer.Option(
        "--log-format",
        help=help_of(ServeSettings, "log_format"),
    ),
]


# Many fine-tunes over one base (settings.AdapterSet).
AdapterPairs = Annotated[
    list[str] | None,
    typer.Option("--adapter", metavar="NAME=FILE", help=help_of(AdapterSet, "adapters"), show_default=False),
]
AdapterDir = Annotated[Path | None, typer.Option("--adapter-dir", help=help_of(AdapterSet, "adapter_dir"), show_default=False)]
MaxAdapters = Annotated[int, typer.Option("--max-adapters", **_load("max_adapters", AdapterSet))]
AdapterMemory = Annotated[
    int | None,
    typer.Option(
        "--adapter-memory", metavar="SIZE", parser=size_flag, help=help_of(AdapterSet, "adapter_memory"), show_default=False
    ),
]
AdapterFile = Annotated[
    Path | None,
    typer.Option("--adapter", metavar="FILE", help=help_of(AdapterSet, "adapter"), show_default=False),
]

BaseHead = Annotated[bool, typer.Option("--base-head", help=help_of(AdapterSet, "base_head"))]
# Where adapters a request names may come from (runtime/sources.py), and the bounds of what they deliver.
AdapterSources = Annotated[
    list[str] | None,
    typer.Option("--adapter-source", metavar="SOURCE", help=help_of(AdapterSet, "adapter_sources"), show_default=False),
]
AdapterCache = Annotated[
    Path | None, typer.Option("--adapter-cache", metavar="DIR", help=help_of(AdapterSet, "adapter_cache"), show_default=False)
]
AdapterCacheSize = Annotated[
    int, typer.Option("--adapter-cache-size", metavar="SIZE", parser=size_flag, **_load("adapter_cache_size", AdapterSet))
]
AdapterMaxSize = Annotated[
    int, typer.Option("--adapter-max-size", metavar="SIZE", parser=size_flag, **_load("adapter_max_size", AdapterSet))
]
AdapterFetchTimeout = Annotated[float, typer.Option("--adapter-fetch-timeout", **_load("adapter_fetch_timeout", AdapterSet))]
AdapterFetches = Annotated[int, typer.Option("--adapter-fetches", **_load("adapter_fetches", AdapterSet))]
AdapterFetchRate = Annotated[
    int, typer.Option("--adapter-fetch-rate", metavar="PER_MINUTE", **_load("adapter_fetch_rate", AdapterSet))
]
AdapterRefresh = Annotated[float, typer.Option("--adapter-refresh", metavar="SECONDS", **_load("adapter_refresh", AdapterSet))]
AdapterBaseRelease = Annotated[
    str | None,
    typer.Option(
        "--adapter-base-release", metavar="RELEASE", help=help_of(AdapterSet, "adapter_base_release"), show_default=False
    ),
]
Pins = Annotated[list[str] | None, typer.Option("--pin", metavar="NAME", help=help_of(AdapterSet, "pins"), show_default=False)]


def adapter_pairs(values: list[str] | None) -> dict[str, Path] | None:
    """--adapter NAME=FILE, repeated: {name: file}."""
    if not values:
        return None
    pairs: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            fail(f"--adapter takes NAME=FILE (the name requests pick it by), not {value!r}")
        if name in pairs:
            fail(f"--adapter names {name} twice")
        pairs[name] = Path(path)
    return pairs


def flag_groups(command: Callable[..., None]) -> Callable[..., None]:
    """Flags that several commands share, declared once: a keyword-only parameter of `command` whose type is a flag
    group (a dataclass whose fields are typer options, as LoadFlags) stands for the group's flags, in that place of
    --help. Typer reads the flags from inspect.signature, so the wrapper's signature lists them, and the wrapper hands
    `command` their values as one instance of the group."""
    signature = inspect.signature(command, eval_str=True)
    params: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for param in signature.parameters.values():
        group = param.annotation
        if not is_dataclass(group):
            params.append(param)
            continue
        hints = get_type_hints(group, include_extras=True)
        flags = [param.replace(name=f.name, annotation=hints[f.name], default=f.default) for f in fields(group)]
        groups[param.name] = (group, [f.name for f in flags])
        params += flags

    @functools.wraps(command)
    def with_groups(**values: Any) -> None:
        for name, (group, flags) in groups.items():
            values[name] = group(**{flag: values.pop(flag) for flag in flags})
        command(**values)

    with_groups.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    with_groups.__annotations__ = {p.name: p.annotation for p in params}
    return with_groups


StateCache = Annotated[int | None, state_cache_option("1GiB; decide with one request: 0 (nothing to reuse)")]


@dataclass(frozen=True)
class LoadFlags:
    """How a command loads the model: LoadOptions' flags, each declared once (a flag group: flag_groups). The groups
    below add the fine-tunes' flags; each makes the command's ModelSpec, as load() and a Ray config make theirs."""

    n_gpu_layers: GpuLayers = LoadOptions.n_gpu_layers
    max_prompt_tokens: MaxPrompt = LoadOptions.max_prompt_tokens
    ubatch: Ubatch = LoadOptions.ubatch
    parallel: Parallel = LoadOptions.parallel
    n_threads: Threads = LoadOptions.n_threads
    state_cache: StateCache = None  # (the command's default: options())
    mmproj: Mmproj = None

    def options(self, state_cache: int = LoadOptions.state_cache) -> LoadOptions:
        """The LoadOptions the flags give (`state_cache`: the command's default for --state-cache); an --ubatch over
        --ctx refused first."""
        check_ubatch(self.ubatch, self.max_prompt_tokens)
        given = {f.name: getattr(self, f.name) for f in fields(LoadOptions)}
        return LoadOptions(**given | {"state_cache": state_cache if self.state_cache is None else self.state_cache})


@dataclass(frozen=True)
class DataFlags(LoadFlags):
    """LoadFlags, and the longest line of a JSON Lines input (decide's, eval's, compare's, calibrate's)."""

    max_line_bytes: MaxLineBytes = None

    def line_limit(self) -> int:
        """--max-line-bytes, or the server's body limit for these settings (settings.body_limit)."""
        return line_limit(self.max_line_bytes, self.max_prompt_tokens, self.mmproj)

    def pinned(
        self, model: Path, adapter: Path | None = None, base_head: bool = False, state_cache: int | None = None
    ) -> ModelSpec:
        """The ModelSpec of `model` loaded with these flags, `adapter` (a fine-tune over it) answering every request
        (compare's two sides: --adapter-a, --adapter-b)."""
        options = self.options() if state_cache is None else self.options(state_cache)
        return ModelSpec(model, options, AdapterSet(adapter=adapter, base_head=base_head))


@dataclass(frozen=True)
class ModelFlags(DataFlags):
    """DataFlags and --adapter, one fine-tune over the model that answers every request (decide, eval, calibrate)."""

    adapter: AdapterFile = None
    base_head: BaseHead = AdapterSet.base_head

    def spec(self, model: Path, state_cache: int = LoadOptions.state_cache) -> ModelSpec:
        return self.pinned(model, self.adapter, self.base_head, state_cache)


@dataclass(frozen=True)
class ServedFlags(LoadFlags):
    """LoadFlags and the fine-tunes a request may name (serve: settings.AdapterSet)."""

    adapters: AdapterPairs = None
    adapter_dir: AdapterDir = None
    max_adapters: MaxAdapters = AdapterSet.max_adapters
    adapter_memory: AdapterMemory = AdapterSet.adapter_memory
    base_head: BaseHead = AdapterSet.base_head
    adapter_sources: AdapterSources = None
    adapter_cache: AdapterCache = None
    adapter_cache_size: AdapterCacheSize = AdapterSet.adapter_cache_size
    adapter_max_size: AdapterMaxSize = AdapterSet.adapter_max_size
    adapter_fetch_timeout: AdapterFetchTimeout = AdapterSet.adapter_fetch_timeout
    adapter_fetches: AdapterFetches = AdapterSet.adapter_fetches
    adapter_fetch_rate: AdapterFetchRate = AdapterSet.adapter_fetch_rate
    adapter_refresh: AdapterRefresh = AdapterSet.adapter_refresh
    adapter_base_release: AdapterBaseRelease = None
    pins: Pins = None

    def spec(self, model: Path) -> ModelSpec:
        tuned = AdapterSet(
            adapter_pairs(self.adapters),
            self.adapter_dir,
            self.max_adapters,
            self.adapter_memory,
            self.base_head,
            adapter_sources=self.adapter_sources,
            adapter_cache=self.adapter_cache,
            adapter_cache_size=self.adapter_cache_size,
            adapter_max_size=self.adapter_max_size,
            adapter_fetch_timeout=self.adapter_fetch_timeout,
            adapter_fetches=self.adapter_fetches,
            adapter_fetch_rate=self.adapter_fetch_rate,
            adapter_refresh=self.adapter_refresh,
            adapter_base_release=self.adapter_base_release,
            pins=self.pins,
        )
        return ModelSpec(model, self.options(), tuned)


# The dataset mode on a Ray cluster (decide's JSON Lines, eval): cli/common.on_ray.
OnRayOption = Annotated[
    bool,
    typer.Option("--ray", help="JSON Lines: decide on a Ray cluster (Ray Data), the same answers in order (docs/dataset.md)."),
]
WorkersOption = Annotated[
    int | None,
    typer.Option(
        "--workers",
        min=1,
        help="With --ray: actors, each loading the model (default: the cluster's CPUs / --threads).",
        show_default=False,
    ),
]
AddressOption = Annotated[
    str | None,
    typer.Option(
        "--address",
        envvar="RAY_ADDRESS",
        help="With --ray: the Ray cluster to join (default: a local one, started and stopped here, on loopback).",
        show_default=False,
    ),
]
