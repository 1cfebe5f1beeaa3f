"""The FastAPI application: routes, API key, and the mapping of every error to TypeSafe's (or Workers AI's) shapes.

Every error it answers is a row of the error table (errors.py), Starlette's own 404 and 405 too:
a new status goes there."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import NOT_FOUND, UNAUTHORIZED, ClefError
from ..runtime.catalog import JEV_ALIAS  # the SDKs' default model name: the catalog resolves it to the base
from ..runtime.failures import Failure, Invalid, internal, problem_of
from ..runtime.protocols import Encoder, Model
from ..runtime.state_cache import StateCache
from ..settings import HttpLimits, LogFormat, ServeSettings, body_limit
from . import workers_ai
from .adapter_metrics import AdapterCollector, AdapterView, Labels, local_view
from .decision import Scheduler
from .guard import Names, OwnOrigin, send_problem
from .intake import Intake
from .metrics import CONTENT_TYPE, Metrics, create_metrics
from .observe import Observed, note_decision, response_headers
from .problems import ApiError, overloaded, render_problem, starlette_problem
from .ui import mount_ui, source_names
from .worker import ComputeScheduler

MODEL_SHA256_HEADER = "Clef-Model-Sha256"
_ROUTES = "this server answers POST /v1/systemone and POST [/client/v4]/accounts/ACCOUNT_ID/ai/run/@cf/cloudflare/clef"


def check_api_key(key: str) -> str:
    """The key, if a client can send it as it is: raises ValueError for an empty one (which would turn
    authentication off unnoticed) and for any but visible ASCII characters (HTTP carries header values as
    bytes that clients encode differently: latin-1, UTF-8)."""
    if not key:
        raise ValueError("the key is empty; give none to serve without a key")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError("the key must be visible ASCII characters (no spaces, no control or non-ASCII characters)")
    return key


def _require_key(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode()

    async def check(request: Request) -> None:  # async: FastAPI would run a plain def on a thread pool
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), expected):
            message = "a valid API key is required: Authorization: Bearer KEY"
            raise ApiError(UNAUTHORIZED, message)  # with its WWW-Authenticate: Bearer

    return check


def _models_listing(model: Encoder, resident: frozenset[str]) -> dict[str, Any]:
    """The base, its alias and every adapter name a request may try, each with its state: `resident` (loaded: here, or
    on a Ray replica), `on_disk` (its file validated, or kept by the disk cache: loaded when a request names it) or
    `refused` (with the reason a request naming it would be refused with)."""
    written = model.written  # taken at load: nothing of the base is read from its path while it serves
    limit = model.max_prompt_tokens
    described = f"Clef decision model {model.name} ({model.path.name}) on llama.cpp; prompts up to {limit} tokens"
    about = f"a fine-tune over {model.name} (an adapter file): name it in `model`"
    tunes = []
    for listed in model.adapter_listing():
        tune = {"name": listed.name, "description": about, "release_date": written, "state": "on_disk"}
        if listed.refused is not None:
            tune |= {"state": "refused", "reason": listed.refused}
        elif listed.identity in resident:
            tune["state"] = "resident"
        tunes.append(tune)
    return {
        "models": [
            {"name": model.name, "description": described, "release_date": written, "state": "resident"},
            {"name": JEV_ALIAS, "description": f"alias of {model.name}", "release_date": written, "state": "resident"},
            *tunes,
        ]
    }


def _problem(request: Request, problem: Failure | Invalid) -> Response:
    status, headers, body = render_problem(request.scope["path"], problem)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


async def send_shutting_down(scope: Scope, send: Send, message: str) -> None:
    """Answer from ASGI middleware, outside FastAPI's handlers: the JSON 503 that clients retry elsewhere."""
    await send_problem(scope, send, overloaded(message, close=True))


class AnswerCutOff:
    """At SIGTERM, uvicorn cancels the requests still running after --drain-timeout: each gets a JSON 503
    (which clients retry elsewhere) instead of uvicorn's plain-text 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started:
                raise
            await send_shutting_down(scope, send, "the server shut down before this request was decided; retry")
            # Not re-raised: the request is answered, and this is the top of its task (uvicorn would log a traceback).


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Failure)  # an ApiError too
    async def failure(request: Request, e: Failure) -> Response:
        return _problem(request, e)

    @app.exception_handler(Invalid)
    async def invalid(request: Request, e: Invalid) -> Response:
        return _problem(request, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:  # unknown path, wrong method
        message = str(e.detail)
        if e.status_code == NOT_FOUND.status:
            message = f"no route here for {request.method} {request.url.path}: {_ROUTES}"
        return _problem(request, ApiError(starlette_problem(e.status_code), message, dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> Response:  # a bug, not the client's fault
        return _problem(request, internal(e))


@dataclass
class Service:
    """What the routes do, over the app's parts: a model (to encode, or to decide too), the worker that decides, the
    intake that reads bodies, the metrics. create_app puts its methods on routes."""

    model: Encoder
    worker: Scheduler
    intake: Intake
    metrics: Metrics
    adapters: AdapterView  # what /v1/models says is loaded, and /metrics' per-adapter series

    async def answer(self, request: Request) -> tuple[bytes, dict[str, str]]:
        """Read, validate and decide one System One request: its response JSON and timing header."""
        arrived = time.perf_counter()
        prompt = await self.intake.request(request)  # read, validated and tokenized: known to fit the model
        parsed = time.perf_counter()
        try:
            decision = await self.worker.decide(prompt)
        except ClefError as e:
            # By its row (errors.py), as intake maps it: an adapter's file refused, or gone or changed since intake,
            # when it was loaded to decide (here, or on a Ray replica, whose error arrives as raised: its source, the
            # ingress's relay, unavailable for now too): a 4xx, or a 503 for now; a row the server did not expect, a 500.
            raise problem_of(e, None, prompt.named_by) from e
        self.metrics.decided(prompt, decision)
        note_decision(request, prompt, decision)
        # Server-Timing tells a client where its latency went: reading, waiting, deciding (with how many others),
        # handing back; and whether the state cache spared the prefill of its state.
        back = time.perf_counter() - decision.finished
        cache = f"hit {decision.cached_tokens} tokens" if decision.cached_tokens else "miss"
        timing = (
            f"read;dur={(parsed - arrived) * 1e3:.3f}, queue;dur={decision.queued_s * 1e3:.3f}, "
            f'decide;dur={decision.decide_s * 1e3:.3f};desc="batch of {decision.batch}", back;dur={back * 1e3:.3f}, '
            f'cache;desc="{cache}"'
        )
        # The identity of the model version that answered (an adapter file replaced on disk is a new version):
        # what an answers file records as model_sha256, so an operator can tell which version answered.
        return decision.body, {"Server-Timing": timing, MODEL_SHA256_HEADER: prompt.identity}

    async def systemone(self, request: Request) -> Response:
        body, headers = await self.answer(request)
        return Response(body, media_type="application/json", headers=response_headers(headers))

    async def workers_ai_run(self, request: Request, model_id: str) -> Response:
        # Any account id: the server holds one model, and the key (when set) is the access control.
        workers_ai.check_model(model_id)
        body, headers = await self.answer(request)
        return Response(workers_ai.success(body), media_type="application/json", headers=response_headers(headers))

    async def models(self) -> JSONResponse:
        # Off the event loop: listing a folder validates the adapter files it has not seen (cached by signature).
        listing = await asyncio.to_thread(_models_listing, self.model, self.adapters.resident())
        return JSONResponse(listing, headers=response_headers())

    async def health(self) -> JSONResponse:
        status = {
            "status": "ok",
            "model": self.model.name,
            "max_prompt_tokens": self.model.max_prompt_tokens,
            "ubatch": self.model.ubatch,
            "images": self.model.image_limits is not None,
            "pending": self.worker.pending,
            "reading": self.intake.reading,
        }
        return JSONResponse(status, headers=response_headers())

    async def scrape(self) -> Response:
        # generate_latest reads every series under their locks: microseconds for this registry, on the event loop.
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE, headers=response_headers())


def create_app(
    model: Encoder,
    *,
    api_key: str | None = None,
    max_queue: int = ServeSettings.max_queue,
    max_body_bytes: int | None = None,
    limits: HttpLimits | None = None,
    owns_model: bool = True,
    scheduler: Scheduler | None = None,
    log_format: LogFormat = "text",
    behind_ray: bool = False,
    ui: bool = True,
    names: Names | None = None,
    allowed_origins: tuple[str, ...] = (),
    adapters: AdapterView | None = None,
) -> FastAPI:
    """A System One app over a loaded model; with owns_model it closes the model at shutdown.

    max_queue bounds the requests being read and the requests admitted to decide, each; max_body_bytes
    (default: from the model's token limit and whether it takes images, settings.body_limit) bounds a body,
    raw and decoded; a body must arrive as fast as `limits` say (body_timeout, body_grace, min_body_rate).
    Decisions are model.answer_batch's on the model's compute thread (ComputeScheduler) unless a scheduler is
    given: the Ray Serve ingress (ray_serve.py) passes one that forwards them to model replicas, with a
    model that only encodes. Each request gets an id and an access log line in log_format (observe.py), and is
    counted in the app's metrics (metrics.py, GET /metrics); behind_ray leaves X-Request-Id to Ray's proxy, which
        adds its own (the id it hands the app). With ui, GET / is the page that asks it (ui.py). Only requests to its
    `names` (default: loopback's, IP addresses) from no web page or its own (or `allowed_origins`') are answered (guard.py).
    `adapters`: the per-adapter counts and what is loaded (adapter_metrics.py: the model's observer's, or the Ray
    replicas'); by default only what the model says is loaded, and no per-adapter series."""
    if scheduler is None:
        if not isinstance(model, Model):
            raise TypeError(f"{type(model).__name__} cannot decide: pass a scheduler")
        scheduler = ComputeScheduler(model, max_queue)
    limit = body_limit(model.max_prompt_tokens, model.image_limits is not None) if max_body_bytes is None else max_body_bytes
    # the image allowance is for images: the text of a body stays within the text-only limit
    text_limit = body_limit(model.max_prompt_tokens) if max_body_bytes is None else None
    intake = Intake(model, max_queue, limit, limits or HttpLimits(), text_limit)
    service = Service(model, scheduler, intake, *_counted(model, scheduler, intake, adapters))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn has drained the connections (or timed out): finish the running decide, then free.
        await scheduler.close()
        await asyncio.to_thread(intake.close)
        if owns_model:
            model.close()

    # redirect_slashes: Starlette's redirect to the path with(out) its final slash writes its Location from the Host.
    app = FastAPI(title="clef-gguf", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None, redirect_slashes=False)
    _install_error_handlers(app)
    app.add_middleware(AnswerCutOff)
    # outside AnswerCutOff (its 503 gets the answers' headers), inside Observed (added last: it logs and counts every
    # answer, the 503 and the guard's refusals included)
    app.add_middleware(OwnOrigin, names=names or Names(ServeSettings.host), origins=allowed_origins)
    app.add_middleware(Observed, metrics=service.metrics, log_format=log_format, echo_id=not behind_ray)
    _add_routes(app, service, api_key)
    if ui:
        mount_ui(app, sources=source_names(model))
    return app


def _counted(model: Encoder, scheduler: Scheduler, intake: Intake, adapters: AdapterView | None) -> tuple[Metrics, AdapterView]:
    """The app's metrics, the per-adapter series of `adapters` among them (by default: no counts, the model's loaded).
    An adapter's name is labelled in the decided requests' series as in the per-adapter ones: by `adapters`' Labels,
    else the app's own (of the default --metrics-adapter-cap names)."""
    cache = getattr(model, "state_cache", None)  # a ClefModel's; an encoder (the Ray ingress) has none
    if adapters is None:
        adapters = local_view(None, model.resident_adapters if isinstance(model, Model) else frozenset)
    label = adapters.label or Labels(ServeSettings.metrics_adapter_cap)
    metrics = create_metrics(model, scheduler, intake, cache if isinstance(cache, StateCache) else None, label)
    metrics.registry.register(AdapterCollector(adapters.labelled))
    return metrics, adapters


def _add_routes(app: FastAPI, service: Service, api_key: str | None) -> None:
    auth = [Depends(_require_key(api_key))] if api_key else []
    app.add_api_route("/v1/systemone", service.systemone, methods=["POST"], dependencies=auth)
    for prefix in workers_ai.PREFIXES:
        app.add_api_route(prefix + workers_ai.ROUTE, service.workers_ai_run, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/models", service.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/health", service.health, methods=["GET"])  # unauthenticated on purpose: probes carry no key
    app.add_api_route("/metrics", service.scrape, methods=["GET"], dependencies=auth)
