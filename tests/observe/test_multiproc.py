"""`/metrics` with several worker processes (prometheus_client's multiprocess mode).

prometheus_client chooses file-backed values when it is first imported, so each worker here is a child
Python process started with `PROMETHEUS_MULTIPROC_DIR` set: it counts requests, streams and tokens on its
`RequestObserver` and mirrors a real `ServiceCollector` with `CollectorMirror.sync()`, then exits. This
process (single-process mode) serves the merged scrape through the `/metrics` handler and checks the exact
sums; a dead worker's live gauges leave the scrape while its counters stay. The mirror's bookkeeping
(increases, resets, vanished series, the timer loop) is checked in this process with a registry of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.api import metrics as metrics_route
from gateway.observe.multiproc import ENV, CollectorMirror, mark_worker_dead, multiprocess_dir
from gateway.observe.otlp_metrics import MetricsPusher, process_instance_id

ROOT = Path(__file__).resolve().parents[2]
P = "lockgate:"
CHAT = {"route": "/v1/chat/completions", "status": "200", "tenant": "acme"}
R0 = {"replica": "r0", "pool": "default"}
Key = tuple[str, tuple[tuple[str, str], ...]]

# One worker: counts what its spec says on a real RequestObserver, mirrors a real ServiceCollector (quota
# denials read twice, so only the increase may count), and reports its pid and what its own OTLP push holds.
WORKER = r"""
import json, os, sys, time
from collections import Counter
from types import SimpleNamespace

from gateway.config import Config
from gateway.observe.collectors import ServiceCollector
from gateway.observe.multiproc import CollectorMirror
from gateway.observe.observer import RequestObserver
from gateway.observe.otlp_metrics import MetricsPusher
from gateway.observe.tally import value_of

spec = json.loads(sys.argv[1])
observer = RequestObserver(Config(), time.monotonic)
m = observer.metrics
# Counted as a request's metrics are, and flushed to the worker's files as its periodic flush does.
m.tally.add(value_of(m.requests.labels("/v1/chat/completions", "200", "acme")), spec["requests"])
m.flush()
m.active_streams.inc(spec["streams"])
for ttft in spec["ttfts"]:
    m.ttft.labels("interactive", "m@1").observe(ttft)
replica = SimpleNamespace(replica_id="r0", pool="default", **spec["replica"])
quota = Counter(denied=spec["denied"][0])
overload = SimpleNamespace(
    shed={"in_flight": spec["shed"]},
    in_flight=spec["in_flight"],
    monitor=SimpleNamespace(lag=spec["lag"]),
    limit=None,
    cpu=None,
)
collector = ServiceCollector(
    [replica],
    lambda klass: spec["queue"] if klass == "batch" else 0,
    quota,
    Counter({("input", "rules", "block"): spec["blocks"]}),
    overload=overload,
)
observer.watch(collector)  # as the app does: its own registry keeps the live collector
mirror = CollectorMirror(collector, 1.0)
mirror.sync()
quota["denied"] = spec["denied"][1]
mirror.sync()
pushed = MetricsPusher(observer.registry, None, 15.0, "lockgate", time.time_ns).collect()
[resource] = pushed.resource_metrics
[requests] = [x for x in resource.scope_metrics[0].metrics if x.name == "lockgate.requests_total"]
print(json.dumps({
    "pid": os.getpid(),
    "instance": resource.resource.attributes["service.instance.id"],
    "pushed_requests": requests.data.data_points[0].value,
}))
"""

A = {
    "requests": 3,
    "streams": 2,
    "ttfts": [0.05, 0.5],
    "denied": [2, 5],
    "blocks": 1,
    "queue": 4,
    "shed": 1,
    "in_flight": 3,
    "lag": 0.01,
    "replica": {
        "queue_depth": 10,
        "kv_utilisation": 0.5,
        "in_flight": 2,
        "kv_capacity_tokens": 1000,
        "held_tokens": 100,
        "sequences": 4,
        "sequence_limit": 18,
        "routable": True,
        "breaker_state": "closed",
    },
}
B = {
    "requests": 2,
    "streams": 1,
    "ttfts": [0.02],
    "denied": [1, 1],
    "blocks": 2,
    "queue": 1,
    "shed": 0,
    "in_flight": 1,
    "lag": 0.2,
    "replica": {
        "queue_depth": 12,
        "kv_utilisation": 0.75,
        "in_flight": 1,
        "kv_capacity_tokens": 1000,
        "held_tokens": 50,
        "sequences": 1,
        "sequence_limit": 10,
        "routable": False,
        "breaker_state": "open",
    },
}


def run_workers(directory: Path, *specs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Run one worker process per spec, at once, in multiprocess mode on `directory`; their reports."""
    env = {**os.environ, ENV: str(directory)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for spec in specs
    ]
    reports = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        reports.append(json.loads(out))
    return reports


def key(name: str, **labels: str) -> Key:
    return name, tuple(sorted(labels.items()))


async def scrape(directory: Path) -> dict[Key, float]:
    """`GET /metrics` of a worker whose observer runs in multiprocess mode on `directory`."""
    services: Any = SimpleNamespace(
        observer=SimpleNamespace(multiprocess_dir=directory, metrics=SimpleNamespace(flush=lambda: None)),
        config=SimpleNamespace(metrics=SimpleNamespace(require_key=False)),  # no key: the request is not read
    )
    response = await metrics_route.metrics.fn(request=None, services=services)
    return {
        key(s.name, **s.labels): float(s.value)
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
    }


async def test_a_scrape_answers_for_every_worker_and_a_dead_ones_live_gauges_leave(tmp_path: Path) -> None:
    a, b = run_workers(tmp_path, A, B)
    got = await scrape(tmp_path)

    # Counters and histograms sum over the workers; the mirrored counters by their increases only.
    assert got[key(f"{P}requests_total", **CHAT)] == 5
    ttft = {"class": "interactive", "model": "m@1"}
    assert got[key(f"{P}time_to_first_token_seconds_count", **ttft)] == 3
    assert got[key(f"{P}time_to_first_token_seconds_bucket", le="0.1", **ttft)] == 2
    assert got[key(f"{P}time_to_first_token_seconds_sum", **ttft)] == pytest.approx(0.57)
    assert got[key(f"{P}quota_denials_total")] == 6
    assert got[key(f"{P}quota_fail_open_total")] == 0
    assert got[key(f"{P}guard_decisions_total", direction="input", source="rules", action="block")] == 3
    assert got[key(f"{P}fail_open_total", direction="input")] == 0
    assert got[key(f"{P}shed_requests_total", reason="in_flight")] == 1
    # Each worker's own load sums; the engine's own report (seen alike by all) is not multiplied.
    assert got[key(f"{P}active_streams")] == 3
    assert got[key(f"{P}admission_queue_depth", **{"class": "batch"})] == 5
    assert got[key(f"{P}in_flight_requests")] == 4
    assert got[key(f"{P}engine_in_flight", **R0)] == 3
    assert got[key(f"{P}engine_held_tokens", **R0)] == 150
    assert got[key(f"{P}engine_sequences", **R0)] == 5
    assert got[key(f"{P}engine_sequence_limit", **R0)] == 18
    assert got[key(f"{P}engine_queue_depth", **R0)] == 12
    assert got[key(f"{P}engine_kv_utilisation", **R0)] == 0.75
    assert got[key(f"{P}engine_kv_capacity_tokens", **R0)] == 1000
    assert got[key(f"{P}event_loop_lag_seconds")] == 0.2
    # Breakers and health are each worker's own view: one series per worker.
    a_pid, b_pid = str(a["pid"]), str(b["pid"])
    assert got[key(f"{P}engine_breaker_state", state="closed", pid=a_pid, **R0)] == 1
    assert got[key(f"{P}engine_breaker_state", state="open", pid=b_pid, **R0)] == 1
    assert got[key(f"{P}engine_breaker_state", state="open", pid=a_pid, **R0)] == 0
    assert got[key(f"{P}engine_routable", pid=a_pid, **R0)] == 1
    assert got[key(f"{P}engine_routable", pid=b_pid, **R0)] == 0

    # Each worker pushes its own values, as its own OTLP resource.
    assert (a["pushed_requests"], b["pushed_requests"]) == (3, 2)
    assert a["instance"] != b["instance"]
    assert a["instance"].endswith(f"-{a_pid}")

    mark_worker_dead(a["pid"], tmp_path)
    after = await scrape(tmp_path)
    assert after[key(f"{P}active_streams")] == 1
    assert after[key(f"{P}admission_queue_depth", **{"class": "batch"})] == 1
    assert after[key(f"{P}engine_in_flight", **R0)] == 1
    assert after[key(f"{P}event_loop_lag_seconds")] == 0.2
    assert not [k for k in after if ("pid", a_pid) in k[1]]
    # What the dead worker counted happened: its counters and histograms stay.
    assert after[key(f"{P}requests_total", **CHAT)] == 5
    assert after[key(f"{P}quota_denials_total")] == 6
    assert after[key(f"{P}time_to_first_token_seconds_count", **ttft)] == 3


class Families:
    """A scrape-time collector over plain dicts: one labelled counter, one labelled gauge, one bare gauge."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {"a": 2}
        self.depth: dict[str, float] = {"r0": 4, "r1": 7}
        self.lag = 0.5

    def collect(self) -> Iterable[Metric]:
        sent = CounterMetricFamily("t:sent", "Sent.", labels=("peer",))
        for peer, value in self.sent.items():
            sent.add_metric((peer,), value, created=1.0)
        yield sent
        depth = GaugeMetricFamily("t:depth", "Depth.", labels=("replica",))
        for replica, value in self.depth.items():
            depth.add_metric((replica,), value)
        yield depth
        yield GaugeMetricFamily("t:lag", "Lag.", value=self.lag)


def mirrored(registry: CollectorRegistry) -> dict[Key, float]:
    return {key(s.name, **s.labels): s.value for m in registry.collect() for s in m.samples}


def test_the_mirror_counts_increases_keeps_labels_and_zeroes_vanished_gauges() -> None:
    source, registry = Families(), CollectorRegistry()
    mirror = CollectorMirror(source, 1.0, registry=registry)
    mirror.sync()
    mirror.sync()  # nothing changed: nothing counted twice
    got = mirrored(registry)
    assert got[key("t:sent_total", peer="a")] == 2
    assert got[key("t:depth", replica="r1")] == 7
    assert got[key("t:lag")] == 0.5

    source.sent.update(a=5, b=1)
    source.depth = {"r0": 1}
    source.lag = 0.0
    mirror.sync()
    got = mirrored(registry)
    assert got[key("t:sent_total", peer="a")] == 5
    assert got[key("t:sent_total", peer="b")] == 1
    assert got[key("t:depth", replica="r0")] == 1
    assert got[key("t:depth", replica="r1")] == 0  # gone from the source
    assert got[key("t:lag")] == 0

    source.sent["a"] = 3  # the source was reset and has counted 3 since
    mirror.sync()
    assert mirrored(registry)[key("t:sent_total", peer="a")] == 8


async def test_the_mirror_runs_on_its_interval_and_passes_once_more_when_stopped() -> None:
    source, registry = Families(), CollectorRegistry()
    parked = asyncio.Event()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        source.sent["a"] += 1
        if len(waits) == 2:
            parked.set()
            await asyncio.Event().wait()

    mirror = CollectorMirror(source, 0.5, registry=registry, sleep=sleep)
    task = asyncio.create_task(mirror.run())
    await parked.wait()
    assert mirrored(registry)[key("t:sent_total", peer="a")] == 3  # passes before each wait
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert waits == [0.5, 0.5]
    assert mirrored(registry)[key("t:sent_total", peer="a")] == 4  # the last pass at cancellation


def test_multiprocess_mode_is_on_only_when_set_before_prometheus_client_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert multiprocess_dir() is None
    # This process imported prometheus_client without the variable: its metrics live in memory only.
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match=ENV):
        multiprocess_dir()


def test_each_process_is_its_own_otlp_resource() -> None:
    assert process_instance_id().endswith(f"-{os.getpid()}")
    unused: Any = None  # collect() never exports
    pusher = MetricsPusher(CollectorRegistry(), unused, 15.0, "lockgate", lambda: 0, instance_id="gw-1")
    [resource] = pusher.collect().resource_metrics
    assert resource.resource.attributes["service.instance.id"] == "gw-1"
