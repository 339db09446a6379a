"""Request metrics in vLLM's naming style, observed once per request from its `RequestTimeline`.

Everything lives on one `CollectorRegistry` per app (no process-global registry): two apps in one process, as
in tests, never share a series. Labels are bounded: route templates, HTTP statuses, tenants (their ids, keyed
digests of them, or none, as `[metrics] tenant_label` says; bounded by the tenant store), priority classes,
model and guard versions (name@version, bounded by the registry: a canary's latencies next to its stable
version's), error codes (ours). Never a request id or a key.

Under `lockgate serve --workers N` prometheus_client runs in multiprocess mode (gateway/observe/multiproc.py):
the same metrics are then backed by per-worker files that `/metrics` merges; counters and histograms sum, and
each gauge declares how it merges (`multiprocess_mode`).

A request's increments are counted in a `Tally` (gateway/observe/tally.py) and reach the series when the
registry is read (and, in a worker, every `metrics.multiprocess_interval` seconds): the series themselves lock
on every increment.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.config import SloConfig
from gateway.observe import slo
from gateway.observe.tally import Incrementable, Tally, value_of
from gateway.observe.timeline import RequestTimeline
from gateway.secret import ServerSecret

PREFIX = "lockgate:"
# Buckets after vLLM's (its TTFT, inter-token and end-to-end histograms), with finer low ends for a gateway.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)
# Gateway stages (auth, quota, rendering, guards): sub-millisecond to a few seconds.
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0)
# fmt: on
# Error statuses that are refusals (the gateway declined the work), as opposed to failures (502, 500) or a
# client that left (499).
_REFUSALS = frozenset({400, 401, 403, 404, 405, 409, 413, 422, 429, 503, 504})


class _Children:
    """A labelled counter's values by label values (`tally.value_of` each child), kept after the first
    lookup: `labels()` validates and locks on every call."""

    def __init__(self, metric: Counter) -> None:
        self._metric = metric
        self._known: dict[tuple[str, ...], Incrementable] = {}

    def __call__(self, *values: str) -> Incrementable:
        child = self._known.get(values)
        if child is None:
            child = self._known[values] = value_of(self._metric.labels(*values))
        return child


class Observer:
    """`observe` and `observe_all` of one histogram child, as prometheus_client's `observe` records them, with
    the increments counted in a `Tally`: the bucket found by bisection, one increment per bucket and one of
    the sum. `Histogram.observe` checks that the child is observable, then walks the bucket bounds in Python,
    taking a lock per increment. It reaches into the child's `_upper_bounds`, `_buckets` and `_sum`
    (prometheus_client's own, in multiprocess mode too); where a version lacks them, each value is observed
    (and nothing waits for a flush)."""

    __slots__ = ("_bounds", "_buckets", "_child", "_sum", "_totals")

    def __init__(self, child: Histogram, tally: Tally) -> None:
        self._child = child
        self._totals = tally.totals
        bounds = getattr(child, "_upper_bounds", None)
        buckets = getattr(child, "_buckets", None)
        self._sum = getattr(child, "_sum", None)
        known = bounds is not None and buckets is not None and len(bounds) == len(buckets)
        self._bounds: list[float] | None = bounds if known and self._sum is not None else None
        self._buckets = buckets

    def observe(self, amount: float) -> None:
        """`observe(amount)`."""
        if self._bounds is None or self._buckets is None or self._sum is None:
            self._child.observe(amount)
            return
        totals = self._totals
        # The first bound >= amount, as `observe` finds it (the last bound is +Inf).
        bucket = self._buckets[bisect_left(self._bounds, amount)]
        totals[bucket] = totals.get(bucket, 0) + 1
        totals[self._sum] = totals.get(self._sum, 0) + amount

    def observe_all(self, amounts: Sequence[float]) -> None:
        """`observe(a)` for each of `amounts`."""
        if self._bounds is None or self._buckets is None or self._sum is None:
            for amount in amounts:
                self._child.observe(amount)
            return
        totals, bounds, buckets = self._totals, self._bounds, self._buckets
        for amount in amounts:
            bucket = buckets[bisect_left(bounds, amount)]
            totals[bucket] = totals.get(bucket, 0) + 1
        totals[self._sum] = totals.get(self._sum, 0) + sum(amounts)


class _Observers:
    """A labelled histogram's `Observer`s by label values, kept after the first lookup."""

    def __init__(self, metric: Histogram, tally: Tally) -> None:
        self._metric = metric
        self._tally = tally
        self._known: dict[tuple[str, ...], Observer] = {}

    def __call__(self, *values: str) -> Observer:
        observer = self._known.get(values)
        if observer is None:
            observer = self._known[values] = Observer(self._metric.labels(*values), self._tally)
        return observer


def tenant_labels(mode: Literal["id", "hash", "drop"], secret: ServerSecret | None) -> Callable[[str], str]:
    """The `tenant` label value of a tenant id, as `[metrics] tenant_label` says. "hash" without the secret
    (before the lifespan has loaded it) drops the label rather than show the id. No tenant (a request refused
    before authentication) stays ""."""
    if mode == "id":
        return str
    if mode == "drop" or secret is None:
        return lambda _: ""
    # One HMAC per tenant, not per request (tenants are bounded by the tenant store).
    digest = lru_cache(maxsize=4096)(secret.metrics_label)
    return lambda tenant: digest(tenant) if tenant else ""


class RequestMetrics:
    """The per-request series (histograms and counters) and the active-streams gauge."""

    def __init__(
        self,
        registry: CollectorRegistry,
        slo_config: SloConfig,
        tenant_label: Callable[[str], str] = str,
    ) -> None:
        self._slo = slo_config
        # The `tenant` label value of a tenant id (`tenant_labels`); the lifespan sets the keyed one of "hash"
        # once the server secret is loaded, before the first request.
        self.tenant_label = tenant_label
        # Every increment below goes through the tally; its collector, registered before the series, flushes
        # it at every read of the registry.
        self.tally = Tally()
        registry.register(self.tally.collector)
        p = PREFIX
        self.requests = Counter(
            f"{p}requests",
            "HTTP requests by route template, status and tenant.",
            ("route", "status", "tenant"),
            registry=registry,
        )
        self.rejections = Counter(
            f"{p}rejections",
            "Requests refused (4xx, 503, 504) by reason (the error code).",
            ("reason",),
            registry=registry,
        )
        self.ttft = Histogram(
            f"{p}time_to_first_token_seconds",
            "Seconds from request arrival to the engine's first token (auth, quota, guard, queue included).",
            ("class", "model"),
            registry=registry,
            buckets=TTFT_BUCKETS,
        )
        self.itl = Histogram(
            f"{p}inter_token_latency_seconds",
            "Seconds between consecutive output deltas of a request.",
            ("class", "model"),
            registry=registry,
            buckets=ITL_BUCKETS,
        )
        self.e2e = Histogram(
            f"{p}e2e_request_latency_seconds",
            "Seconds from arrival to the end of generation requests that reached admission.",
            ("class", "model"),
            registry=registry,
            buckets=E2E_BUCKETS,
        )
        self.queue_wait = Histogram(
            f"{p}queue_wait_seconds",
            "Seconds in the admission queue until dispatch (or refusal).",
            ("class", "model"),
            registry=registry,
            buckets=E2E_BUCKETS,
        )
        self.phase = Histogram(
            f"{p}request_phase_seconds",
            "Seconds per gateway phase: auth, render, quota, input_guard, queue.",
            ("phase",),
            registry=registry,
            buckets=STAGE_BUCKETS,
        )
        self.guard_latency = Histogram(
            f"{p}guard_latency_seconds",
            "Seconds per guard cascade stage run (stage: rules or the guard model's name@version).",
            ("direction", "stage"),
            registry=registry,
            buckets=STAGE_BUCKETS,
        )
        self.outcomes = Counter(
            f"{p}request_outcomes",
            "Generation requests by how they ended (the tracked outcome).",
            ("status",),
            registry=registry,
        )
        self.cancellations = Counter(
            f"{p}cancellations", "Generation requests the client cancelled.", registry=registry
        )
        self.stalls = Counter(
            f"{p}stalls", "Streams cut off because the client stopped reading.", registry=registry
        )
        self.prompt_tokens = Counter(
            f"{p}prompt_tokens", "Prompt tokens processed.", ("tenant", "model"), registry=registry
        )
        self.generation_tokens = Counter(
            f"{p}generation_tokens", "Tokens generated.", ("tenant", "model"), registry=registry
        )
        self.guard_tokens = Counter(
            f"{p}guard_tokens",
            "Generated tokens the output guard scored (charged to the tenant as usage.guard_tokens).",
            ("tenant", "model"),
            registry=registry,
        )
        self.finished = Counter(
            f"{p}requests_finished",
            "Generation requests that count toward SLO attainment, by priority class.",
            ("class",),
            registry=registry,
        )
        self.attained = Counter(
            f"{p}slo_attained_requests",
            "Completed requests that met their class's SLO targets (goodput is its rate).",
            ("class",),
            registry=registry,
        )
        # With several workers (multiprocess mode), the streams every live worker is sending now.
        self.active_streams = Gauge(
            f"{p}active_streams",
            "Streamed (SSE) responses being sent now.",
            registry=registry,
            multiprocess_mode="livesum",
        )

        # Children by label values (bounded like the series themselves).
        tally = self.tally
        self._requests = _Children(self.requests)
        self._rejections = _Children(self.rejections)
        self._phase = _Observers(self.phase, tally)
        self._guard_latency = _Observers(self.guard_latency, tally)
        self._outcomes = _Children(self.outcomes)
        self._prompt_tokens = _Children(self.prompt_tokens)
        self._generation_tokens = _Children(self.generation_tokens)
        self._guard_tokens = _Children(self.guard_tokens)
        self._finished = _Children(self.finished)
        self._attained = _Children(self.attained)
        self._cancellations = value_of(self.cancellations)
        self._stalls = value_of(self.stalls)
        self._e2e = _Observers(self.e2e, tally)
        self._queue_wait = _Observers(self.queue_wait, tally)
        self._ttft = _Observers(self.ttft, tally)
        self._itl = _Observers(self.itl, tally)

    def flush(self) -> None:
        """Hand every counted increment to its series (`Tally.flush`)."""
        self.tally.flush()

    def observe(self, t: RequestTimeline) -> None:
        """Record one ended request (called once, when its timeline ends)."""
        add = self.tally.add
        status = t.http_status
        tenant = self.tenant_label(t.tenant)
        add(self._requests(t.route or "unmatched", str(status), tenant))
        if status in _REFUSALS and t.error_code:
            add(self._rejections(t.error_code))
        for name, (start, end) in t.phases.items():
            self._phase(name).observe(end - start)
        for check in t.guard_checks:
            for run in check.runs:
                self._guard_latency(check.direction, run.guard).observe(run.latency_s)
        outcome = t.outcome
        if outcome is None:
            return
        add(self._outcomes(outcome.status))
        if outcome.status == "cancelled":
            add(self._cancellations)
        elif outcome.status == "stalled":
            add(self._stalls)
        usage = outcome.usage
        if usage.prompt_tokens:
            add(self._prompt_tokens(tenant, t.model), usage.prompt_tokens)
        if usage.completion_tokens:
            add(self._generation_tokens(tenant, t.model), usage.completion_tokens)
        if usage.guard_tokens:
            add(self._guard_tokens(tenant, t.model), usage.guard_tokens)
        klass = t.klass
        if not klass:
            return
        self._latencies(t, klass)
        targets = slo.targets_for(self._slo, klass)
        if targets is not None and slo.counts(t):
            add(self._finished(klass))
            if slo.attained(t, targets):
                add(self._attained(klass))

    def _latencies(self, t: RequestTimeline, klass: str) -> None:
        e2e = t.e2e
        if e2e is not None:
            self._e2e(klass, t.model).observe(e2e)
        queued = t.duration("queue")
        if queued is not None:
            self._queue_wait(klass, t.model).observe(queued)
        ttft = t.ttft
        if ttft is not None:
            self._ttft(klass, t.model).observe(ttft)
        gaps = t.inter_token_gaps()
        if gaps:
            self._itl(klass, t.model).observe_all(gaps)
