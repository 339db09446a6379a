"""Series read at scrape time from the state the gateway already keeps: the router's view of every engine
replica, the admission queue (by priority class), the quota meter's counters and a leased store's keys, the
safety gate's decision and stage failure counts, the guard pools' backlogs, and the overload gate's counts
(requests shed at the door never reach the request metrics).

Nothing on the request path feeds these: each scrape reads the live objects (in the event loop, where they
are changed, so a scrape never sees one half-updated).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from gateway.idempotency.replay import OUTCOMES as IDEMPOTENCY_OUTCOMES
from gateway.observe.metrics import PREFIX
from gateway.overload import OverloadGate
from gateway.result_cache.cache import ResultCache
from guard.backlog import Backlog
from policy.quota.lease import LeasedQuotaStore
from routing.admission_types import CLASSES, Klass
from routing.replicas import Replica

BREAKER_STATES = ("closed", "open", "half_open")
# Quota meter counter -> exported counter (policy.quota.meter names its counters).
QUOTA_COUNTERS = {
    "reserved": (
        "quota_reservations",
        "Reservations the quota store took: each ends settled (quota_settlements, quota_settle_noops) or "
        "given up (quota_settle_failures).",
    ),
    "settled": ("quota_settlements", "Reservations settled with the usage their request had."),
    "settle_noop": (
        "quota_settle_noops",
        "Settlements of reservations the store had closed already (settled, voided or expired): no change.",
    ),
    "denied": ("quota_denials", "Reservations the quota store denied (429 rate_limit_exceeded)."),
    "fail_open": ("quota_fail_open", "Requests admitted unmetered while the quota store was unreachable."),
    "fail_closed": ("quota_fail_closed", "Requests refused (503) while the quota store was unreachable."),
    "pool_exhausted": ("quota_busy", "Requests refused (503 quota_busy): every store connection busy."),
    "settle_given_up": ("quota_settle_failures", "Settlements given up after every retry."),
    "settle_retried": ("quota_settle_retries", "Settlement attempts retried."),
    # A leased store's (policy.quota.lease), read from its own counters.
    "lease_taken": ("quota_leases", "Quota leases taken on the shared store."),
    "lease_grants": (
        "quota_lease_grants",
        "Requests granted from a quota lease, without a store round trip.",
    ),
    "lease_misses": ("quota_lease_misses", "Requests of a leased store that reserved on the shared store."),
    "lease_denied": ("quota_lease_denials", "Quota leases the shared store refused (its buckets were low)."),
    "lease_failed": (
        "quota_lease_failures",
        "Quota leases not taken: the shared store was unreachable or busy.",
    ),
}
# What a leased store counts and the series carry: its leases, and the settling of a lease, which leaves a
# tenant over-charged when given up as a request's does (its `pool_exhausted` refused no request).
LEASE_COUNTERS = frozenset(
    {*(key for key in QUOTA_COUNTERS if key.startswith("lease_")), "settle_given_up", "settle_retried"}
)


class ServiceCollector:
    """Engine, queue, quota and guard series of one app's services."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        queue_depth: Callable[[Klass], int],
        quota_counters: Counter[str],
        guard_counts: Counter[tuple[str, str, str]],
        *,
        stage_failures: Counter[tuple[str, str, str]] | None = None,
        guard_backlogs: Mapping[str, Backlog] | None = None,
        overload: OverloadGate | None = None,
        leases: LeasedQuotaStore | None = None,
        idempotency: Counter[str] | None = None,
        result_cache: ResultCache | None = None,
        # Counts of every session event (the keys are the events, all present).
        sessions: Counter[str] | None = None,
        # Routed requests by (route, model, reason) (`gateway.generation.orchestration`).
        route_decisions: Counter[tuple[str, str, str]] | None = None,
    ) -> None:
        self._routes = route_decisions if route_decisions is not None else Counter()
        self._replicas = replicas
        self._result_cache = result_cache
        self._idempotency = idempotency
        self._sessions = sessions
        self._overload = overload
        self._queue_depth = queue_depth
        self._quota = quota_counters
        # A leased quota store: its counters (LEASE_COUNTERS of them, added to the meter's) and its keys.
        self._leases = leases
        self._lease: Mapping[str, int] = leases.counters if leases is not None else {}
        self._guard = guard_counts
        self._stage_failures = stage_failures if stage_failures is not None else Counter()
        self._backlogs = guard_backlogs if guard_backlogs is not None else {}

    def collect(self) -> Iterable[Metric]:
        """The series as of now."""
        yield from self._engines()
        depth = GaugeMetricFamily(
            f"{PREFIX}admission_queue_depth",
            "Requests waiting in the admission queue, by priority class.",
            labels=("class",),
        )
        for klass in CLASSES:
            depth.add_metric((klass,), self._queue_depth(klass))
        yield depth
        for key, (name, doc) in QUOTA_COUNTERS.items():
            value = self._quota.get(key, 0) + (self._lease.get(key, 0) if key in LEASE_COUNTERS else 0)
            yield CounterMetricFamily(f"{PREFIX}{name}", doc, value=value)
        if self._leases is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}quota_lease_keys",
                "Bucket sets (keys) the leased quota store holds leases or learned limits for (bounded: keys "
                "without a lease are forgotten past the bound).",
                value=self._leases.keys_known,
            )
        yield from self._guards()
        if self._idempotency is not None:
            yield _counted(
                "idempotency_requests",
                "Requests with an Idempotency-Key, by outcome: ran (kept: its answer stored for retries), "
                "replayed (answered from the store), in_use / reused (409), unavailable (503).",
                "outcome",
                IDEMPOTENCY_OUTCOMES,
                self._idempotency,
            )
        if self._sessions is not None:
            yield _counted(
                "session_events",
                "Session events: created, step (recorded), replayed (a retried step answered from its "
                "record), in_progress / conflict / out_of_order (409), migrated, and ends by reason.",
                "event",
                list(self._sessions),
                self._sessions,
            )
        routes = CounterMetricFamily(
            f"{PREFIX}route_decisions",
            "Requests to a route (a model name that chooses the model), by route version, the model that "
            "served or was refused, and why: rule:<name>, default, fallback:<why> (it served after the one "
            "before was refused), refused:<why> (saturated or unhealthy: the next was tried).",
            labels=("route", "target", "reason"),
        )
        for (route, target, reason), count in sorted(self._routes.items()):
            routes.add_metric((route, target, reason), count)
        yield routes
        if self._result_cache is not None:
            yield from self._cache(self._result_cache)
        if self._overload is not None:
            yield from self._door(self._overload)

    def _cache(self, cache: ResultCache) -> Iterable[Metric]:
        counts = cache.counts
        lookups = CounterMetricFamily(
            f"{PREFIX}result_cache_lookups",
            "Result cache lookups of deterministic requests: hit (answered without an engine), miss, error "
            "(the store failed: generated).",
            labels=("result",),
        )
        for result in ("hit", "miss", "error"):
            lookups.add_metric((result,), counts.get(result, 0))
        yield lookups
        yield CounterMetricFamily(
            f"{PREFIX}result_cache_saved_tokens",
            "Prompt and completion tokens of the answers served from the result cache (no engine computed "
            "them).",
            value=counts.get("saved_tokens", 0),
        )
        yield CounterMetricFamily(
            f"{PREFIX}result_cache_kept",
            "Generated answers kept in the result cache.",
            value=counts.get("kept", 0),
        )
        yield CounterMetricFamily(
            f"{PREFIX}result_cache_lookup_seconds",
            "Seconds spent on result cache lookups (over lookups_total: the mean cost of one).",
            value=cache.lookup_seconds,
        )

    def _engines(self) -> Iterable[Metric]:
        labels = ("replica", "pool")
        p = f"{PREFIX}engine_"
        gauges = {
            "queue_depth": GaugeMetricFamily(
                f"{p}queue_depth",
                "Sequences running and waiting on the replica, as the router counts them.",
                labels=labels,
            ),
            "kv_utilisation": GaugeMetricFamily(
                f"{p}kv_utilisation",
                "Fraction of the replica's KV cache in use (1 when unknown).",
                labels=labels,
            ),
            "in_flight": GaugeMetricFamily(
                f"{p}in_flight", "The gateway's requests in flight on the replica.", labels=labels
            ),
            "kv_capacity_tokens": GaugeMetricFamily(
                f"{p}kv_capacity_tokens", "The replica's KV cache size in tokens.", labels=labels
            ),
            "held_tokens": GaugeMetricFamily(
                f"{p}held_tokens", "KV tokens the gateway's requests hold on the replica.", labels=labels
            ),
            "sequences": GaugeMetricFamily(
                f"{p}sequences",
                "Sequences the gateway's requests run on the replica (one per choice).",
                labels=labels,
            ),
            "sequence_limit": GaugeMetricFamily(
                f"{p}sequence_limit",
                "Most sequences the gateway runs on the replica at once: what the engine runs plus "
                "routing.replicas.engine_queue (0 = not known, no limit).",
                labels=labels,
            ),
            "routable": GaugeMetricFamily(
                f"{p}routable", "1 when the router may send requests to the replica.", labels=labels
            ),
        }
        breaker = GaugeMetricFamily(
            f"{p}breaker_state", "1 for the replica's circuit breaker state.", labels=(*labels, "state")
        )
        for replica in self._replicas:
            ids = (replica.replica_id, replica.pool)
            gauges["queue_depth"].add_metric(ids, replica.queue_depth)
            gauges["kv_utilisation"].add_metric(ids, replica.kv_utilisation)
            gauges["in_flight"].add_metric(ids, replica.in_flight)
            gauges["kv_capacity_tokens"].add_metric(ids, replica.kv_capacity_tokens)
            gauges["held_tokens"].add_metric(ids, replica.held_tokens)
            gauges["sequences"].add_metric(ids, replica.sequences)
            gauges["sequence_limit"].add_metric(ids, replica.sequence_limit)
            gauges["routable"].add_metric(ids, 1.0 if replica.routable else 0.0)
            state = replica.breaker_state
            for candidate in BREAKER_STATES:
                breaker.add_metric((*ids, candidate), 1.0 if candidate == state else 0.0)
        yield from gauges.values()
        yield breaker

    def _door(self, overload: OverloadGate) -> Iterable[Metric]:
        shed = CounterMetricFamily(
            f"{PREFIX}shed_requests",
            "Generation requests shed at the door (503 overloaded), by reason: concurrency, cpu, in_flight "
            "or loop_lag.",
            labels=("reason",),
        )
        for reason, count in sorted(overload.shed.items()):
            shed.add_metric((reason,), count)
        yield shed
        yield GaugeMetricFamily(
            f"{PREFIX}in_flight_requests",
            "Generation requests this process holds (arrival to last byte), as the overload gate counts.",
            value=overload.in_flight,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}event_loop_lag_seconds",
            "Event-loop lag that persisted through the overload gate's recent probes.",
            value=overload.monitor.lag,
        )
        if overload.limit is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}concurrency_limit",
                "The adaptive concurrency limit on generation requests ([overload] adaptive).",
                value=overload.limit.limit,
            )
        if overload.cpu is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}cpu_utilisation",
                "The serving process's CPU utilisation the overload gate measured ([overload] cpu_shedding).",
                value=overload.cpu.utilisation,
            )
            yield GaugeMetricFamily(
                f"{PREFIX}cpu_shed_fraction",
                "The share of new generation requests the CPU signal sheds.",
                value=overload.cpu.shed_fraction,
            )

    def _guards(self) -> Iterable[Metric]:
        decisions = CounterMetricFamily(
            f"{PREFIX}guard_decisions",
            "Safety gate decisions by direction, source (rules, model, band, fail_open, fail_closed, "
            "audit_backpressure) and action.",
            labels=("direction", "source", "action"),
        )
        fail_open: Counter[str] = Counter({"input": 0, "output": 0})
        for (direction, source, action), count in sorted(self._guard.items()):
            decisions.add_metric((direction, source, action), count)
            if source == "fail_open":
                fail_open[direction] += count
        yield decisions
        opened = CounterMetricFamily(
            f"{PREFIX}fail_open",
            "Checks the safety gate let through unchecked: a guard failed and the policy fails open.",
            labels=("direction",),
        )
        for direction, count in sorted(fail_open.items()):
            opened.add_metric((direction,), count)
        yield opened
        failures = CounterMetricFamily(
            f"{PREFIX}guard_stage_failures",
            "Guard stage runs that failed, by direction, stage (name@version) and reason: input (the item "
            "itself could not be scored: not counted on the breaker), timeout, overloaded (not called: its "
            "engine too busy to answer in time), unavailable (breaker open), error.",
            labels=("direction", "stage", "reason"),
        )
        for key, count in sorted(self._stage_failures.items()):
            failures.add_metric(key, count)
        yield failures
        backlog = GaugeMetricFamily(
            f"{PREFIX}guard_backlog_seconds",
            "Seconds a guard call made now would take on its engine pool, behind the calls in flight "
            "(measured speed; 0 before a call has completed).",
            labels=("pool",),
        )
        for pool, work in sorted(self._backlogs.items()):
            backlog.add_metric((pool,), work.expected_wait())
        yield backlog


def _counted(
    name: str, doc: str, label: str, keys: Sequence[str], counts: Counter[str]
) -> CounterMetricFamily:
    """A counter family `lockgate:<name>_total` with one series per key of `keys` (`label`)."""
    family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=(label,))
    for key in keys:
        family.add_metric((key,), counts.get(key, 0))
    return family
