"""OTLP export of the same metrics `/metrics` serves: every `metrics.otlp_interval` seconds the app's
Prometheus registry is read (`registry.collect()`, what a scrape reads) and pushed over OTLP/HTTP, so one set
of series feeds both a Prometheus scraper and an OpenTelemetry collector.

Conversion (cumulative temporality, start time = when the exporter was made): counters become monotonic
sums (`lockgate:requests_total` -> `lockgate.requests_total`), gauges gauges, histograms explicit-bucket
histograms (Prometheus' cumulative `le` buckets turned into per-bucket counts; min and max, which Prometheus
does not keep, are left unset). Other metric types are not exported.

Each process pushes its own values as its own OTLP resource (`service.instance.id` = hostname-pid): under
`lockgate serve --workers N` every worker's cumulative series stay apart at the collector, instead of being
taken for one instance whose totals jump back and forth.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
from collections.abc import Callable, Sequence
from typing import cast

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric as PromMetric

log = logging.getLogger("lockgate.observe")
_SCOPE = InstrumentationScope("lockgate")
_CUMULATIVE = AggregationTemporality.CUMULATIVE


def _name(prometheus_name: str) -> str:
    return prometheus_name.replace(":", ".")


def _labels(labels: dict[str, str], drop: str = "") -> dict[str, str]:
    return {k: v for k, v in labels.items() if k != drop}


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


class MetricsPusher:
    """Reads `registry` and exports it through `exporter`: on demand (`push`), or every `interval` seconds
    (`run`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        exporter: MetricExporter,
        interval: float,
        service_name: str,
        clock_ns: Callable[[], int],
        *,
        instance_id: str = "",
    ) -> None:
        """`instance_id`: this process's `service.instance.id` ("" = `process_instance_id()`)."""
        self._registry = registry
        self._exporter = exporter
        self._interval = interval
        # Set explicitly, over OTEL_RESOURCE_ATTRIBUTES: an id shared by the workers would merge their series.
        self._resource = Resource.create(
            {"service.name": service_name, "service.instance.id": instance_id or process_instance_id()}
        )
        self._clock_ns = clock_ns
        self._start = clock_ns()

    def collect(self) -> MetricsData:
        """The registry's series now, as OTLP metrics."""
        now = self._clock_ns()
        metrics = [m for family in self._registry.collect() if (m := self._metric(family, now)) is not None]
        scope = ScopeMetrics(scope=_SCOPE, metrics=metrics, schema_url="")
        return MetricsData(
            resource_metrics=[ResourceMetrics(resource=self._resource, scope_metrics=[scope], schema_url="")]
        )

    def push(self) -> None:
        """Export the series now (blocking: call it off the event loop)."""
        self._exporter.export(self.collect())

    async def run(self) -> None:
        """Push every `interval` seconds until cancelled; a failed push is logged and retried next time."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                await asyncio.to_thread(self.push)
            except Exception:
                log.exception("pushing metrics over OTLP failed")

    def shutdown(self) -> None:
        """A last push, then the exporter's shutdown (blocking)."""
        try:
            self.push()
        finally:
            self._exporter.shutdown()

    def _metric(self, family: PromMetric, now: int) -> Metric | None:
        name, doc = _name(family.name), family.documentation
        if family.type == "counter":
            points = [
                self._point(s.labels, s.value, now) for s in family.samples if s.name.endswith("_total")
            ]
            data: Sum | Gauge | Histogram = Sum(
                data_points=points, aggregation_temporality=_CUMULATIVE, is_monotonic=True
            )
            name = name if name.endswith("_total") else f"{name}_total"
        elif family.type == "gauge":
            data = Gauge(data_points=[self._point(s.labels, s.value, now) for s in family.samples])
        elif family.type == "histogram":
            data = Histogram(data_points=self._histogram(family, now), aggregation_temporality=_CUMULATIVE)
        else:
            return None
        return Metric(name=name, description=doc, unit=family.unit or None, data=data)

    def _point(self, labels: dict[str, str], value: float, now: int) -> NumberDataPoint:
        return NumberDataPoint(
            attributes=labels, start_time_unix_nano=self._start, time_unix_nano=now, value=value
        )

    def _histogram(self, family: PromMetric, now: int) -> list[HistogramDataPoint]:
        buckets: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        counts: dict[tuple[tuple[str, str], ...], float] = {}
        sums: dict[tuple[tuple[str, str], ...], float] = {}
        for s in family.samples:
            key = _key(_labels(s.labels, drop="le"))
            if s.name.endswith("_bucket"):
                buckets.setdefault(key, []).append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                counts[key] = s.value
            elif s.name.endswith("_sum"):
                sums[key] = s.value
        points = []
        for key, cumulative in buckets.items():
            cumulative.sort()
            bounds = [le for le, _ in cumulative if not math.isinf(le)]
            per_bucket = _per_bucket([count for _, count in cumulative])
            points.append(
                HistogramDataPoint(
                    attributes=dict(key),
                    start_time_unix_nano=self._start,
                    time_unix_nano=now,
                    count=int(counts.get(key, cumulative[-1][1])),
                    sum=sums.get(key, 0.0),
                    bucket_counts=per_bucket,
                    explicit_bounds=bounds,
                    # Prometheus keeps no min or max: None leaves the OTLP fields unset.
                    min=cast(float, None),
                    max=cast(float, None),
                )
            )
        return points


def process_instance_id() -> str:
    """This process's OTLP `service.instance.id`: hostname-pid, distinct for each worker of one host."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _per_bucket(cumulative: Sequence[float]) -> list[int]:
    """Prometheus' cumulative bucket counts (the last one +Inf) as OTLP's count per bucket."""
    out, before = [], 0.0
    for count in cumulative:
        out.append(int(count - before))
        before = count
    return out
