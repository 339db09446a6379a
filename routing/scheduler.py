"""`Scheduler`: the fair queue and the router together, in the event loop.

A request asks for a `Lease` with `admit(ticket, route)`. It is pushed into the fair queue of the weights it
needs (one `FairQueue` per weights hash: replicas that serve the same weights are one capacity), which may
refuse it at once (`QueueFullError`, `DeadlineUnmeetableError`); then the dispatcher takes tickets in fair
order and hands each one the replica the router picks (one per choice for a request of n > 1: the choices
spread where the router's score puts them, `Router.place`), with the ticket's KV budget reserved there. The
head of a queue waits until some replica has room for it (strict order: a smaller ticket behind it does not
overtake, or fairness would not hold). A ticket that finds nothing of its weights queued and a replica with
room is dispatched at once, without entering the heaps (`FairQueue.start`: the accounting of a push and a
pop, which would give it the same replica). Dispatch runs whenever something changes: a ticket arrives, a
lease is released, replicas report load (the refresh loop), or the earliest queued deadline passes; a
ticket whose deadline passes while queued is answered with `DeadlineExpiredError`.

A lease lasts until the request ends, however it ends: `Lease.release()` frees its KV budget on the replica,
finishes it in the fair queue and reports the work done to the queue's service rate. While it runs,
`Lease.observe(tokens)` counts generated tokens, and `settle()` charges what leases counted to their tenants'
virtual counters and to their replicas' KV accounting: at the start of every dispatch and release, so a
decision always sees every token generated before it (one charge per tenant, not one per token per stream).
`fail_over(lease)` moves a request of one choice that failed before its first token to another replica.

Exceptions::

    AdmissionError (routing.admission_types)   refused at push: queue_full (429 tenant / 503 class),
    │                                           deadline_unmeetable (503)
    └── DeadlineExpiredError                    its deadline passed while queued (504 deadline_expired)
    RoutingError (routing.replicas)             no_healthy_replica (503), context_length_exceeded (400)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Sequence

from routing.admission_types import AdmissionConfig, AdmissionError, Klass, TenantShare, Ticket
from routing.capacity.base import NOTHING, Capacity, CapacityLedger, LedgerUnavailableError
from routing.fair_queue import FairQueue
from routing.fairness.base import CountersUnavailableError, SharedCounters
from routing.replicas import Replica
from routing.router import NoHealthyReplicaError, Router, RouteRequest, placed_on, reserve

log = logging.getLogger("lockgate.routing")

# vLLM's priority (lower runs earlier) of each class, so the engine's own waiting queue agrees with ours.
ENGINE_PRIORITY: dict[Klass, int] = {"interactive": 0, "batch": 10}


class DeadlineExpiredError(AdmissionError):
    """The request's queue deadline passed before a replica had room for it."""

    status_code = 504
    code = "deadline_expired"


class Lease:
    """A dispatched request: the replicas holding its KV budget (one per choice), and its place in the fair
    queue."""

    def __init__(
        self,
        scheduler: Scheduler,
        ticket: Ticket,
        route: RouteRequest,
        placement: Sequence[Replica],
        queue_wait: float,
    ) -> None:
        self._scheduler = scheduler
        self.ticket = ticket
        self.route = route
        self.placement = tuple(placement)
        # Seconds the request waited in the queue before dispatch.
        self.queue_wait = queue_wait
        self.attempts = 1
        self.output = 0
        # Generated tokens not yet charged (`Scheduler.settle`): in all, and by choice when the choices run
        # on more than one replica (each replica's KV grows with its own choices' output).
        self.unsettled = 0
        self.unsettled_by_choice: list[int] | None = (
            [0] * len(self.placement) if any(r is not placement[0] for r in placement) else None
        )
        self._released = False

    @property
    def replica(self) -> Replica:
        """The replica of the first choice (of the only one, for a request of one choice)."""
        return self.placement[0]

    def replica_of(self, choice: int) -> Replica:
        """The replica that runs choice `choice` of the request."""
        return self.placement[choice]

    def observe(self, tokens: int, choice: int = 0) -> None:
        """`tokens` more were generated for choice `choice`: charged to the tenant and counted against its
        replica's KV budget by the scheduler's next `settle()`, before its next decision."""
        if self._released or tokens <= 0:
            return
        self.output += tokens
        if not self.unsettled:
            self._scheduler.unsettled.append(self)
        self.unsettled += tokens
        if self.unsettled_by_choice is not None:
            self.unsettled_by_choice[choice] += tokens

    def release(self) -> None:
        """The request ended: free its budget and its fair-queue slot, report its work (idempotent)."""
        if self._released:
            return
        self._released = True
        self._scheduler.finished(self)


class _Waiter:
    """A queued ticket's route and the future its `admit` awaits."""

    def __init__(self, ticket: Ticket, route: RouteRequest, future: asyncio.Future[Lease]) -> None:
        self.ticket = ticket
        self.route = route
        self.future = future


class Scheduler:
    """Admission (fair queues per weights) and dispatch (router over replicas) for one gateway process."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        router: Router,
        config: AdmissionConfig,
        clock: Callable[[], float],
        *,
        refresh_interval: float = 1.0,
        ledger: CapacityLedger | None = None,
        holder: str = "",
        counters: SharedCounters | None = None,
    ) -> None:
        """`ledger`: the capacity ledger shared with other gateway processes (`routing.capacity`), where
        this one (`holder`) renews its lease of each replica at every refresh, and at once when a ticket
        finds no room; None: each replica's whole capacity is this process's (or its load reports say what
        the others use). `counters`: the fleet's virtual token counters (`routing.fairness`), synced by
        `sync_counters`; None: each process's fairness is its own."""
        self.replicas = list(replicas)
        self._counters = counters
        self._ledger = ledger
        self._holder = holder
        # A lease lapses after three refreshes without a renewal (a stopped or partitioned process).
        self._lease_ttl = 3 * refresh_interval
        self._renewal: asyncio.Task[None] | None = None
        # Set whenever room may have appeared (a request ended, leases were renewed, replicas refreshed):
        # what a failover that found none waits for.
        self._room = asyncio.Event()
        # At most one renewal on demand per this many seconds (a saturated queue would ask at every arrival).
        self._renewal_gap = refresh_interval / 10
        self._renewed_at = -math.inf
        self.config = config
        self._router = router
        self._clock = clock
        self._refresh_interval = refresh_interval
        self._queues: dict[str, FairQueue] = {}
        self._waiters: dict[str, _Waiter] = {}
        self._wake = asyncio.Event()
        # Leases that observed tokens since the last `settle()`.
        self.unsettled: list[Lease] = []
        # Leases not yet released, by weights hash and request id.
        self._live: dict[str, dict[str, Lease]] = {}

    def queue(self, weights_sha256: str) -> FairQueue:
        """The fair queue of one weights hash (created on first use)."""
        queue = self._queues.get(weights_sha256)
        if queue is None:
            queue = self._queues[weights_sha256] = FairQueue(self.config)
            if self._counters is not None:
                queue.share_counters()
        return queue

    def depth(self, klass: Klass | None = None) -> int:
        """Requests queued, all weights: in one priority class, or in both (None)."""
        if klass is None:
            return sum(len(q) for q in self._queues.values())
        return sum(q.depth(klass) for q in self._queues.values())

    def shares(self, tenant: str) -> dict[str, TenantShare]:
        """Where `tenant` stands in each fair queue (one per model weights hash, as its sha256)."""
        return {weights: queue.share(tenant) for weights, queue in sorted(self._queues.items())}

    async def admit(self, ticket: Ticket, route: RouteRequest) -> Lease:
        """Queue `ticket` and wait until a replica serving `route.weights_sha256` has room for it.

        Raises at once what refuses it (no healthy replica, a full queue, an unmeetable deadline), later
        DeadlineExpiredError. Cancelled while waiting, the ticket leaves the queue; a lease granted in the
        same instant is released.
        """
        serving = [
            r
            for r in self.replicas
            if r.weights_sha256 == route.weights_sha256 and (route.pool is None or r.pool == route.pool)
        ]
        if serving and not any(r.routable for r in serving):
            # What the last refresh saw may be stale (an engine that has just restarted): ask again now.
            await asyncio.gather(*(r.refresh() for r in serving), return_exceptions=True)
        if not any(r.routable for r in serving):
            down = f" ({len(serving)} down: {serving[0].health_detail or 'taken out'})" if serving else ""
            error = NoHealthyReplicaError(
                f"no healthy replica serves weights {route.weights_sha256[:12]}{down}"
            )
            # An engine that is restarting says how long its last start took.
            waits = [
                w for r in serving if isinstance(w := getattr(r.engine, "retry_after", None), float | int)
            ]
            error.retry_after = float(min(waits)) if waits else None
            raise error
        queue = self.queue(route.weights_sha256)
        if not len(queue) and (lease := self._start(queue, ticket, route)) is not None:
            return lease
        self.settle()  # the service rate that predicts its wait, up to date
        queue.push(ticket, self._clock(), self.first_free(route.weights_sha256))
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.request_id] = _Waiter(ticket, route, future)
        self.dispatch()
        if not future.done():
            self._renew_soon()
        if not future.done():
            # `run` may be waiting past this ticket's deadline: make it look at the deadlines again.
            self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._waiters.pop(ticket.request_id, None)
            queue.remove(ticket.request_id)
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()
            raise

    def admit_now(self, ticket: Ticket, route: RouteRequest) -> Lease | None:
        """`admit`'s answer when it needs no wait: the lease of a ticket that nothing of its weights is
        queued ahead of and that a routable replica has room for now. None: `admit` it (it may wait, look
        at the replicas again, or refuse it). A caller that must race the wait against something (a client
        leaving) pays for the race only when there is a wait."""
        queue = self._queues.get(route.weights_sha256)
        if queue is not None and len(queue):
            return None
        try:
            return self._start(self.queue(route.weights_sha256), ticket, route)
        except NoHealthyReplicaError:  # `admit` asks the replicas again before it refuses
            return None

    def _start(self, queue: FairQueue, ticket: Ticket, route: RouteRequest) -> Lease | None:
        """The lease of a ticket that nothing of its weights is queued ahead of, when a replica has room for
        it now: the order `push` and `dispatch` would give, without the queue's heaps. None: queue it."""
        self.settle()
        now = self._clock()
        placement = self._router.place(route, self.replicas, now)
        if placement is None:
            return None
        queue.start(ticket, now)
        for replica, count in placed_on(placement).items():
            reserve(route, replica, count)
        return self._lease(ticket, route, placement, 0.0)

    def _lease(
        self, ticket: Ticket, route: RouteRequest, placement: Sequence[Replica], queue_wait: float
    ) -> Lease:
        lease = Lease(self, ticket, route, placement, queue_wait)
        self._live.setdefault(route.weights_sha256, {})[ticket.request_id] = lease
        return lease

    def first_free(self, weights_sha256: str) -> float:
        """Seconds until the first request in flight on these weights is predicted to end and free its
        place: the least any has left of its max_tokens, at its share of the measured service rate (the
        requests in flight share it). A queue moves only then: a burst that filled the engines at once ends
        together, one batch time later, and the linear prediction of the work queued ahead (`FairQueue`)
        would be short by that."""
        live = self._live.get(weights_sha256)
        if not live:
            return 0.0
        left = min(max(lease.ticket.max_tokens - lease.output, 1) for lease in live.values())
        return left * len(live) / self.queue(weights_sha256).service_rate

    def settle(self) -> None:
        """Charge the tokens leases observed since the last call: to each tenant's virtual counter (one charge
        per tenant and weights), to each request's KV accounting on its replica, and to the service rate of
        their weights (generated tokens count as served when they are generated, not when their request
        ends: a batch of long answers is seen being served all along)."""
        if not self.unsettled:
            return
        leases, self.unsettled = self.unsettled, []
        charges: dict[tuple[str, str], int] = {}
        for lease in leases:
            tokens, lease.unsettled = lease.unsettled, 0
            # Replica.grow takes the increment, not the running total.
            by_choice = lease.unsettled_by_choice
            if by_choice is None:
                lease.replica.grow(lease.ticket.request_id, tokens)
            else:
                for choice, grown in enumerate(by_choice):
                    lease.placement[choice].grow(lease.ticket.request_id, grown)
                    by_choice[choice] = 0
            key = (lease.route.weights_sha256, lease.ticket.tenant)
            charges[key] = charges.get(key, 0) + tokens
        now = self._clock()
        for (weights, tenant), tokens in charges.items():
            queue = self.queue(weights)
            queue.charge_output(tenant, tokens)
            queue.record_service(tokens, now)

    def dispatch(self) -> None:
        """Give every queue's head a replica while one has room; answer expired and unroutable tickets."""
        self.settle()
        now = self._clock()
        for queue in self._queues.values():
            for expired in queue.expire(now):
                waited = expired.deadline - expired.arrival
                message = f"no replica had room before the queue deadline ({waited:.1f} s after arrival)"
                self._fail(expired, DeadlineExpiredError(message, retry_after=1.0))
            while (ticket := queue.peek(now)) is not None:
                waiter = self._waiters.get(ticket.request_id)
                if waiter is None:  # its client left between push and now
                    queue.remove(ticket.request_id)
                    continue
                try:
                    placement = self._router.dispatch_choices(waiter.route, self.replicas, now)
                except Exception as exc:  # no healthy replica any more, or too large for every replica
                    queue.remove(ticket.request_id)
                    self._fail(ticket, exc)
                    continue
                if placement is None:
                    break
                queue.pop(now)  # the ticket peeked: nothing ran in between
                del self._waiters[ticket.request_id]
                lease = self._lease(ticket, waiter.route, placement, max(0.0, now - ticket.arrival))
                if waiter.future.done():  # cancelled in the same instant
                    lease.release()
                else:
                    waiter.future.set_result(lease)

    def _fail(self, ticket: Ticket, exc: Exception) -> None:
        waiter = self._waiters.pop(ticket.request_id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_exception(exc)

    def finished(self, lease: Lease) -> None:
        """A lease was released: free what it held, count its prompt as served (its output was, as it came),
        then dispatch what now fits."""
        self.settle()
        for replica in dict.fromkeys(lease.placement):
            replica.release(lease.ticket.request_id)
        self._live.get(lease.route.weights_sha256, {}).pop(lease.ticket.request_id, None)
        queue = self.queue(lease.route.weights_sha256)
        queue.finish(lease.ticket.request_id)
        queue.record_service(lease.ticket.prompt_tokens, self._clock())
        self._room.set()
        self.dispatch()

    def fail_over(self, lease: Lease) -> Lease | None:
        """Move a request of one choice that failed before its first token to another replica (its KV
        budget with it); None when no other replica can take it now (the caller reports the original
        error)."""
        if lease._released or len(lease.placement) != 1:  # reserving again would hold what no release frees
            return None
        self.settle()
        request_id = lease.ticket.request_id
        lease.replica.release(request_id)
        try:
            replica = self._router.dispatch(
                lease.route, self.replicas, self._clock(), exclude={lease.replica.replica_id}
            )
        except Exception:
            replica = None
        if replica is not None:
            lease.placement = (replica,)
            lease.attempts += 1
        # The failed replica's budget is free: queued tickets may fit there now.
        self.dispatch()
        # None: nothing to move to; the lease keeps no budget anywhere and release() still finishes it.
        return lease if replica is not None else None

    async def fail_over_waiting(self, lease: Lease) -> Lease | None:
        """`fail_over`, waiting for room on another healthy replica (a request ending, a lease renewed, a
        health check) until the request's queue deadline, or two refresh intervals if that is later; None
        past it, or at once when no other healthy replica serves the weights. Before its first token a
        request may wait as a queued one would: a gateway that has just started holds small capacity leases
        until the other gateways' shrink."""
        failed = lease.replica
        route = lease.route
        # However late the failure came (a replica that hung before failing), a request may wait for one
        # lease renewal and health check elsewhere: the failure was the replica's, not its own.
        until = max(lease.ticket.deadline, self._clock() + 2 * failed.refresh_interval)
        while True:
            if self.fail_over(lease) is not None:
                return lease
            left = until - self._clock()
            healthy = [
                r
                for r in self.replicas
                if r is not failed
                and r.routable
                and r.weights_sha256 == route.weights_sha256
                and (route.pool is None or r.pool == route.pool)
            ]
            if lease._released or left <= 0 or not healthy:  # no room to wait for: the error stands
                return None
            self._room.clear()
            self._renew_soon()
            try:
                await asyncio.wait_for(self._room.wait(), left)
            except TimeoutError:
                return None

    async def refresh(self) -> None:
        """Refresh every replica's load and health once (bounded per replica), renew the capacity leases,
        then dispatch."""
        await asyncio.gather(*(r.refresh() for r in self.replicas), return_exceptions=True)
        await self.renew_leases()
        self._room.set()
        self.dispatch()

    async def sync_counters(self) -> None:
        """Send the fleet's counters what each fair queue charged since the last sync and take theirs
        (`routing.fairness`), then dispatch in the order they give. A store that fails keeps the increments
        for the next sync."""
        counters = self._counters
        if counters is None:
            return
        self.settle()
        for weights, queue in list(self._queues.items()):
            updates = queue.sync_updates()
            if not updates:
                continue
            try:
                fleet = await counters.sync(weights, updates)
            except CountersUnavailableError as exc:
                log.warning("fairness counters not synced: %s", exc)
                queue.unsent(updates)
                continue
            queue.apply_synced(updates, fleet)
        self.dispatch()

    async def run_counter_sync(self, interval: float) -> None:
        """Until cancelled: `sync_counters` every `interval` seconds."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync_counters()
            except Exception:  # a sync must never stop the loop
                log.exception("fairness counter sync failed")

    async def renew_leases(self) -> None:
        """Renew this process's lease of every replica from the ledger (none: nothing to do), asking for
        what it holds there plus the work queued for the replica's weights."""
        ledger = self._ledger
        if ledger is None:
            return
        self.settle()
        renewals = []
        for replica in self.replicas:
            queue = self._queues.get(replica.weights_sha256)
            demand = Capacity(queue.queued_work, len(queue)) if queue is not None else NOTHING
            renewals.append(replica.renew_lease(ledger, self._holder, demand, self._lease_ttl))
        await asyncio.gather(*renewals)
        self._room.set()

    def _renew_soon(self) -> None:
        """A ticket found no room: renew the leases now (once at a time, at most every `refresh_interval` /
        10), then dispatch what they let in."""
        if self._ledger is None or (self._renewal is not None and not self._renewal.done()):
            return
        now = self._clock()
        if now - self._renewed_at < self._renewal_gap:
            return
        self._renewed_at = now

        async def renew() -> None:
            try:
                await self.renew_leases()
            finally:
                self.dispatch()

        self._renewal = asyncio.get_running_loop().create_task(renew())

    async def release_leases(self) -> None:
        """Give every lease back to the ledger (a process that stops), bounded by the ledger's timeout."""
        ledger = self._ledger
        if ledger is None:
            return
        if self._renewal is not None:
            self._renewal.cancel()
        for replica in self.replicas:
            with contextlib.suppress(LedgerUnavailableError):
                await ledger.release(replica.replica_id, self._holder)

    async def run(self) -> None:
        """Until cancelled: refresh replicas every `refresh_interval` seconds, and dispatch when the
        earliest queued deadline passes (so expired tickets are answered without waiting for traffic)."""
        loop = asyncio.get_running_loop()
        next_refresh = loop.time()
        while True:
            # Due within a microsecond counts as due: a wait of a few ulps may end before the clock reads
            # the time it was set for (a virtual clock then never gets there).
            if loop.time() >= next_refresh - 1e-6:
                try:
                    await self.refresh()
                except Exception:  # a refresh must never stop the loop
                    log.exception("replica refresh failed")
                next_refresh = loop.time() + self._refresh_interval
            timeout = next_refresh - loop.time()
            deadlines = [d for q in self._queues.values() if (d := q.next_deadline()) is not None]
            if deadlines:
                timeout = min(timeout, max(0.0, min(deadlines) - self._clock()) + 1e-3)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(timeout, 0.0))
            self.dispatch()

    def wake(self) -> None:
        """Make `run` look again now (tests that move an injected clock)."""
        self._wake.set()
