"""The OTLP push of the Prometheus registry: exact conversion of counters, gauges and histograms, and the
app pushing its series (a last push at shutdown) to the exporter it was given."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import msgspec
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    Sum,
)
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import MetricsConfig
from gateway.generation.prompts import PromptRenderer
from gateway.observe.otlp_metrics import MetricsPusher
from tests.conftest import MODEL, OutcomeLog, Tenancy, make_config, serving


class Captured(MetricExporter):
    """Keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[MetricsData] = []
        self.closed = False

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> MetricExportResult:
        self.batches.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        self.closed = True


def metrics_of(batch: MetricsData) -> dict[str, Metric]:
    [resource] = batch.resource_metrics
    [scope] = resource.scope_metrics
    return {m.name: m for m in scope.metrics}


def number_points(metric: Metric) -> Sequence[NumberDataPoint]:
    assert isinstance(metric.data, Sum | Gauge)
    return metric.data.data_points


def test_counters_gauges_and_histograms_convert_exactly() -> None:
    registry = CollectorRegistry()
    counter = PromCounter("lockgate:things", "Things.", ["tenant"], registry=registry)
    counter.labels("acme").inc(3)
    counter.labels("beta").inc()
    PromGauge("lockgate:depth", "Depth.", registry=registry).set(7)
    histogram = PromHistogram(
        "lockgate:wait_seconds", "Wait.", ["class"], buckets=(0.1, 1.0), registry=registry
    )
    for value in (0.05, 0.5, 0.7, 5.0):
        histogram.labels("batch").observe(value)
    ticks = iter([1_000, 2_000, 3_000])
    pusher = MetricsPusher(registry, Captured(), 15.0, "lockgate", lambda: next(ticks))
    metrics = metrics_of(pusher.collect())

    things = metrics["lockgate.things_total"]
    assert isinstance(things.data, Sum)
    assert things.data.is_monotonic
    assert things.data.aggregation_temporality == AggregationTemporality.CUMULATIVE
    values = {p.attributes["tenant"]: p.value for p in things.data.data_points if p.attributes}
    assert values == {"acme": 3.0, "beta": 1.0}
    assert {(p.start_time_unix_nano, p.time_unix_nano) for p in things.data.data_points} == {(1_000, 2_000)}
    [depth] = number_points(metrics["lockgate.depth"])
    assert isinstance(metrics["lockgate.depth"].data, Gauge)
    assert depth.value == 7.0
    wait = metrics["lockgate.wait_seconds"]
    assert isinstance(wait.data, Histogram)
    [point] = wait.data.data_points
    assert point.attributes == {"class": "batch"}
    assert list(point.explicit_bounds) == [0.1, 1.0]
    assert list(point.bucket_counts) == [1, 2, 1]  # per bucket: <= 0.1, <= 1.0, above
    assert point.count == 4
    assert point.sum == 6.25
    # What goes on the wire: the protobuf the OTLP exporter sends, min and max left unset.
    [wire] = encode_metrics(pusher.collect()).resource_metrics
    histograms = [m.histogram for m in wire.scope_metrics[0].metrics if m.name == "lockgate.wait_seconds"]
    [encoded] = histograms[0].data_points
    assert list(encoded.bucket_counts) == [1, 2, 1]
    assert not encoded.HasField("min")


async def test_the_app_pushes_its_series_and_a_last_time_at_shutdown(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    captured = Captured()
    # A long interval: only the push at shutdown happens within the test.
    config = msgspec.structs.replace(make_config(), metrics=MetricsConfig(otlp_interval=3600.0))
    app = create_app(
        config,
        engine=sim_engine,
        renderer=renderer,
        tenants=tenancy.store,
        sink=outcomes,
        metric_exporter=captured,
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, headers=tenancy.consumer_headers) as http:
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        assert captured.batches == []
    [batch] = captured.batches
    assert captured.closed
    metrics = metrics_of(batch)
    requests = [p for p in number_points(metrics["lockgate.requests_total"]) if p.attributes]
    assert any(
        p.attributes["route"] == "/v1/chat/completions" and p.attributes["status"] == "200" and p.value == 1
        for p in requests
        if p.attributes
    )
    generated = sum(p.value for p in number_points(metrics["lockgate.generation_tokens_total"]))
    assert generated == 3
    assert isinstance(metrics["lockgate.time_to_first_token_seconds"].data, Histogram)
