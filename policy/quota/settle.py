"""Settling reservations in tasks of their own: retried with backoff, drained (bounded) at shutdown.

A request's outcome arrives in whatever task ends it, often one being cancelled, and the app cancels its
request tasks at shutdown; a reconcile running there would be cancelled with it and its refund lost. So the
meter hands each settlement to a `Settler`, whose tasks nobody cancels: shutdown waits for them (`drain`,
bounded) after the request tasks are gone and before the store is closed. A reconcile that fails because the
store is unreachable or our pool is busy is retried with exponential backoff; reconcile is idempotent by
reservation id, so a retry of one that did run (and only its reply was lost) changes nothing.

Counters (in the meter's `counters`): `settled` (a granted reservation settled now), `settle_noop` (settled
before, or never granted: its id is closed), `settle_retried` (each retry), `settle_given_up` (attempts
exhausted or cut off by the drain bound: the reservation stays charged in full, never under-charged).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

import msgspec

from policy.clock import Clock, Sleep
from policy.quota.base import QuotaBackendError, QuotaBusyError, QuotaStore, Reservation

log = logging.getLogger("lockgate.quota")


class SettlePolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How hard a failed settlement is retried."""

    # Tries in all (the first one included) before a settlement is given up.
    attempts: int = 10
    # Seconds before the first retry; each further retry waits twice as long, up to `max_delay`.
    first_delay: float = 0.05
    max_delay: float = 5.0

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0-based)."""
        return float(min(self.max_delay, self.first_delay * 2.0**retry))


class Settler:
    """Runs reconciles in its own tasks, retrying failures; `drain` waits for them at shutdown."""

    def __init__(
        self,
        store: QuotaStore,
        clock: Clock,
        counters: Counter[str],
        *,
        policy: SettlePolicy | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._store = store
        self._clock = clock
        self._counters = counters
        self._policy = policy or SettlePolicy()
        self._sleep = sleep
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        """Settlements not finished yet."""
        return len(self._tasks)

    def submit(self, reservation: Reservation, actual: Sequence[float]) -> asyncio.Task[None]:
        """Settle `reservation` with `actual` in a task of the settler's own (kept until it is done)."""
        task = asyncio.get_running_loop().create_task(self.settle(reservation, tuple(actual)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settle(self, reservation: Reservation, actual: Sequence[float]) -> None:
        """Reconcile, retrying backend failures with backoff; counts the result, never raises them."""
        policy = self._policy
        failure: Exception | None = None
        for attempt in range(policy.attempts):
            if attempt:
                self._counters["settle_retried"] += 1
                await self._sleep(policy.delay(attempt - 1))
            try:
                fresh = await self._store.reconcile(reservation, actual, self._clock())
            except QuotaBusyError as exc:
                self._counters["pool_exhausted"] += 1
                failure = exc
                continue
            except QuotaBackendError as exc:
                failure = exc
                continue
            self._counters["settled" if fresh else "settle_noop"] += 1
            return
        self._counters["settle_given_up"] += 1
        # The reservation stays charged in full: the tenant is never under-charged by an outage.
        log.error(
            "gave up settling reservation %s after %d attempts: %s",
            reservation.reservation_id,
            policy.attempts,
            failure,
        )

    async def drain(self, within: float) -> None:
        """Wait up to `within` seconds for every settlement (also those submitted meanwhile); cancel and
        count as given up those still running then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while self._tasks:
            left = deadline - loop.time()
            if left <= 0:
                break
            await asyncio.wait(list(self._tasks), timeout=left)
        stuck = list(self._tasks)
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
        if stuck:
            self._counters["settle_given_up"] += len(stuck)
            log.error("shutdown cut off %d settlements still retrying; they stay charged in full", len(stuck))
