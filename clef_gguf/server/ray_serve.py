"""clef-gguf on Ray Serve: the `clef-gguf serve` app, its decisions made by model replicas.

Two deployments, from the server's own code:
  * ClefIngress runs create_app, the plain server's FastAPI app, over a PromptEncoder (the file's
    vocabulary, no weights): bodies are read, validated and tokenized there exactly as `clef-gguf
    serve` does it (intake.py), so every refusal is the plain server's own (same statuses, same
    bodies, a prompt over the limit included) and no replica is ever busy with a request it would
    refuse. Its scheduler hands each prompt to a replica through a DeploymentHandle.
  * ClefReplica holds one loaded ClefModel, with its own llama.cpp threads (= its num_cpus) and GPU
    share (num_gpus), and decides on the plain server's ComputeScheduler: up to --parallel prompts prefilled
    together, a long one in steps beside them, as `clef-gguf serve` decides.
Both receive the settings tables as `clef-gguf serve` has them (settings.py): the ingress the ServeSettings, its
HttpLimits included, so every limit of a body holds as on the plain server; each replica the ModelSpec.
With adapters (fine-tunes over the model, runtime/decider.py), every replica is loaded with the same set and the
ingress's encoder resolves a request's model name from the same files (runtime/catalog.py), so a prompt carries
the identity the replicas give that name.

Why our own ingress in front of the replicas rather than the replicas behind Ray's HTTP proxy: when a
replica's process dies mid-request, Ray's proxy answers 500 (serve/_private/http_util.py,
get_http_response_status: a RayActorError is a 500), which no client retries. Here a decision lost
with its replica is our JSON 503 with Retry-After, which clients retry (typesafe-sdk honours it), and
requests not yet handed to a replica are routed to the others by Ray's router itself.

Run it with `clef-gguf serve --ray` (ray_cluster.py deploys it), or `serve run` a config file whose import path is
clef_gguf.server.ray_serve:app_builder (examples/ray-serve.yaml).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, get_args, get_type_hints

from fastapi import FastAPI
from pydantic import TypeAdapter, ValidationError
from ray import serve
from ray.exceptions import NodeDiedError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import AdapterUnavailableError, ClefError, SettingsError
from ..runtime.model import PROBE, ClefModel, open_encoder
from ..runtime.prompt import EncodedPrompt
from ..settings import API_KEY_ENV, AdapterSet, HttpLimits, LoadOptions, ModelSpec, RayScale, ServeSettings
from ..table_checks import check_value
from .adapter_metrics import AdapterCounts, AdapterView, ReplicaFigures
from .app import check_api_key, send_shutting_down
from .decision import Decision
from .observe import configure_access_log
from .problems import overloaded
from .ray_relay import HubAccess, adapter_file, ingress_relay
from .run import settings_app
from .worker import ComputeScheduler, Prompt, queue_full, render

APP_NAME = "clef-gguf"
INGRESS = "ClefIngress"
# A replica waits for the ingress's relay of an adapter at most this many first-use bounds: the ingress's own
# fetch is bounded by one (then a 503), and the bytes still travel after it.
RELAY_TIMEOUT_FACTOR = 2
# Autoscaling aims at one decision running and one waiting per replica (Ray counts both): more requests in
# flight than that add a replica, up to MAX.
AUTOSCALE_TARGET_ONGOING = 2
# The ingress admits (as the plain server does) max_queue bodies being read and max_queue decisions; Ray's
# own slots must not bind first, or requests past them would wait in Ray's proxy instead of getting our 503.
INGRESS_HEADROOM = 16  # requests being refused, /health and /v1/models, on top of the two bounds
# Where Ray reports a replica (or its node) gone or unreachable, or no replica able to take a request.
REPLICA_LOST = (RayActorError, WorkerCrashedError, NodeDiedError, DeploymentUnavailableError, ReplicaUnavailableError)


class ReplicaNotReady(RuntimeError):
    """A replica's health check before its model answered its probe decision."""


@dataclass(frozen=True)
class RaySettings:
    """The application's settings: `clef-gguf serve --ray`'s, or a `serve run` config's `args` (settings_from_args),
    each table as `clef-gguf serve` has it, its bounds included (settings.py), and passed on as it is."""

    __pydantic_config__ = {"extra": "forbid"}  # (a config's `args`: a mistyped name is refused)

    model: str | Path  # the GGUF's path, the same on every node that runs a replica or the ingress
    serve: ServeSettings = field(default_factory=ServeSettings)  # the ingress's: its key, queue, HTTP limits, log format
    # Each replica's model (paths the same on every node; n_threads, default 1, also the CPUs Ray reserves for it).
    load: LoadOptions = field(default_factory=LoadOptions)
    # Its fine-tunes, loaded by every replica, each keeping its own LRU; the ingress resolves their names as they do.
    adapter_set: AdapterSet = field(default_factory=AdapterSet)
    scale: RayScale = field(default_factory=RayScale)  # replicas, or autoscale "MIN:MAX"; GPUs per replica

    def spec(self) -> ModelSpec:
        """The model every replica loads and the ingress encodes for: llama.cpp's threads default to 1 (Ray's CPUs)."""
        return ModelSpec(self.model, replace(self.load, n_threads=self.load.n_threads or 1), self.adapter_set)


_SETTINGS = TypeAdapter(RaySettings)
# What a config file sets elsewhere: Ray's HTTP proxy (the config's http_options) and cluster are not the application's.
NOT_IN_ARGS = {
    ("serve", "host"): "http_options.host",
    ("serve", "port"): "http_options.port",
    ("scale", "address"): "RAY_ADDRESS",
}


def autoscale_range(text: str) -> tuple[int, int]:
    """RayScale.autoscale's "MIN:MAX", or a ValueError."""
    low, sep, high = text.partition(":")
    if not sep or not low.isdigit() or not high.isdigit():
        raise ValueError(f"autoscale is MIN:MAX (two whole numbers), not {text!r}")
    if not 1 <= int(low) <= int(high):
        raise ValueError(f"autoscale needs 1 <= MIN <= MAX, not {low}:{high}")
    return int(low), int(high)


# Where each setting lives in a config's `args` (flat before 0.2.0; the adapters under `load` in 0.2.0): named when
# one is found in another table.
_TABLES = (("serve", ServeSettings), ("serve.limits", HttpLimits), ("load", LoadOptions), ("adapter_set", AdapterSet))
_HOMES = {
    f.name: NOT_IN_ARGS.get((table, f.name), f"{table}.{f.name}")  # host, port, address: Ray's own, not a table's
    for table, cls in (*_TABLES, ("scale", RayScale))
    for f in fields(cls)
    if f.name != "limits"
}


def _refusal(error: Any) -> str:
    """One pydantic error as `where: why`, saying where a setting found in the wrong table belongs."""
    where = ".".join(map(str, error["loc"]))
    home = _HOMES.get(str(error["loc"][-1]))
    if error["type"] == "unexpected_keyword_argument" and home is not None and home != where:
        return f"{where}: not a setting here; it is {home} (args are nested by table: docs/serving.md)"
    return f"{where}: {error['msg']}"


_PLAIN = {int, float, str, bool, Path, type(None)}


def check_values(table: type, values: Any, within: str = "") -> None:
    """The values a table (settings.py's) is made from, as a config gives them, held as load() holds its keywords
    (settings.check_table) before pydantic's lax mode turns True into 1 and "2048" into 2048: each setting of a plain
    type (numbers, text, paths, or None), in every table within, named by its place in the config (load.n_threads).
    Others (an enum, a tuple) are pydantic's alone."""
    if not isinstance(values, dict):
        return
    hints = get_type_hints(table)
    for f in fields(table):
        hint = hints[f.name]
        if f.name not in values:
            continue
        if is_dataclass(hint):
            check_values(hint, values[f.name], f"{within}{f.name}.")
        elif set(get_args(hint) or (hint,)) <= _PLAIN:
            check_value(within + f.name, values[f.name], hint, f.metadata)


def validated(args: dict[str, Any]) -> RaySettings:
    """`args` (RaySettings' fields, each table as a dict) held to the tables' types and bounds, the autoscale range
    and the API key checked; a SettingsError naming each setting refused (unknown ones too)."""
    check_values(RaySettings, args)  # as given, before pydantic's lax mode turns True into 1: refused as load() refuses
    try:
        settings = _SETTINGS.validate_python(args)
        if settings.scale.autoscale is not None:
            autoscale_range(settings.scale.autoscale)
        if settings.serve.api_key is not None:
            check_api_key(settings.serve.api_key)
    except ValidationError as e:
        raise SettingsError("; ".join(map(_refusal, e.errors()))) from None
    except ValueError as e:
        raise SettingsError(str(e)) from None
    return settings


class ReplicaScheduler:
    """The ingress's scheduler (decision.Scheduler): each prompt to a model replica, as many at once as admitted.

    The plain server's ComputeScheduler decides on the model's compute thread; here a decision is a remote call, and with
    max_queue of them in flight every replica has work, the rest waiting in the replicas' own queues."""

    def __init__(self, replicas: DeploymentHandle, max_queue: int) -> None:
        self._replicas = replicas
        self.max_queue = max_queue
        self.pending = 0  # admitted and not yet answered; touched on the event loop only
        self.figures = ReplicaFigures()  # each replica's per-adapter counts, as its decisions bring them

    async def decide(self, request: Prompt) -> Decision:
        if self.pending >= self.max_queue:
            raise queue_full(self.pending)
        self.pending += 1
        submitted = time.perf_counter()
        try:
            decision: Decision = await self._replicas.decide.remote(request)
        except (*REPLICA_LOST, BackPressureError) as e:
            # The request may have been decided by a replica that died before it answered: deciding is a
            # pure function of the prompt, so the client's retry is safe, and it is the client's to make (a
            # prompt that crashed one replica would crash each it was retried on here).
            message = f"the model replica deciding this request was lost or none is available ({type(e).__name__}); retry"
            raise overloaded(message) from e
        except RayTaskError as e:
            # The replica's own error, as decide raised it there: the app maps it as the plain server does.
            raise e.cause from None
        finally:
            self.pending -= 1
        if decision.adapters is not None:
            self.figures.take(*decision.adapters)
        finished = time.perf_counter()
        # Queued: in the replica's ComputeScheduler, in Ray's router and on the way there and back.
        queued = max(decision.queued_s, finished - submitted - decision.decide_s)
        return replace(decision, queued_s=queued, finished=finished, adapters=None)

    async def close(self) -> None:
        """Nothing to wait for here: Ray drains the replicas (graceful_shutdown_timeout_s)."""


@serve.deployment(name="ClefReplica")
class ClefReplica:
    """One loaded model, deciding on the plain server's ComputeScheduler; healthy once it has answered a decision."""

    def __init__(self, spec: ModelSpec, *, queue: int, adapter_cap: int = ServeSettings.metrics_adapter_cap) -> None:
        self.counts = AdapterCounts(adapter_cap)  # sent to the ingress with the decisions (adapter_metrics.py)
        context = serve.get_replica_context()
        self.replica = context.replica_tag
        self._sent = self.counts.generation
        # A Hub source's adapters come from the ingress, which fetched them (ray_relay.py), never from the Hub.
        relay = ingress_relay(context.app_name, INGRESS, RELAY_TIMEOUT_FACTOR * spec.adapter_set.adapter_fetch_timeout)
        self.model = ClefModel(spec, self.counts, self.counts, relay)
        self.worker = ComputeScheduler(self.model, queue)
        # Through the path every request takes: a replica that cannot answer never reports healthy (Ray runs
        # a first check_health right after this constructor, and routes nothing to the replica before it passes).
        self.probe_answer: bytes | None = None
        self.probe_answer = render(self.model.decide(self.model.encode(PROBE)))
        # The model is not closed in a destructor: Ray may end the process while a decision still runs on
        # the model's compute thread (past graceful_shutdown_timeout_s), and the process's exit frees it anyway.

    async def decide(self, prompt: EncodedPrompt) -> Decision:
        """The decision of a prompt the ingress encoded: its response JSON, time queued here and deciding."""
        if prompt.model is not None and self.model.catalog.adopt(prompt.model) is None:
            # An adapter (a folder's, a source's) this replica was not asked for before: resolved here as the ingress
            # resolved it (validated against the base; the same identity, unless the file changed in between, or the
            # ingress followed a branch to a newer version, which is then taken from it anew).
            named, sources = prompt.request.named, self.model.catalog.sources
            found = await asyncio.to_thread(self.model.catalog.resolve, named)
            stale = found.identity != prompt.identity and sources is not None
            if stale and await asyncio.to_thread(sources.fetch_again, named) is not None:  # type: ignore[union-attr]
                found = await asyncio.to_thread(self.model.catalog.resolve, named)
            if found.identity != prompt.identity:  # the file changed between the ingress and here: a new version
                raise AdapterUnavailableError(
                    f"the adapter file of {found.entry.name!r} changed while the request waited: send the request again"
                )
        decision = await self.worker.decide(prompt)
        if self.counts.generation == self._sent:
            return decision
        snapshot = self.counts.snapshot(self.model.resident_adapters())
        self._sent = snapshot.generation
        return replace(decision, adapters=(self.replica, snapshot))

    def check_health(self) -> None:
        # No decision here: one would wait for the model's compute thread behind a long prompt, and a check that times out
        # (health_check_timeout_s) gets a busy, healthy replica replaced.
        if self.probe_answer is None:
            raise ReplicaNotReady("the model has not answered its probe decision")


class Doors:
    """The ingress's admission: open while serving; at shutdown closed (ClefIngress.drain), every new request then
    refused with our JSON 503, while the requests inside (`inside`, their bodies still being read included) finish."""

    def __init__(self) -> None:
        self.closed = False
        self.inside = 0  # touched on the replica's event loop only


class ShutdownGate:
    """ASGI middleware, the app's innermost (inside Observed, so a refusal has the request's id, its log line and
    its count): the doors' refusal, and the count of the requests admitted."""

    def __init__(self, app: ASGIApp, doors: Doors) -> None:
        self.app = app
        self.doors = doors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.doors.closed:
            await send_shutting_down(scope, send, "the server is shutting down; retry")
            return
        self.doors.inside += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.doors.inside -= 1


@serve.deployment(name=INGRESS, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class ClefIngress:
    """create_app over the file's PromptEncoder, deciding on the replicas (ReplicaScheduler)."""

    def __init__(self, replicas: DeploymentHandle, spec: ModelSpec, settings: ServeSettings, hub: HubAccess) -> None:
        # The replicas' spec: their prompt limit, ubatch and vision tower, their adapters' names and identities.
        # Its own fetches too (it resolves each request's name first): their counts labelled with its own replica tag.
        hub.apply()  # (before the encoder's catalog fetches a pinned adapter)
        self.counts = AdapterCounts(settings.metrics_adapter_cap)
        self.replica = serve.get_replica_context().replica_tag
        self.encoder = open_encoder(spec, self.counts)
        configure_access_log()  # this process's stderr, which Ray shows on the driver's (log_to_driver) and keeps in its logs
        self.scheduler = ReplicaScheduler(replicas, settings.max_queue)
        self.settings = settings
        self.doors = Doors()

    def __serve_build_asgi_app__(self) -> FastAPI:  # Ray builds the ingress's ASGI app with this, in the replica
        figures = self.scheduler.figures  # the replicas': /metrics' per-adapter series, /v1/models' resident ones
        own = {"replica": self.replica}
        # (the decided series label an adapter's name as the ingress's own counts do: --metrics-adapter-cap names)
        adapters = AdapterView(lambda: [*figures.labelled(), (own, self.counts.snapshot())], figures.resident, self.counts.label)
        app = settings_app(self.encoder, self.settings, scheduler=self.scheduler, behind_ray=True, adapters=adapters)
        app.user_middleware.append(Middleware(ShutdownGate, doors=self.doors))  # appended: innermost (add_middleware: outermost)
        return app

    async def adapter_file(self, name: str) -> tuple[bytes, str] | ClefError:
        """(a replica's relay) The adapter file this ingress's sources delivered for `name`, and its revision."""
        return await adapter_file(self.encoder.catalog.sources, name)

    async def drain(self, timeout_s: float) -> int:
        """`serve --ray`'s first step at SIGTERM (run()): refuse new requests, and wait up to timeout_s for those
        admitted; how many are still inside. Refused with our 503 rather than gone: once the application is deleted,
        Ray's proxy answers its own 404 (text/plain, "Path ... not found") to every request, which no client retries."""
        self.doors.closed = True
        deadline = time.monotonic() + timeout_s
        while self.doors.inside and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.doors.inside


def _scaling(scale: RayScale) -> dict[str, Any]:
    if scale.autoscale is None:
        return {"num_replicas": scale.replicas or 1}
    low, high = autoscale_range(scale.autoscale)
    autoscaling = {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": AUTOSCALE_TARGET_ONGOING}
    return {"autoscaling_config": autoscaling}


def build_app(settings: RaySettings) -> serve.Application:
    """The application: the ingress over the model replicas, sized and scaled by `settings`."""
    s = settings.serve
    spec = settings.spec()
    # No access log line per request: at small models' decisions, Ray's logging is a visible share of a core.
    quiet = {"enable_access_log": False}
    # Each deployment is bound with only the settings it uses: a change of scale alone then changes no replica's
    # arguments, and Ray adds or removes replicas instead of replacing them all.
    # max_ongoing_requests, the decisions Ray hands a replica at once: they wait there in a ComputeScheduler (the model's compute
    # thread, first come first served, as in `clef-gguf serve`), the replica's queue length steering Ray's router (power of two
    # choices). Not 1, though a replica decides one batch at a time: requests the router cannot place wait in it, each
    # probing the replicas' queue lengths again and again, and that probing took more CPU than the decisions
    # (docs/benchmarks.md, "Measurements behind the code"). At the ingress's own bound (max_queue), no request
    # waits in the router. A replica that dies takes its queue with it: each of those requests gets a 503 with
    # Retry-After.
    replicas = ClefReplica.options(
        max_ongoing_requests=s.max_queue,
        ray_actor_options={"num_cpus": spec.options.n_threads, "num_gpus": settings.scale.gpus},
        graceful_shutdown_timeout_s=s.drain_timeout,
        logging_config=quiet,
        **_scaling(settings.scale),
    ).bind(spec, queue=s.max_queue, adapter_cap=s.metrics_adapter_cap)
    ingress = ClefIngress.options(
        max_ongoing_requests=2 * s.max_queue + INGRESS_HEADROOM,
        graceful_shutdown_timeout_s=s.drain_timeout,
        logging_config=quiet,
    )
    return ingress.bind(replicas, spec, s, HubAccess.from_environment())


def settings_from_args(args: dict[str, Any]) -> RaySettings:
    """A config file's `args`: RaySettings' fields, each table a dict of its settings (others refused); without an
    api_key, CLEF_GGUF_API_KEY in the environment sets it, as for `clef-gguf serve` (an empty one is refused)."""
    for (table, name), where in NOT_IN_ARGS.items():
        if isinstance(args.get(table), dict) and name in args[table]:
            raise SettingsError(f"{table}.{name} is not the application's: set {where} instead")
    served = args.get("serve", {})
    if isinstance(served, dict) and "api_key" not in served and API_KEY_ENV in os.environ:
        args = {**args, "serve": {**served, "api_key": os.environ[API_KEY_ENV]}}
    return validated(args)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """`serve run`'s entry (import_path: clef_gguf.server.ray_serve:app_builder)."""
    return build_app(settings_from_args(args))
