"""Prometheus multiprocess mode, for `lockgate serve --workers N`: N worker processes share one port, so a
scrape lands on one of them and must answer for all.

The serve parent sets `PROMETHEUS_MULTIPROC_DIR` to a fresh, empty directory before it spawns the workers.
prometheus_client reads it when it is first imported (in each spawned worker) and from then on keeps every
metric value in a per-process memory-mapped file there; `aggregate` merges those files into one exposition:
counters and histograms summed over every worker that ever ran, gauges per their `multiprocess_mode`. When a
worker dies the parent calls `mark_worker_dead`, which drops the dead worker's `live*` gauges (its counters
stay: what it counted happened).

The scrape-time `ServiceCollector` reads live objects of one process, which the merged files never see.
`CollectorMirror` copies its series into file-backed metrics on a timer in each worker: counters by the
increase since the last pass, gauges by value, each gauge family with the multiprocess mode its meaning
calls for (`GAUGE_MODES`). The mirror's metrics are registered in no registry (the app's registry already
has the collector itself, for single-worker scrapes and each worker's OTLP push), so nothing is counted
twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from gateway.observe.metrics import PREFIX

log = logging.getLogger("lockgate.observe")

ENV = "PROMETHEUS_MULTIPROC_DIR"
LiveMode = Literal["livesum", "livemax", "liveall"]

# How each of the ServiceCollector's gauges merges across workers. Every mode is a `live*` one: a dead
# worker's state is no one's state.
GAUGE_MODES: Mapping[str, LiveMode] = {
    # Each worker's own admission queue, in-flight requests and KV reservations: the total is the sum.
    f"{PREFIX}admission_queue_depth": "livesum",
    # Each worker's own leased quota store keeps its own keys.
    f"{PREFIX}quota_lease_keys": "livesum",
    f"{PREFIX}in_flight_requests": "livesum",
    f"{PREFIX}engine_in_flight": "livesum",
    f"{PREFIX}engine_held_tokens": "livesum",
    f"{PREFIX}engine_sequences": "livesum",
    # Each worker applies the limit to its own sequences.
    f"{PREFIX}engine_sequence_limit": "livemax",
    # Read from the engine's own load report, which already counts every worker's requests (plus a worker's
    # few not yet reported): each worker sees about the same figure, so summing would count it N times.
    f"{PREFIX}engine_queue_depth": "livemax",
    f"{PREFIX}engine_kv_utilisation": "livemax",
    f"{PREFIX}engine_kv_capacity_tokens": "livemax",
    # Each worker probes its own event loop; the worst one is what overload alerts need.
    f"{PREFIX}event_loop_lag_seconds": "livemax",
    # Each worker keeps its own health view and circuit breaker per replica, and they can disagree for a
    # while: a max would show one replica both `closed` and `open`, a sum would no longer be 0/1. Kept per
    # worker (a `pid` label), so `max by (replica, pool, state)` or `sum by (...)` is the reader's choice.
    f"{PREFIX}engine_routable": "liveall",
    f"{PREFIX}engine_breaker_state": "liveall",
}
# A gauge not listed above is kept per worker: never summed or maxed into a figure that may be false.
DEFAULT_GAUGE_MODE: LiveMode = "liveall"


def multiprocess_dir() -> Path | None:
    """The multiprocess directory when this process runs in prometheus_client's multiprocess mode, else None.

    Raises RuntimeError when `PROMETHEUS_MULTIPROC_DIR` is set but prometheus_client was imported before it
    was (its value class is chosen at import): metrics would stay in memory and scrapes would miss them.
    """
    raw = os.environ.get(ENV, "")
    if not raw:
        return None
    if prometheus_values.ValueClass is prometheus_values.MutexValue:
        raise RuntimeError(
            f"{ENV} was set after prometheus_client was imported; set it before the process starts"
        )
    return Path(raw)


def aggregate(path: Path) -> bytes:
    """The Prometheus text exposition of every worker's metrics in `path` (reads files: call it off the
    event loop)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))  # type: ignore[no-untyped-call]
    return generate_latest(registry)


def mark_worker_dead(pid: int, path: Path | None = None) -> None:
    """Drop a dead worker's `live*` gauges from the aggregate (its counters and histograms stay). The serve
    parent calls it for each worker that exits; `path` defaults to `PROMETHEUS_MULTIPROC_DIR`."""
    directory = path if path is not None else os.environ.get(ENV, "")
    if not directory:
        raise RuntimeError(f"no multiprocess directory: pass `path` or set {ENV}")
    mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


Labels = tuple[str, ...]
M = TypeVar("M", Counter, Gauge)


async def repeat(
    work: Callable[[], None], interval: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
) -> None:
    """`work()` now and every `interval` seconds until cancelled, and once more then (a worker's metric files
    brought up to date: a worker that stops cleanly leaves its final counts). A failed pass is logged and
    retried next time."""

    def logged() -> None:
        try:
            work()
        except Exception:
            log.exception("bringing the metric files of this worker up to date failed")

    try:
        while True:
            logged()
            await sleep(interval)
    finally:
        logged()


class CollectorMirror:
    """Copies a scrape-time collector's counter and gauge families into file-backed metrics of this process:
    once per `sync()`, and every `interval` seconds in `run()`. Other metric types are not mirrored.

    `registry`: where the mirror's own metrics are registered (None, the default, in a worker: the merged
    files are their only reader; tests pass one to read them in a single process).
    """

    def __init__(
        self,
        collector: Collector,
        interval: float,
        *,
        registry: CollectorRegistry | None = None,
        modes: Mapping[str, LiveMode] = GAUGE_MODES,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._collector = collector
        self._interval = interval
        self._registry = registry
        self._modes = modes
        self._sleep = sleep
        self._counters: dict[str, Counter] = {}
        self._gauges: dict[str, Gauge] = {}
        self._labelnames: dict[str, Labels] = {}
        # Invariant: after each pass a mirrored counter holds the sum of its source's increases (resets
        # included), and `_last` holds the source's values as of that pass.
        self._last: dict[tuple[str, Labels], float] = {}
        self._shown: dict[str, set[Labels]] = {}

    def sync(self) -> None:
        """One pass: read the collector now and bring the mirrored metrics up to date."""
        shown: dict[str, set[Labels]] = {}
        for family in self._collector.collect():
            if family.type == "counter":
                for s in family.samples:
                    if s.name.endswith("_total"):
                        self._count(family.name, family.documentation, s.labels, s.value)
            elif family.type == "gauge":
                seen = shown.setdefault(family.name, set())
                for s in family.samples:
                    seen.add(self._gauge(family.name, family.documentation, s.labels, s.value))
        # A file-backed series cannot be removed (prometheus_client has no removal in multiprocess mode):
        # one the collector no longer yields, such as a replica taken out, reads 0 from now on.
        for name, before in self._shown.items():
            for values in before - shown.get(name, set()):
                self._child(self._gauges[name], values).set(0)
        self._shown = shown

    async def run(self) -> None:
        """Mirror now and every `interval` seconds until cancelled, and once more then (so a worker that
        stops cleanly leaves its final counts)."""
        await repeat(self.sync, self._interval, self._sleep)

    def _count(self, name: str, doc: str, labels: Mapping[str, str], value: float) -> None:
        counter = self._counters.get(name)
        if counter is None:
            names = self._labelnames[name] = tuple(labels)
            counter = self._counters[name] = Counter(name, doc, names, registry=self._registry)
        values = self._values(name, labels)
        key = (name, values)
        last = self._last.get(key, 0.0)
        # A source counter that went down was reset (a rebuilt object): all of its new value is new counts.
        increase = value - last if value >= last else value
        child = self._child(counter, values)  # made even at 0: a scrape shows the series, as the source's
        if increase > 0:
            child.inc(increase)
        self._last[key] = value

    def _gauge(self, name: str, doc: str, labels: Mapping[str, str], value: float) -> Labels:
        gauge = self._gauges.get(name)
        if gauge is None:
            names = self._labelnames[name] = tuple(labels)
            mode = self._modes.get(name, DEFAULT_GAUGE_MODE)
            gauge = self._gauges[name] = Gauge(
                name, doc, names, registry=self._registry, multiprocess_mode=mode
            )
        values = self._values(name, labels)
        self._child(gauge, values).set(value)
        return values

    def _values(self, name: str, labels: Mapping[str, str]) -> Labels:
        """The label values in the order of the names the family was first seen with."""
        return tuple(labels[n] for n in self._labelnames[name])

    @staticmethod
    def _child(metric: M, values: Labels) -> M:
        return metric.labels(*values) if values else metric
