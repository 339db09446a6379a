"""The fair admission queue: which waiting request is dispatched next, and which are refused at once.

A pure, synchronous data structure: no asyncio, no I/O, no clock of its own. Every method that needs the time
takes `now` (seconds on the scheduler's injected clock); the async scheduler that waits for engine capacity
wraps it. Every operation is O(log n) in the number of queued tickets (indexed binary heaps per class, per
tenant and per deadline; nothing scans the queue).

Order of service (`pop`)
    1. Priority class: interactive before batch. Queue-age guard: while the oldest waiting batch ticket has
       waited `batch_max_wait` seconds or more, the batch class is served before interactive. Every pop then
       serves batch until no batch ticket is that old, so an aged ticket is dispatched after at most as many
       batch pops as there are batch tickets queued: batch is never starved by sustained interactive load.
    2. Within a class, tenants by virtual token counter (start-time fair queueing): the backlogged tenant
       with the lowest counter is served (ties: the tenant that became active first). A tenant's counter grows
       by (input tokens x w_in + output tokens x w_out) / tenant weight; input is charged at dispatch
       (`pop`), output as it streams (`charge_output`). One counter per tenant, shared by both classes.
    3. Within a tenant and class, earliest deadline first; equal deadlines in arrival (push) order.

No banked credit
    A tenant is active while it has tickets queued or requests in flight (`pop` until `finish`). A tenant
    that becomes active is lifted to the virtual time V: counter = max(counter, V), where V is the highest
    minimum counter of the active tenants seen so far (it is sampled whenever a tenant becomes active or
    inactive; between those events counters only grow, so no higher minimum is missed).
    Invariant: V <= the counter of every active tenant.
    So a tenant that was idle while others were served comes back level with the least-served active tenant:
    at most one request's worth ahead of anyone, never a backlog of saved-up credit.

The bound (proved by the property tests)
    Let M = max over tickets of (prompt_tokens x w_in + max_tokens x w_out) / min tenant weight, and O =
    max_tokens x w_out / min weight. For tenants backlogged in one class from the same starting counter, at
    every point of the schedule (also while output is being charged):
        |service_A / weight_A - service_B / weight_B| <= M + (k - 1) x O
    where k is the most requests in flight at once. Proof sketch: when A is popped its counter is the lowest,
    so C_A <= C_B; after the pop A's counter rises at most by that ticket's cost / w_A (<= M) plus the output
    still uncharged of its other k - 1 requests in flight (<= (k - 1) x O), while C_B only grows. With k = 1
    (or output charged at dispatch) the gap stays within one request's cost: M.

Admission (`push`)
    Bounds: at most `max_queued_per_class` tickets per class (refused 503) and `max_queued_per_tenant` per
    tenant over both classes (refused 429): `QueueFullError(reason, retry_after)`, reason naming the bound.
    Deadlines: refused at once with `DeadlineUnmeetableError(retry_after)` when the predicted wait exceeds the
    time left to the ticket's deadline. The prediction is the caller's `first_free` (seconds until the first
    request in flight ends: the queue moves only then; `Scheduler.first_free`) plus `predicted_wait`, the work
    served before the ticket divided by the measured service rate. Work of a ticket = prompt_tokens +
    max_tokens (the whole reserve: pessimistic for short answers). Work served first = everything queued in
    higher classes + the ticket's own tenant's queued work in its class scaled by the tenant's fair share, W /
    w (W: weights of the tenants backlogged in the class, itself included), capped by the class's whole queued
    work. The approximation ignores counter lag (at most M either way), EDF position within the tenant (it
    counts the whole tenant backlog, pessimistic), aged batch tickets overtaking interactive, future arrivals
    (later tickets of other tenants and of the higher class overtake a queued one), and that a queue moves in
    steps, when requests end. So the prediction is calibrated on what it is used for: it is multiplied by
    `WaitCalibration.factor`, a running estimate of the 95th percentile of actual / predicted wait over the
    tickets that were queued (dispatched, or expired: those waited at least until their deadline). Past
    capacity a request that would expire is refused at arrival instead (`ops.bench.overload` at 3x: 36
    expired against 1,001 refused at once, where the uncalibrated prediction let 515 expire against 78).
    Service rate: tokens per second reported by `record_service` (the scheduler reports generated tokens as
    they come and a prompt when its request ends), an exponentially weighted average over busy time (half-life
    `service_rate_halflife`). Busy time is the time with requests in flight (dispatched, not finished): a
    stretch with nothing in flight is idle and never counts, and a stretch between two reports with requests
    in flight counts whole (long generations on a slow engine finish seconds apart), up to `service_idle_gap`
    seconds (requests held in flight without progress: slow readers, a stalled engine). It starts from
    `initial_service_rate`, which weighs as one second of service and so fades out within the first seconds of
    service.
    Expiry: `expire(now)` removes and returns tickets whose deadline passed (deadline < now; the scheduler
    answers them 504 `deadline_expired`). `pop(now)` never returns such a ticket: it sets them aside for the
    next `expire`.

Exceptions::

    AdmissionError                 base; `status_code`, `code` and `retry_after` for the HTTP answer
    ├── QueueFullError             a bound is reached (`reason`: max_queued_per_class | max_queued_per_tenant)
    └── DeadlineUnmeetableError    the predicted wait exceeds the ticket's deadline
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from routing.admission_types import (
    CLASSES,
    AdmissionConfig,
    DeadlineUnmeetableError,
    Klass,
    QueueFullError,
    TenantShare,
    Ticket,
)
from routing.fairness.base import CounterUpdate

T = TypeVar("T")
Key = tuple[float, int]


class _IndexedHeap(Generic[T]):
    """A binary min-heap of distinct items with keys, that can remove or re-key any item in O(log n)."""

    __slots__ = ("_items", "_pos")

    def __init__(self) -> None:
        self._items: list[tuple[Key, T]] = []
        # Invariant: self._items[self._pos[item]][1] == item for every item in the heap.
        self._pos: dict[T, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: T) -> bool:
        return item in self._pos

    def peek(self) -> tuple[Key, T]:
        return self._items[0]

    def items(self) -> Iterator[tuple[Key, T]]:
        return iter(self._items)

    def push(self, item: T, key: Key) -> None:
        self._items.append((key, item))
        self._pos[item] = len(self._items) - 1
        self._up(len(self._items) - 1)

    def rekey(self, item: T, key: Key) -> None:
        i = self._pos[item]
        self._items[i] = (key, item)
        self._up(i)
        self._down(self._pos[item])

    def remove(self, item: T) -> None:
        i = self._pos.pop(item)
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._pos[last[1]] = i
            self._up(i)
            self._down(self._pos[last[1]])

    def _swap(self, i: int, j: int) -> None:
        items = self._items
        items[i], items[j] = items[j], items[i]
        self._pos[items[i][1]] = i
        self._pos[items[j][1]] = j

    def _up(self, i: int) -> None:
        while i > 0:
            parent = (i - 1) // 2
            if self._items[i][0] >= self._items[parent][0]:
                return
            self._swap(i, parent)
            i = parent

    def _down(self, i: int) -> None:
        n = len(self._items)
        while True:
            smallest, left = i, 2 * i + 1
            for child in (left, left + 1):
                if child < n and self._items[child][0] < self._items[smallest][0]:
                    smallest = child
            if smallest == i:
                return
            self._swap(i, smallest)
            i = smallest


# The prior service rate weighs as this many seconds of measured service: enough that the first few reports
# do not swing the estimate, little enough that an engine several times slower than the prior shows so after
# its first requests (as one half-life, 10 s, it still weighed 40% after 10 s of service, and the first
# burst on a slow CPU engine was admitted at twice the rate it was served at, to expire at its deadline).
_PRIOR_SECONDS = 1.0


class ServiceRate:
    """Tokens served per second: an exponentially weighted average over busy time, seeded by a prior."""

    def __init__(self, initial_rate: float, halflife: float, max_stretch: float) -> None:
        self._halflife = halflife
        self._max_stretch = max_stretch
        # Weighted tokens over weighted seconds, the prior (`initial_rate`) among them.
        self._tokens = initial_rate * _PRIOR_SECONDS
        self._seconds = _PRIOR_SECONDS
        self._last: float | None = None

    @property
    def rate(self) -> float:
        """The current estimate, tokens per second."""
        return self._tokens / self._seconds

    def record(self, tokens: float, now: float, busy_from: float | None) -> None:
        """`tokens` of work completed by `now`, work having been in flight without a break since `busy_from`
        (None: never). The busy time since the later of the last report and `busy_from` is measured, up to
        `max_stretch` seconds."""
        last = self._last
        since = busy_from if last is None or (busy_from is not None and busy_from > last) else last
        busy = 0.0 if since is None else min(max(now - since, 0.0), self._max_stretch)
        self._last = now if last is None or now > last else last
        decay = 0.5 ** (busy / self._halflife)
        self._tokens = self._tokens * decay + tokens
        self._seconds = self._seconds * decay + busy


# Wait calibration: the predicted waits are scaled by a running estimate of this quantile of the ratio of
# actual to predicted wait of queued tickets, so that about this share of admitted tickets waits no longer
# than predicted. Each observation moves the estimate's logarithm by this step (up by step x q when the wait
# was longer, down by step x (1 - q) otherwise): a few dozen dispatches move it by a factor of two.
_CALIBRATION_QUANTILE = 0.95
_CALIBRATION_STEP = 0.05
_CALIBRATION_BOUNDS = (0.5, 50.0)
# Predicted waits under this many seconds count as this much in the ratio (a prediction of 0 has no ratio).
_CALIBRATION_FLOOR = 1e-3


class WaitCalibration:
    """The factor predicted waits are scaled by: a streaming estimate of a high quantile of actual / predicted
    wait (stochastic approximation in log space, bounded). It corrects what the linear prediction leaves out:
    later arrivals that overtake a queued ticket (other tenants' fair share, the higher class), requests that
    free their place in steps, not token by token."""

    def __init__(self) -> None:
        self._log = 0.0

    @property
    def factor(self) -> float:
        return math.exp(self._log)

    def observe(self, predicted: float, actual: float) -> None:
        """A ticket predicted to wait `predicted` seconds waited `actual` (at least, for one that expired)."""
        above = actual / max(predicted, _CALIBRATION_FLOOR) > self.factor
        q = _CALIBRATION_QUANTILE
        self._log += _CALIBRATION_STEP * (q if above else q - 1.0)
        low, high = _CALIBRATION_BOUNDS
        self._log = min(max(self._log, math.log(low)), math.log(high))


@dataclass(slots=True, eq=False)
class _Tenant:
    name: str
    weight: float
    counter: float = 0.0
    # Tie-break among equal counters: the order in which tenants became active.
    seq: int = 0
    in_flight: int = 0
    queued: int = 0
    # Per class: this tenant's queued request ids keyed by (deadline, push seq), and their work.
    queues: dict[Klass, _IndexedHeap[str]] = field(
        default_factory=lambda: {k: _IndexedHeap() for k in CLASSES}
    )
    work: dict[Klass, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))

    @property
    def key(self) -> Key:
        return (self.counter, self.seq)


@dataclass(slots=True, eq=False)
class _Class:
    # Tenants with tickets queued in this class, keyed by (counter, activation seq).
    tenants: _IndexedHeap[str] = field(default_factory=_IndexedHeap)
    # Queued request ids keyed by (arrival, push seq): the oldest one drives the queue-age guard.
    arrivals: _IndexedHeap[str] = field(default_factory=_IndexedHeap)
    work: int = 0
    # Sum of the weights of the tenants in `tenants`.
    weight: float = 0.0


class FairQueue:
    """Priority classes, then tenants by virtual token counter, then earliest deadline (module docstring)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self._config = config
        self._rate = ServiceRate(
            config.initial_service_rate, config.service_rate_halflife, config.service_idle_gap
        )
        self._classes: dict[Klass, _Class] = {k: _Class() for k in CLASSES}
        self._tenants: dict[str, _Tenant] = {}
        self._queued: dict[str, tuple[Ticket, int]] = {}
        # Queued tickets' push time and predicted wait (unscaled), and what the two have said of each other.
        self._predictions: dict[str, tuple[float, float]] = {}
        self.calibration = WaitCalibration()
        self._in_flight: dict[str, str] = {}
        # When the current (or the last) stretch with requests in flight began: service is timed over it.
        self._busy_from: float | None = None
        self._by_deadline: _IndexedHeap[str] = _IndexedHeap()
        # Active tenants (queued or in flight), and inactive ones kept because their counter is above V.
        self._active: _IndexedHeap[str] = _IndexedHeap()
        self._idle: _IndexedHeap[str] = _IndexedHeap()
        self._vtime = 0.0
        self._seq = 0
        self._expired: list[Ticket] = []
        # Fleet-wide fairness (`routing.fairness`): counter increments charged here since the last sync, per
        # tenant; None while the counters are this process's own.
        self._unsynced: dict[str, float] | None = None

    # -- observation -------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queued

    def depth(self, klass: Klass) -> int:
        """Tickets queued in one priority class."""
        return len(self._classes[klass].arrivals)

    @property
    def queued_work(self) -> int:
        """The work of every queued ticket (prompt + max_tokens each), both classes."""
        return sum(cls.work for cls in self._classes.values())

    def share(self, tenant: str) -> TenantShare:
        """Where `tenant` stands: its requests queued and in flight, its counter against the virtual time (an
        unknown tenant's counter reads as the virtual time it would start at)."""
        state = self._tenants.get(tenant)
        if state is None:
            return TenantShare(queued=0, in_flight=0, counter=self._vtime, virtual_time=self._vtime)
        return TenantShare(
            queued=state.queued, in_flight=state.in_flight, counter=state.counter, virtual_time=self._vtime
        )

    @property
    def service_rate(self) -> float:
        """The measured service rate, tokens per second."""
        return self._rate.rate

    def predicted_wait(self, ticket: Ticket) -> float:
        """Seconds `ticket` is predicted to wait before dispatch if pushed now (see the module docstring)."""
        ahead = 0
        for klass in CLASSES[: CLASSES.index(ticket.klass)]:
            ahead += self._classes[klass].work
        cls = self._classes[ticket.klass]
        state = self._tenants.get(ticket.tenant)
        queued = ticket.request_id in self._queued
        own = (state.work[ticket.klass] if state is not None else 0) - (ticket.work if queued else 0)
        class_work = cls.work - (ticket.work if queued else 0)
        if state is not None and ticket.tenant in cls.tenants:
            weight, total = state.weight, cls.weight
        else:
            weight, total = ticket.tenant_weight, cls.weight + ticket.tenant_weight
        in_class = min(float(class_work), own * total / weight)
        return (ahead + in_class) / self._rate.rate

    # -- admission ---------------------------------------------------------------------------------------

    def push(self, ticket: Ticket, now: float, first_free: float = 0.0) -> None:
        """Queue `ticket` or refuse it (`QueueFullError` past a bound, `DeadlineUnmeetableError` too late).
        `first_free`: seconds until the first request in flight is predicted to end (the queue moves only
        then), added to the predicted wait."""
        predicted = self._admissible(ticket, now, first_free)
        self._insert(ticket)
        self._predictions[ticket.request_id] = (now, predicted)

    def start(self, ticket: Ticket, now: float) -> None:
        """Dispatch `ticket` without queueing it: what `push(ticket, now)` then `pop(now)` do while nothing
        is queued (the same refusals, counters and virtual time), without the heaps' work. The caller has
        room for it now and must later call `finish(request_id)` once, however the request ends."""
        if self._queued:
            raise ValueError("tickets are queued: a new one must be pushed behind them")
        # With nothing queued the predicted wait is 0: a deadline already past is refused here, never expired.
        self._admissible(ticket, now, 0.0)
        state = self._enter(ticket)
        self._seq += 1  # the push's sequence number, as `_insert` takes it
        self._dispatched(state, ticket, now)

    def _admissible(self, ticket: Ticket, now: float, first_free: float) -> float:
        """Refuse `ticket` (QueueFullError, DeadlineUnmeetableError) or return its predicted wait before
        calibration."""
        if ticket.request_id in self._queued or ticket.request_id in self._in_flight:
            raise ValueError(f"request {ticket.request_id} is already queued or in flight")
        if not ticket.tenant_weight > 0 or ticket.prompt_tokens < 0 or ticket.max_tokens < 0:
            raise ValueError(f"ticket {ticket.request_id}: weight must be > 0 and token counts >= 0")
        cls = self._classes[ticket.klass]
        state = self._tenants.get(ticket.tenant)
        if len(cls.arrivals) >= self._config.max_queued_per_class:
            raise QueueFullError("max_queued_per_class", self._next_slot(cls.work, len(cls.arrivals), 1.0))
        if state is not None and state.queued >= self._config.max_queued_per_tenant:
            share = max(cls.weight, state.weight) / state.weight
            work = sum(state.work.values())
            raise QueueFullError("max_queued_per_tenant", self._next_slot(work, state.queued, share))
        predicted = first_free + self.predicted_wait(ticket)
        wait = predicted * self.calibration.factor
        left = ticket.deadline - now
        if wait > left:
            raise DeadlineUnmeetableError(retry_after=wait - left, predicted_wait=wait)
        return predicted

    def _next_slot(self, work: int, count: int, share: float) -> float:
        # Seconds until one of `count` tickets holding `work` is served, at `share` x their fair rate.
        return max(work / max(count, 1) * share / self._rate.rate, 1e-3)

    def _enter(self, ticket: Ticket) -> _Tenant:
        """The ticket's tenant, active, at the ticket's weight."""
        state = self._tenants.get(ticket.tenant)
        if state is None:
            state = self._tenants[ticket.tenant] = _Tenant(ticket.tenant, ticket.tenant_weight)
        if not self._is_active(state):
            self._activate(state)
        for klass in CLASSES:
            if ticket.tenant in self._classes[klass].tenants:
                self._classes[klass].weight += ticket.tenant_weight - state.weight
        state.weight = ticket.tenant_weight
        return state

    def _insert(self, ticket: Ticket) -> None:
        state = self._enter(ticket)
        self._seq += 1
        rid, cls = ticket.request_id, self._classes[ticket.klass]
        if ticket.tenant not in cls.tenants:
            cls.tenants.push(ticket.tenant, state.key)
            cls.weight += state.weight
        self._queued[rid] = (ticket, self._seq)
        state.queues[ticket.klass].push(rid, (ticket.deadline, self._seq))
        state.work[ticket.klass] += ticket.work
        state.queued += 1
        cls.arrivals.push(rid, (ticket.arrival, self._seq))
        cls.work += ticket.work
        self._by_deadline.push(rid, (ticket.deadline, self._seq))

    # -- dispatch ----------------------------------------------------------------------------------------

    def peek(self, now: float) -> Ticket | None:
        """The ticket `pop(now)` would return, left queued (the scheduler looks for room for it first)."""
        self._collect_expired(now)
        klass = self._choose_class(now)
        if klass is None:
            return None
        tenant = self._classes[klass].tenants.peek()[1]
        return self._queued[self._tenants[tenant].queues[klass].peek()[1]][0]

    def pop(self, now: float) -> Ticket | None:
        """The next ticket to dispatch (never one whose deadline passed), charging its input; None if empty.

        The caller must later call `finish(request_id)` once, however the request ends.
        """
        ticket = self.peek(now)
        if ticket is None:
            return None
        # In flight before leaving the queue, so the tenant stays active through the handover.
        self._dispatched(self._tenants[ticket.tenant], ticket, now, queued=True)
        return ticket

    def _dispatched(self, state: _Tenant, ticket: Ticket, now: float, *, queued: bool = False) -> None:
        """`ticket` goes in flight at `now` (out of the queue if `queued`), its input charged."""
        if not self._in_flight:
            self._busy_from = now
        state.in_flight += 1
        self._in_flight[ticket.request_id] = ticket.tenant
        if queued:
            self._unqueue(ticket.request_id)
            self._calibrate(ticket.request_id, now)
        self._charge(state, ticket.prompt_tokens * self._config.w_in)

    def _choose_class(self, now: float) -> Klass | None:
        interactive, batch = self._classes["interactive"], self._classes["batch"]
        if len(batch.arrivals) and (
            not len(interactive.arrivals) or now - batch.arrivals.peek()[0][0] >= self._config.batch_max_wait
        ):
            return "batch"
        return "interactive" if len(interactive.arrivals) else None

    def charge_output(self, tenant: str, tokens: int) -> None:
        """Charge `tokens` generated for `tenant` (called as they stream) to its virtual counter."""
        state = self._tenants.get(tenant)
        if state is None:
            # A late report after the tenant went idle and was forgotten: it restarts from V, then pays.
            state = self._tenants[tenant] = _Tenant(tenant, 1.0, counter=self._vtime)
            self._idle.push(tenant, state.key)
        self._charge(state, tokens * self._config.w_out)

    def finish(self, request_id: str) -> None:
        """A popped request ended (completed, failed or cancelled): its tenant may become inactive."""
        tenant = self._in_flight.pop(request_id, None)
        if tenant is None:
            return
        state = self._tenants[tenant]
        state.in_flight -= 1
        self._maybe_deactivate(state)

    def record_service(self, tokens: float, now: float) -> None:
        """The engines served `tokens` more of work (prompt or generated) by `now`: feeds the service rate."""
        self._rate.record(tokens, now, self._busy_from)

    # -- removal -----------------------------------------------------------------------------------------

    def remove(self, request_id: str) -> Ticket | None:
        """Take a queued ticket out (its client left); None if it is not queued."""
        if request_id not in self._queued:
            return None
        self._predictions.pop(request_id, None)
        return self._unqueue(request_id)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a queued ticket (when the scheduler must next look for expiries)."""
        return self._by_deadline.peek()[0][0] if len(self._by_deadline) else None

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return every ticket whose deadline passed (deadline < now), those `pop` skipped too."""
        self._collect_expired(now)
        expired, self._expired = self._expired, []
        return expired

    def _collect_expired(self, now: float) -> None:
        while len(self._by_deadline) and self._by_deadline.peek()[0][0] < now:
            rid = self._by_deadline.peek()[1]
            self._expired.append(self._unqueue(rid))
            self._calibrate(rid, now)  # it would have waited longer still

    def _calibrate(self, rid: str, now: float) -> None:
        pushed, predicted = self._predictions.pop(rid)
        self.calibration.observe(predicted, now - pushed)

    def _unqueue(self, rid: str) -> Ticket:
        ticket, _ = self._queued.pop(rid)
        state, cls = self._tenants[ticket.tenant], self._classes[ticket.klass]
        self._by_deadline.remove(rid)
        cls.arrivals.remove(rid)
        cls.work -= ticket.work
        queue = state.queues[ticket.klass]
        queue.remove(rid)
        state.work[ticket.klass] -= ticket.work
        state.queued -= 1
        if not len(queue):
            cls.tenants.remove(ticket.tenant)
            # Reset when empty so float rounding of weight sums cannot drift.
            cls.weight = cls.weight - state.weight if len(cls.tenants) else 0.0
        self._maybe_deactivate(state)
        return ticket

    # -- virtual counters --------------------------------------------------------------------------------

    @staticmethod
    def _is_active(state: _Tenant) -> bool:
        return state.queued > 0 or state.in_flight > 0

    def _sample_vtime(self) -> None:
        if len(self._active):
            self._vtime = max(self._vtime, self._active.peek()[0][0])
        # Forget idle tenants that would be lifted to V anyway.
        while len(self._idle) and self._idle.peek()[0][0] <= self._vtime:
            tenant = self._idle.peek()[1]
            self._idle.remove(tenant)
            del self._tenants[tenant]

    def _activate(self, state: _Tenant) -> None:
        if state.name in self._idle:
            self._idle.remove(state.name)
        self._sample_vtime()
        self._seq += 1
        state.counter, state.seq = max(state.counter, self._vtime), self._seq
        self._active.push(state.name, state.key)

    def _maybe_deactivate(self, state: _Tenant) -> None:
        if self._is_active(state) or state.name not in self._active:
            return
        self._sample_vtime()
        self._active.remove(state.name)
        if state.counter <= self._vtime:
            del self._tenants[state.name]
        else:
            self._idle.push(state.name, state.key)

    def share_counters(self) -> None:
        """Keep what is charged here for `sync_updates` from now on (the fleet shares the counters)."""
        if self._unsynced is None:
            self._unsynced = {}

    def sync_updates(self) -> list[CounterUpdate]:
        """What to send the fleet's counters: per tenant charged here since the last call, or active here,
        the increment and the counter held (`routing.fairness.base`). Starts the next increments from 0."""
        unsynced, self._unsynced = self._unsynced or {}, {}
        names = dict.fromkeys([*unsynced, *(name for _, name in self._active.items())])
        # A tenant forgotten here since it was charged (idle at or below the virtual time) still sends its
        # increment; its counter here is no floor any more.
        return [
            CounterUpdate(name, unsynced.get(name, 0.0), state.counter if state is not None else 0.0)
            for name in names
            for state in [self._tenants.get(name)]
        ]

    def unsent(self, updates: Sequence[CounterUpdate]) -> None:
        """A sync of `updates` failed: their increments go with the next one."""
        unsynced = self._unsynced
        if unsynced is None:
            return
        for update in updates:
            if update.delta:
                unsynced[update.tenant] = unsynced.get(update.tenant, 0.0) + update.delta

    def apply_synced(self, updates: Sequence[CounterUpdate], counters: Sequence[float]) -> None:
        """The fleet's counters for the tenants of `updates` (as `sync_updates` made them): each local
        counter becomes the fleet's plus what was charged here since (never lower than it is)."""
        unsynced = self._unsynced or {}
        for update, fleet in zip(updates, counters, strict=True):
            state = self._tenants.get(update.tenant)
            if state is None:
                continue
            value = fleet + unsynced.get(update.tenant, 0.0)
            if value > state.counter:
                self._set_counter(state, value)

    def _charge(self, state: _Tenant, cost: float) -> None:
        step = cost / state.weight
        if self._unsynced is not None:
            self._unsynced[state.name] = self._unsynced.get(state.name, 0.0) + step
        self._set_counter(state, state.counter + step)

    def _set_counter(self, state: _Tenant, value: float) -> None:
        state.counter = value
        key = state.key
        for klass in CLASSES:
            if state.name in self._classes[klass].tenants:
                self._classes[klass].tenants.rekey(state.name, key)
        for heap in (self._active, self._idle):
            if state.name in heap:
                heap.rekey(state.name, key)
