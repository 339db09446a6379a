"""The scrape-time series: quota meter counters, gate decision and stage failure counts, guard backlogs,
overload gate, replicas."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.collectors import ServiceCollector
from guard.backlog import Backlog
from tests.backends import FakeClock


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def replica(replica_id: str, state: str, routable: bool) -> Any:
    return SimpleNamespace(
        replica_id=replica_id,
        pool="default",
        queue_depth=3,
        kv_utilisation=0.25,
        in_flight=2,
        kv_capacity_tokens=1000,
        held_tokens=250,
        sequences=3,
        sequence_limit=18,
        routable=routable,
        breaker_state=state,
    )


def test_series_are_read_from_the_live_objects_at_each_scrape() -> None:
    quota: Counter[str] = Counter(
        {"denied": 2, "fail_open": 1, "fail_closed": 3, "settle_given_up": 1, "reserved": 7, "settled": 5}
    )
    quota["settle_noop"] = 1
    guard: Counter[tuple[str, str, str]] = Counter(
        {
            ("input", "fail_open", "allow"): 2,
            ("output", "fail_open", "allow"): 1,
            ("input", "rules", "block"): 4,
        }
    )
    overload: Any = SimpleNamespace(
        shed={"in_flight": 5, "loop_lag": 0},
        in_flight=7,
        monitor=SimpleNamespace(lag=0.0),
        limit=None,
        cpu=None,
    )
    depth = [4]
    failures = Counter({("input", "judge@1", "overloaded"): 3, ("output", "judge@1", "timeout"): 1})
    clock = FakeClock()
    backlog = Backlog(clock)
    backlog.begin(100)
    clock.advance(1.0)
    backlog.end(100, completed=True)  # 100 tokens per second
    backlog.begin(300)
    registry = CollectorRegistry()
    registry.register(
        ServiceCollector(
            [replica("r0", "closed", True), replica("r1", "open", False)],
            lambda klass: depth[0] if klass == "interactive" else 1,
            quota,
            guard,
            stage_failures=failures,
            guard_backlogs={"guard": backlog},
            overload=overload,
        )
    )
    got = samples(registry)
    p = "lockgate:"
    assert got[(f"{p}quota_denials_total", ())] == 2
    assert got[(f"{p}quota_fail_open_total", ())] == 1
    assert got[(f"{p}quota_fail_closed_total", ())] == 3
    assert got[(f"{p}quota_settle_failures_total", ())] == 1
    assert got[(f"{p}quota_settle_retries_total", ())] == 0
    # At rest every reservation is accounted for: 7 = 5 settled + 1 no-op + 1 given up.
    assert got[(f"{p}quota_reservations_total", ())] == 7
    assert got[(f"{p}quota_settlements_total", ())] == 5
    assert got[(f"{p}quota_settle_noops_total", ())] == 1
    assert got[(f"{p}fail_open_total", (("direction", "input"),))] == 2
    assert got[(f"{p}fail_open_total", (("direction", "output"),))] == 1
    block = (("action", "block"), ("direction", "input"), ("source", "rules"))
    assert got[(f"{p}guard_decisions_total", block)] == 4
    shed = (("direction", "input"), ("reason", "overloaded"), ("stage", "judge@1"))
    assert got[(f"{p}guard_stage_failures_total", shed)] == 3
    timed_out = (("direction", "output"), ("reason", "timeout"), ("stage", "judge@1"))
    assert got[(f"{p}guard_stage_failures_total", timed_out)] == 1
    # 300 tokens in flight and a typical call's 100, at 100 tokens per second.
    assert got[(f"{p}guard_backlog_seconds", (("pool", "guard"),))] == pytest.approx(4.0)
    assert got[(f"{p}shed_requests_total", (("reason", "in_flight"),))] == 5
    assert got[(f"{p}in_flight_requests", ())] == 7
    assert got[(f"{p}admission_queue_depth", (("class", "interactive"),))] == 4
    assert got[(f"{p}admission_queue_depth", (("class", "batch"),))] == 1
    r1 = (("pool", "default"), ("replica", "r1"))
    assert got[(f"{p}engine_routable", r1)] == 0
    assert got[(f"{p}engine_held_tokens", r1)] == 250
    assert got[(f"{p}engine_sequences", r1)] == 3
    assert got[(f"{p}engine_sequence_limit", r1)] == 18
    assert got[(f"{p}engine_breaker_state", (*r1[:1], ("replica", "r1"), ("state", "open")))] == 1
    assert got[(f"{p}engine_breaker_state", (*r1[:1], ("replica", "r1"), ("state", "closed")))] == 0
    # Nothing is cached: the next scrape sees what changed.
    quota["denied"] += 1
    depth[0] = 0
    backlog.end(300, completed=False)
    got = samples(registry)
    assert got[(f"{p}quota_denials_total", ())] == 3
    assert got[(f"{p}admission_queue_depth", (("class", "interactive"),))] == 0
    assert got[(f"{p}guard_backlog_seconds", (("pool", "guard"),))] == 0.0


def test_the_adaptive_limit_and_the_cpu_signal_are_shown_only_when_on() -> None:
    def scrape(limit: Any, cpu: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        overload: Any = SimpleNamespace(
            shed={}, in_flight=0, monitor=SimpleNamespace(lag=0.0), limit=limit, cpu=cpu
        )
        registry = CollectorRegistry()
        registry.register(ServiceCollector([], lambda klass: 0, Counter(), Counter(), overload=overload))
        return samples(registry)

    off = scrape(None, None)
    assert not [name for name, _ in off if "concurrency_limit" in name or "cpu_" in name]
    on = scrape(SimpleNamespace(limit=12), SimpleNamespace(utilisation=0.9, shed_fraction=0.25))
    assert on[("lockgate:concurrency_limit", ())] == 12
    assert on[("lockgate:cpu_utilisation", ())] == 0.9
    assert on[("lockgate:cpu_shed_fraction", ())] == 0.25


def test_a_leased_stores_counters_add_its_leases_and_their_settling_but_refuse_no_request() -> None:
    meter = Counter({"settle_given_up": 2, "pool_exhausted": 1})
    leases = Counter(
        {"lease_taken": 4, "lease_grants": 60, "lease_misses": 3, "settle_given_up": 1, "pool_exhausted": 5}
    )
    registry = CollectorRegistry()
    store: Any = SimpleNamespace(counters=leases, keys_known=7)
    registry.register(ServiceCollector([], lambda klass: 0, meter, Counter(), leases=store))
    got = samples(registry)
    assert got[("lockgate:quota_lease_keys", ())] == 7
    assert got[("lockgate:quota_leases_total", ())] == 4
    assert got[("lockgate:quota_lease_grants_total", ())] == 60
    assert got[("lockgate:quota_lease_misses_total", ())] == 3
    assert got[("lockgate:quota_lease_denials_total", ())] == 0
    # A lease given up leaves a tenant over-charged, as a request's settlement does; the lease's own busy
    # retries refused no request, so `quota_busy` is the meter's alone.
    assert got[("lockgate:quota_settle_failures_total", ())] == 3
    assert got[("lockgate:quota_busy_total", ())] == 1
