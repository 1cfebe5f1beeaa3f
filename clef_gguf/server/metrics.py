"""Prometheus metrics of one app (GET /metrics), in prometheus_client's registry of its own.

A registry per app, not prometheus_client's global one: several apps in one process (tests, an ingress and
its tooling) would otherwise register the same series twice. Figures already counted elsewhere are read when
scraped (the scheduler's and the intake's counts, the state cache's bytes and entries); only what no counter
holds yet is counted here, from each request's answer (observe.py) and each decision (app.py).

State cache hits and misses are counted per decided request whose state prefix the cache keeps (one of
state_cache.MIN_PREFIX_TOKENS or more, runtime/model.py cuts it off): a hit when the backbone state after it came
from the cache. The template's preamble, cached once for every request, is in cached tokens but is no hit.

The decided requests' series carry a `model` label: the name of the model that decided them, the base's or an
adapter's, the name its request's model resolved to once (runtime/catalog.py's ModelRef: EncodedPrompt.model_name). An adapter is
counted under the name the request asked for: one file may answer to two names (two --adapter NAME=FILE, or a name
and a folder's file), and its identity alone would count one name's requests under the other. The base's many names
(its own, clef, jev-latest, ...) count as its own, so no client can grow the series by the names it sends; an
adapter's name is labelled as the per-adapter series label it (adapter_metrics.Labels: the first
--metrics-adapter-cap names served their own, the later ones `_other`), so that the many names an adapter source may
fetch cannot grow them either. Only decided requests are counted: a name refused or unknown never becomes a label.

clef_batch_prompts counts each batch once, by the decision the worker marks as its batch's first (Decision.leads):
on Ray too, where the decisions come back from the replicas. (A batch whose first request was given up before its
answer, its client gone, is not counted: it is the decided requests that are counted here.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from ..errors import OVERLOADED
from ..runtime.protocols import Encoder, Prompt
from ..runtime.state_cache import StateCache, split_at_prefix
from .decision import Decision, Scheduler

# From a cached short prompt on the demo model (milliseconds) to a long prompt on a CPU (a minute).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # prompts decided together: one, up to --parallel (at most 64)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Reading(Protocol):
    reading: int  # request bodies being read (intake.Intake)


@dataclass(frozen=True)
class Metrics:
    registry: CollectorRegistry
    requests: Counter  # route, status
    latency: Histogram  # route: arrival to the end of the answer
    phases: Histogram  # phase: queue (admitted, waiting for the model), compute (deciding)
    prompt_tokens: Counter
    cached_tokens: Counter
    images: Counter
    in_flight: Gauge
    refused: Counter
    cache_hits: Counter
    cache_misses: Counter
    batch_prompts: Histogram
    label: Callable[[str], str]  # the `model` label of a decided request's model name

    def answered(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        if status == OVERLOADED.status:
            self.refused.inc()

    def decided(self, prompt: Prompt, decision: Decision) -> None:
        if decision.leads:
            self.batch_prompts.observe(decision.batch)
        model = self.label(prompt.model_name)  # (its answer's model: runtime/catalog.py resolved it once)
        self.phases.labels("queue", model).observe(decision.queued_s)
        self.phases.labels("compute", model).observe(decision.decide_s)
        self.prompt_tokens.labels(model).inc(len(prompt.tokens))
        self.cached_tokens.labels(model).inc(decision.cached_tokens)
        self.images.labels(model).inc(len(prompt.images))
        if prompt.state_prefix > prompt.preamble and split_at_prefix(prompt.state_prefix, len(prompt.tokens)):
            (self.cache_hits if decision.cached_tokens >= prompt.state_prefix else self.cache_misses).labels(model).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _gauge(registry: CollectorRegistry, name: str, help_text: str, read: Callable[[], float]) -> None:
    """A gauge whose value is read when scraped."""
    Gauge(name, help_text, registry=registry).set_function(read)


def create_metrics(
    model: Encoder, scheduler: Scheduler, reading: Reading, state_cache: StateCache | None, adapter_label: Callable[[str], str]
) -> Metrics:
    """The app's series. reading: the intake (its `reading` count); state_cache: the model's, when it decides here
    (under Ray the states are the replicas' own, out of the ingress's reach); adapter_label: an adapter name's label
    (adapter_metrics.Labels)."""
    r = CollectorRegistry()
    ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
    info = Gauge("clef_model_info", "The loaded model (always 1).", ["name", "type", "context", "ubatch"], registry=r)
    kind = "text" if model.image_limits is None else "vision"
    info.labels(model.name, kind, str(model.max_prompt_tokens), str(model.ubatch)).set(1)
    _gauge(
        r,
        "clef_decisions_queued",
        "Requests admitted to decide and not yet answered (running or waiting).",
        lambda: scheduler.pending,
    )
    _gauge(r, "clef_bodies_reading", "Request bodies being read, decoded and tokenized.", lambda: reading.reading)
    if state_cache is not None:
        _gauge(r, "clef_state_cache_bytes", "Bytes the state cache's entries hold.", lambda: state_cache.nbytes)
        _gauge(r, "clef_state_cache_budget_bytes", "The state cache's budget (--state-cache).", lambda: state_cache.budget)
        _gauge(r, "clef_state_cache_entries", "States the state cache holds.", lambda: len(state_cache))
    metrics = Metrics(
        registry=r,
        requests=Counter("clef_requests", "Requests answered, by route and status.", ["route", "status"], registry=r),
        latency=Histogram(
            "clef_request_duration_seconds",
            "Seconds from a request's arrival to its answer.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        ),
        phases=Histogram(
            "clef_decision_seconds",
            "Seconds a decided request waited for the model (queue) and was decided (compute), by model.",
            ["phase", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        ),
        prompt_tokens=Counter("clef_prompt_tokens", "Prompt tokens of the decided requests.", ["model"], registry=r),
        cached_tokens=Counter(
            "clef_cached_tokens", "Prompt tokens whose backbone state the state cache gave.", ["model"], registry=r
        ),
        images=Counter("clef_images", "Images of the decided requests.", ["model"], registry=r),
        in_flight=Gauge("clef_requests_in_flight", "Requests being answered.", registry=r),
        refused=Counter(
            "clef_requests_refused", "Requests refused with 503 (queue full, bodies, replicas, shutdown).", registry=r
        ),
        cache_hits=Counter("clef_state_cache_hits", "Decided requests whose state the state cache gave.", ["model"], registry=r),
        cache_misses=Counter(
            "clef_state_cache_misses", "Decided requests whose cacheable state it did not have.", ["model"], registry=r
        ),
        batch_prompts=Histogram(
            "clef_batch_prompts", "Prompts decided together in one batch.", buckets=BATCH_BUCKETS, registry=r
        ),
        label=lambda name: name if name == model.name else adapter_label(name),
    )
    for counter in (metrics.prompt_tokens, metrics.cached_tokens, metrics.images, metrics.cache_hits, metrics.cache_misses):
        counter.labels(model.name)  # the base's series from the start, at 0 (each adapter's from its first decision)
    return metrics
