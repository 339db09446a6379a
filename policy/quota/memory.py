"""In-process token buckets: the embedded default, for a single gateway replica.

Every method runs to completion without an `await`, so under asyncio each reserve or reconcile is one
indivisible step of the event loop: no lock is needed for check-then-debit to be atomic.
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from collections.abc import Sequence

from policy.quota.base import (
    BucketSpec,
    QuotaExceededError,
    QuotaImpossibleError,
    Reservation,
    ReservationClosedError,
)

# How long a reservation id is remembered, in seconds of the caller's clock. A granted reservation is
# reconciled within one request's lifetime: an hour outlives any request (one not settled by then keeps the
# charge it reserved). A closed id (settled or voided) is kept only to refuse a reserve of that id
# that arrives late (sent before a timeout, run by Redis after the void): five minutes outlive such a reply
# and every settlement retry. A reconcile of a forgotten id is a no-op either way, so forgetting loses nothing
# and the tombstones, one per request, stay 12 times fewer than an hour's worth (about 450,000 at 1,500
# requests/s instead of 5.4 million).
RECORD_TTL = 3600.0
TOMBSTONE_TTL = 300.0


class _Bucket:
    """Mutable state of one bucket: `level` tokens as of time `ts`."""

    __slots__ = ("level", "ts")

    def __init__(self, level: float, ts: float) -> None:
        self.level = level
        self.ts = ts


def check_request(buckets: Sequence[BucketSpec], amounts: Sequence[float]) -> None:
    """Reject malformed requests and those that can never fit, before touching any state."""
    if len(buckets) != len(amounts):
        raise ValueError(f"{len(buckets)} buckets but {len(amounts)} amounts")
    if len({b.key for b in buckets}) != len(buckets):
        # One script pass reads each key once; a repeated key would be debited against a stale level.
        raise ValueError("a bucket key appears twice in one request")
    for bucket, amount in zip(buckets, amounts, strict=True):
        if not amount >= 0 or math.isinf(amount):
            raise ValueError(f"amount for bucket {bucket.key} must be finite and >= 0, got {amount!r}")
        if amount > bucket.capacity:
            raise QuotaImpossibleError(bucket.key, amount, bucket.capacity)


def check_actual(reservation: Reservation, actual: Sequence[float]) -> None:
    """Reject reconcile amounts that do not match the reservation's buckets."""
    if len(actual) != len(reservation.buckets):
        raise ValueError(f"{len(reservation.buckets)} buckets but {len(actual)} actual amounts")
    if any(not a >= 0 or math.isinf(a) for a in actual):
        raise ValueError(f"actual amounts must be finite and >= 0, got {tuple(actual)!r}")


def new_reservation_id() -> str:
    """A reservation id unique across replicas (the exactly-once marker is keyed by it)."""
    return uuid.uuid4().hex


class MemoryQuotaStore:
    """`QuotaStore` kept in this process's memory; state is lost on restart and not shared."""

    def __init__(self, *, record_ttl: float = RECORD_TTL, tombstone_ttl: float = TOMBSTONE_TTL) -> None:
        self._buckets: dict[str, _Bucket] = {}
        # Reservation id -> (`now` when granted, the reservation), and closed id -> `now` when closed; each
        # oldest first, so expiry pops from the front.
        self._granted: OrderedDict[str, tuple[float, Reservation]] = OrderedDict()
        self._closed: OrderedDict[str, float] = OrderedDict()
        self._record_ttl = record_ttl
        self._tombstone_ttl = tombstone_ttl

    def _refilled(self, spec: BucketSpec, now: float) -> tuple[float, float]:
        """(level, ts) of a bucket refilled up to `now`; a bucket never seen is full."""
        state = self._buckets.get(spec.key)
        if state is None:
            return spec.capacity, now
        # A clock that goes backwards (another replica's skew) must not mint tokens: time only moves forward.
        ts = max(now, state.ts)
        # Invariant: level <= capacity after every refill.
        return min(spec.capacity, state.level + spec.rate * (ts - state.ts)), ts

    async def reserve(
        self,
        buckets: Sequence[BucketSpec],
        amounts: Sequence[float],
        now: float,
        reservation_id: str | None = None,
    ) -> Reservation:
        """Debit `amounts` from `buckets` at `now`, all or nothing (see `QuotaStore.reserve`)."""
        check_request(buckets, amounts)
        self._forget(now)
        rid = reservation_id or new_reservation_id()
        if rid in self._closed:
            raise ReservationClosedError(rid)
        if rid in self._granted:
            return self._granted[rid][1]  # A retry of a granted reserve: the same outcome, debited once.
        refilled = [self._refilled(spec, now) for spec in buckets]
        worst, worst_wait = -1, -1.0
        for i, (spec, amount, (level, ts)) in enumerate(zip(buckets, amounts, refilled, strict=True)):
            if level < amount:
                # A bucket whose clock is ahead of ours refills only once our clock catches up with it.
                wait = (amount - level) / spec.rate + (ts - now) if spec.rate > 0 else math.inf
                if wait > worst_wait:
                    worst, worst_wait = i, wait
        if worst >= 0:
            # Denied: nothing is written, so every bucket is exactly as it was.
            raise QuotaExceededError(buckets[worst].key, worst_wait, [level for level, _ in refilled])
        levels = []
        for spec, amount, (level, ts) in zip(buckets, amounts, refilled, strict=True):
            # Invariant: a debit only lowers the level, so level <= capacity still holds.
            self._buckets[spec.key] = _Bucket(level - amount, ts)
            levels.append(level - amount)
        reservation = Reservation(
            reservation_id=rid, buckets=tuple(buckets), amounts=tuple(amounts), levels=tuple(levels)
        )
        self._granted[rid] = (now, reservation)
        return reservation

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        """Refund or charge the difference between reserved and actual; False if already settled."""
        return self.reconcile_now(reservation, actual, now)

    def reconcile_now(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        """`reconcile`, called without awaiting (it never waits): the meter settles in place with it."""
        check_actual(reservation, actual)
        self._forget(now)
        rid = reservation.reservation_id
        granted = self._granted.pop(rid, None)
        # Settled, voided or never granted alike: from now on the id is closed (a tombstone).
        self._closed.setdefault(rid, now)
        if granted is None:
            return False
        for spec, reserved, used in zip(reservation.buckets, reservation.amounts, actual, strict=True):
            level, ts = self._refilled(spec, now)
            # Invariant: a refund is capped at capacity; an overrun may leave debt (a negative level).
            self._buckets[spec.key] = _Bucket(min(spec.capacity, level + (reserved - used)), ts)
        return True

    async def levels(self, buckets: Sequence[BucketSpec], now: float) -> tuple[float, ...]:
        """Each bucket's level refilled to `now`; nothing is written."""
        return tuple(self._refilled(spec, now)[0] for spec in buckets)

    async def close(self) -> None:
        """Nothing to release; drops the state."""
        self._buckets.clear()
        self._granted.clear()
        self._closed.clear()

    def _forget(self, now: float) -> None:
        """Drop records older than their TTL, so they stay bounded by the request rate x TTL."""
        horizon = now - self._record_ttl
        while self._granted:
            oldest_id, (granted_at, _) = next(iter(self._granted.items()))
            if granted_at >= horizon:
                break
            del self._granted[oldest_id]
        horizon = now - self._tombstone_ttl
        while self._closed:
            oldest_id, closed_at = next(iter(self._closed.items()))
            if closed_at >= horizon:
                break
            del self._closed[oldest_id]
