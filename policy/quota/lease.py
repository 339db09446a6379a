"""Quota leases: a replica reserves a small block of a key's buckets from the shared store ahead of need, and
grants that key's requests from it in process, without a round trip.

`LeasedQuotaStore` wraps a shared store (Redis). A lease is an ordinary reservation on the shared store, of
`requests` requests' worth (at the key's recent mean ask), at most `fraction` of any bucket's capacity, under
an id of its own. Requests draw on it in this process; their settlements refund into it or take their overrun
from it; a lease is drawn on for `seconds` at most (less once it cannot fit a typical ask: spent), and once
the requests drawn on it have all settled it is settled on the shared store with what they used (its unused
part refunded). A new lease is taken in the background when the current one holds less than half of a lease,
so a steady stream of requests never waits for the shared store; a request that finds no room waits for the
lease being taken (one round trip, as without leases; if the store fails it, with the same error), or, where
no lease may be taken, reserves on its own.

What this trades for the round trip, per bucket of capacity C and refill rate R:
- Never more than the shared store grants: a lease's tokens are debited there before anything is drawn on
  it, so replicas together never admit more than the buckets allow at the time the lease was taken. A
  lease is drawn on up to `seconds` after it was taken, so in any window of W seconds the requests
  admitted come to at most C + R * (W + seconds) (C + R * W without leases).
- A request may be refused while another replica's leases still hold unused tokens. Leases are taken only
  while every bucket of the key was last seen at `floor` of its capacity or more; below that every request
  reserves on its own, exactly, and leases already taken are back within `seconds` (and the settling of
  the requests drawn on them). With N replicas the tokens leased and unused are at most
  N * 2 * `fraction` * C.
- A lease's unused part is refunded to a bucket that may have refilled to its capacity meanwhile: what
  would pass the capacity is lost (the tenant is under-charged never, over-charged at most that).

Reservation ids stay the caller's: a request granted from a lease is recorded here under its id (a retried
reserve returns it, a second settlement is a no-op, a settled id is refused for TOMBSTONE_TTL); a request
reserved on its own is the shared store's, settled there. Lease settlements run in a `Settler` of the
store's own (retried; drained by `close`). Counters: `lease_taken`, `lease_denied` (the shared store refused
a lease: the buckets are low), `lease_failed` (unreachable or busy), `lease_grants` (requests granted from a
lease), `lease_misses` (requests that found no room and reserved on their own).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence

import msgspec

from policy.clock import Clock
from policy.quota.base import (
    BucketSpec,
    QuotaBackendError,
    QuotaBusyError,
    QuotaExceededError,
    QuotaStore,
    Reservation,
    ReservationClosedError,
)
from policy.quota.memory import TOMBSTONE_TTL, check_actual, check_request, new_reservation_id
from policy.quota.settle import SettlePolicy, Settler

# Bucket sets (keys) remembered; past this, those holding no lease are forgotten.
KEYS_MAX = 10_000


class LeasePolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How large leases are and how long they last."""

    # A lease holds this many requests' worth of every bucket, at the key's recent mean ask...
    requests: int = 16
    # ...but at most this share of any bucket's capacity (a key whose one request needs more is not leased).
    fraction: float = 0.05
    # Seconds a lease is drawn on; then its unused part goes back to the shared store.
    seconds: float = 1.0
    # Leases are taken only while every bucket was last seen holding at least this share of its capacity.
    floor: float = 0.25


class _Lease:
    """One lease: the shared store's reservation, what is left of it here, and the requests drawn on it."""

    __slots__ = ("draws", "expires", "left", "open", "owner", "reservation")

    def __init__(self, owner: _Key, reservation: Reservation, expires: float) -> None:
        self.owner = owner
        self.reservation = reservation
        self.left = list(reservation.amounts)
        self.expires = expires
        # Requests granted from this lease and not settled yet.
        self.draws = 0
        # Still drawn on (False once expired or returned).
        self.open = True

    def fits(self, amounts: Sequence[float]) -> bool:
        return all(left >= amount for left, amount in zip(self.left, amounts, strict=True))

    def spent(self, mean: Sequence[float]) -> bool:
        """Whether it cannot fit a typical ask: the key's mean ask, or all it was leased where that is
        less."""
        return any(
            left < min(typical, leased)
            for left, typical, leased in zip(self.left, mean, self.reservation.amounts, strict=True)
        )

    def used(self) -> list[float]:
        """What the shared store is to keep: the lease less what is left (more than leased after an
        overrun)."""
        return [
            max(0.0, leased - left) for leased, left in zip(self.reservation.amounts, self.left, strict=True)
        ]


class _Key:
    """The leases of one bucket set (one key's buckets) and what is known of its buckets."""

    __slots__ = ("failure", "leases", "mean", "quiet_until", "seen", "taking")

    def __init__(self, buckets: Sequence[BucketSpec], amounts: Sequence[float]) -> None:
        self.leases: deque[_Lease] = deque()
        self.taking: asyncio.Task[None] | None = None
        # Mean ask per bucket (exponentially weighted), and each bucket's level as last seen on the shared
        # store (after what this replica has leased).
        self.mean = list(amounts)
        self.seen = [b.capacity for b in buckets]
        # No lease is asked for before this time (after a refusal or a failure).
        self.quiet_until = -math.inf
        # Why the last lease could not be taken (the store unreachable or our pool busy), or None.
        self.failure: QuotaBackendError | QuotaBusyError | None = None

    def left(self) -> list[float]:
        totals = [0.0] * len(self.seen)
        for lease in self.leases:
            for i, left in enumerate(lease.left):
                totals[i] += left
        return totals


class LeasedQuotaStore:
    """`QuotaStore` that grants from leases taken on `inner` (see the module docstring). Owns `inner`."""

    def __init__(
        self,
        inner: QuotaStore,
        clock: Clock,
        policy: LeasePolicy | None = None,
        *,
        settle_policy: SettlePolicy | None = None,
    ) -> None:
        self.inner = inner
        self._clock = clock
        self.policy = policy or LeasePolicy()
        self.counters: Counter[str] = Counter()
        self._settler = Settler(inner, clock, self.counters, policy=settle_policy)
        self._keys: dict[tuple[BucketSpec, ...], _Key] = {}
        # Every open lease, oldest first (they expire in that order).
        self._open: deque[_Lease] = deque()
        # Requests granted here and not settled: id -> (lease, reservation); ids settled here -> when.
        self._granted: dict[str, tuple[_Lease, Reservation]] = {}
        self._closed: OrderedDict[str, float] = OrderedDict()
        self._sweep: asyncio.TimerHandle | None = None

    async def reserve(
        self,
        buckets: Sequence[BucketSpec],
        amounts: Sequence[float],
        now: float,
        reservation_id: str | None = None,
    ) -> Reservation:
        """Grant from this key's lease when it has room; else wait for the lease being taken, or reserve on
        the shared store (see `QuotaStore.reserve`)."""
        check_request(buckets, amounts)
        rid = reservation_id or new_reservation_id()
        known = self._granted.get(rid)
        if known is not None:
            return known[1]
        if rid in self._closed:
            raise ReservationClosedError(rid)
        self.expire(now)
        spec = tuple(buckets)
        key = self._keys.get(spec)
        if key is None:
            if len(self._keys) >= KEYS_MAX:
                self._prune()
            key = self._keys[spec] = _Key(spec, amounts)
        else:
            key.mean = [0.9 * mean + 0.1 * amount for mean, amount in zip(key.mean, amounts, strict=True)]
        granted = self._draw(key, spec, amounts, rid, now)
        if granted is None and self._may_lease(key, spec, amounts, now):
            await asyncio.shield(self._take(key, spec, amounts, now))
            granted = self._draw(key, spec, amounts, rid, now)
            if granted is None and key.failure is not None:
                # The store just failed the lease: the request fails alike at once (the meter's fail mode
                # decides) rather than waiting for the same failure a second time.
                raise type(key.failure)(str(key.failure)) from key.failure
        if granted is not None:
            self.counters["lease_grants"] += 1
            return granted
        self.counters["lease_misses"] += 1
        try:
            reservation = await self.inner.reserve(buckets, amounts, now, rid)
        except QuotaExceededError as exc:
            key.seen = list(exc.levels) or key.seen
            raise
        key.seen = list(reservation.levels)
        return reservation

    def _draw(
        self, key: _Key, spec: tuple[BucketSpec, ...], amounts: Sequence[float], rid: str, now: float
    ) -> Reservation | None:
        """Debit the oldest open lease with room, or None; take the next lease in the background when what
        is left falls below half a lease. Spent leases are retired on the way: at a high rate a second's
        leases would otherwise pile up, each scanned by every request."""
        while key.leases and key.leases[0].spent(key.mean):
            self._retire(key.leases[0])
        for lease in key.leases:
            if lease.fits(amounts):
                break
        else:
            return None
        for i, amount in enumerate(amounts):
            lease.left[i] -= amount
        lease.draws += 1
        left = key.left()
        reservation = Reservation(
            reservation_id=rid,
            buckets=spec,
            amounts=tuple(amounts),
            levels=tuple(seen + mine for seen, mine in zip(key.seen, left, strict=True)),
        )
        self._granted[rid] = (lease, reservation)
        if self._wants_more(key, spec, now, left):
            self._take(key, spec, amounts, now)
        return reservation

    def _size(self, key: _Key, spec: Sequence[BucketSpec], amounts: Sequence[float]) -> list[float] | None:
        """A lease's amounts for this key (at least `amounts`), or None where one would pass `fraction`."""
        size = []
        for bucket, mean, amount in zip(spec, key.mean, amounts, strict=True):
            want = max(amount, mean * self.policy.requests)
            cap = bucket.capacity * self.policy.fraction
            if amount > cap:
                return None
            size.append(min(want, cap))
        return size

    def _may_lease(self, key: _Key, spec: Sequence[BucketSpec], amounts: Sequence[float], now: float) -> bool:
        """Whether a lease may be taken now (one being taken counts: it is waited for)."""
        if key.taking is not None:
            return True
        return (
            now >= key.quiet_until
            and self._size(key, spec, amounts) is not None
            and self._above_floor(key, spec)
        )

    def _above_floor(self, key: _Key, spec: Sequence[BucketSpec]) -> bool:
        """Whether every bucket was last seen holding at least `floor` of its capacity."""
        floor = self.policy.floor
        return all(seen >= bucket.capacity * floor for seen, bucket in zip(key.seen, spec, strict=True))

    def _wants_more(self, key: _Key, spec: Sequence[BucketSpec], now: float, left: Sequence[float]) -> bool:
        """Whether what the key's leases hold (`left`) fell below half a lease (and another may be taken)."""
        if key.taking is not None or now < key.quiet_until:
            return False
        size = self._size(key, spec, key.mean)
        if size is None:
            return False
        low = any(held < want / 2 for held, want in zip(left, size, strict=True))
        return low and self._above_floor(key, spec)

    def _take(
        self, key: _Key, spec: tuple[BucketSpec, ...], amounts: Sequence[float], now: float
    ) -> asyncio.Task[None]:
        """The task taking this key's next lease (started unless one is under way)."""
        if key.taking is None:
            key.taking = asyncio.get_running_loop().create_task(self._lease(key, spec, amounts, now))
        return key.taking

    async def _lease(
        self, key: _Key, spec: tuple[BucketSpec, ...], amounts: Sequence[float], now: float
    ) -> None:
        try:
            size = self._size(key, spec, amounts)
            if size is None:
                return
            try:
                reservation = await self.inner.reserve(spec, size, now, new_reservation_id())
            except QuotaExceededError as exc:
                self.counters["lease_denied"] += 1
                key.seen = list(exc.levels) or key.seen
                key.quiet_until = now + self.policy.seconds
                return
            except (QuotaBackendError, QuotaBusyError) as exc:
                # The requests waiting for it fail with it; later ones reserve on their own for a while, and
                # meet the store's state there.
                self.counters["lease_failed"] += 1
                key.failure = exc
                key.quiet_until = now + self.policy.seconds
                return
            key.failure = None
            self.counters["lease_taken"] += 1
            key.seen = list(reservation.levels)
            lease = _Lease(key, reservation, now + self.policy.seconds)
            key.leases.append(lease)
            self._open.append(lease)
            self._arm()
        finally:
            key.taking = None

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        """Settle a request granted here into its lease; any other on the shared store."""
        settled = self.settle_in_place(reservation, actual, now)
        if settled is not None:
            return settled
        return await self.inner.reconcile(reservation, actual, now)

    def settle_in_place(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool | None:
        """Settle a request granted here (refund into its lease, or take its overrun from it); None for a
        reservation that is not this store's to settle (the shared store's)."""
        rid = reservation.reservation_id
        granted = self._granted.pop(rid, None)
        if granted is None:
            return False if rid in self._closed else None
        check_actual(reservation, actual)
        lease, mine = granted
        for i, (reserved, used) in enumerate(zip(mine.amounts, actual, strict=True)):
            lease.left[i] += reserved - used
        lease.draws -= 1
        self._closed[rid] = now
        self._forget(now)
        if not lease.open and lease.draws == 0:
            self._settler.submit(lease.reservation, lease.used())
        return True

    async def levels(self, buckets: Sequence[BucketSpec], now: float) -> tuple[float, ...]:
        """The shared store's levels plus what this replica's leases hold unused."""
        shared = await self.inner.levels(buckets, now)
        key = self._keys.get(tuple(buckets))
        if key is None:
            return shared
        return tuple(level + left for level, left in zip(shared, key.left(), strict=True))

    def expire(self, now: float) -> None:
        """Stop drawing on leases past their time; settle those no request still draws on."""
        while self._open and self._open[0].expires <= now:
            self._retire(self._open.popleft())

    def _retire(self, lease: _Lease) -> None:
        """Stop drawing on `lease` (spent, expired or returned); settle it once no request draws on it."""
        if not lease.open:  # spent before it expired: still in `_open` until then
            return
        lease.open = False
        lease.owner.leases.remove(lease)
        if lease.draws == 0:
            self._settler.submit(lease.reservation, lease.used())

    def _arm(self) -> None:
        """Expire leases on time even when no request comes."""
        if self._sweep is None and self._open:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(max(0.0, self._open[0].expires - self._clock()), self._swept)

    def _swept(self) -> None:
        self._sweep = None
        self.expire(self._clock())
        self._arm()

    def _prune(self) -> None:
        """Forget the keys that hold no lease (what was learned of them is learned again)."""
        for spec in [spec for spec, key in self._keys.items() if not key.leases and key.taking is None]:
            del self._keys[spec]

    def _forget(self, now: float) -> None:
        horizon = now - TOMBSTONE_TTL
        closed = self._closed
        while closed:
            rid, at = next(iter(closed.items()))
            if at >= horizon:
                break
            del closed[rid]

    @property
    def keys_known(self) -> int:
        """Bucket sets (keys) this store keeps leases or what it learned for."""
        return len(self._keys)

    async def taken(self) -> None:
        """Wait for the leases being taken (in, refused or failed)."""
        taking = [key.taking for key in self._keys.values() if key.taking is not None]
        await asyncio.gather(*taking, return_exceptions=True)

    async def release(self, within: float = 10.0) -> None:
        """Stop drawing on every lease, return them (each once the requests drawn on it settle) and wait up
        to `within` seconds for those settlements. Later requests take new leases."""
        await self.taken()
        while self._open:
            self._retire(self._open.popleft())
        await self._settler.drain(within)

    async def close(self, within: float = 10.0) -> None:
        """`release` (the meter has drained first, so every request has settled), then close the shared
        store."""
        await self.release(within)
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        await self.inner.close()
