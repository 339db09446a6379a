"""The `QuotaStore` protocol: token buckets reserved before a request and reconciled after it.

A bucket has capacity C and refill rate R per second. `reserve` checks and debits every bucket of one request
atomically (all or nothing); a denial says how long until the request would fit. `reconcile` settles a
reservation once the request ended, however it ended: it refunds what was reserved but not used, or charges
the overrun, exactly once per reservation.

Reservation ids are chosen by the caller, so both operations are idempotent by id and safe to retry after a
timeout that left their outcome unknown: a granted reserve is recorded under its id, and running it again
returns the recorded outcome without debiting twice. `reconcile` settles only a recorded (granted)
reservation; for an id that was never granted it leaves a tombstone, so a reserve that was still in flight
and arrives later is refused instead of debiting tokens nobody will refund. Denials are not recorded (nothing
was debited, so a retry may simply be granted).

Invariant: a bucket's level never exceeds its capacity. A charged overrun may take it below zero (debt that
later refill pays back).

Exceptions::

    QuotaError                 base
    ├── QuotaExceededError     not now: `retry_after` seconds until it would fit
    ├── QuotaImpossibleError   never: an amount above a bucket's capacity
    ├── ReservationClosedError this reservation id was already settled (or voided): it is never granted again
    ├── QuotaBusyError         every operation slot of our own stayed busy past its wait bound: our load,
    │                          not the store's health (never a fail-open / fail-closed decision)
    └── QuotaBackendError      the store is unreachable or timed out (the tenant's fail mode decides)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec


class QuotaError(Exception):
    """Base of every quota failure."""


class QuotaExceededError(QuotaError):
    """The request does not fit now."""

    def __init__(self, bucket: str, retry_after: float, levels: Sequence[float]) -> None:
        super().__init__(f"bucket {bucket} is short; fits in {retry_after:.3f} s")
        self.bucket = bucket
        self.retry_after = retry_after
        self.levels = tuple(levels)


class QuotaImpossibleError(QuotaError):
    """The request can never fit: it asks for more than a bucket's capacity."""

    def __init__(self, bucket: str, amount: float, capacity: float) -> None:
        super().__init__(f"bucket {bucket} holds at most {capacity:g}; {amount:g} can never fit")
        self.bucket = bucket
        self.amount = amount
        self.capacity = capacity


class ReservationClosedError(QuotaError):
    """`reserve` was called with an id that was already settled or voided: it is never granted again."""

    def __init__(self, reservation_id: str) -> None:
        super().__init__(f"reservation {reservation_id} was already settled")
        self.reservation_id = reservation_id


class QuotaBusyError(QuotaError):
    """No operation slot (or connection) to the store came free within its wait bound; the store itself may be
    healthy."""


class QuotaBackendError(QuotaError):
    """The quota store cannot be reached in time."""


class BucketSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One token bucket: where it lives, how much it holds, how fast it refills."""

    key: str
    capacity: float
    rate: float


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """What `reserve` debited, to be settled by `reconcile`."""

    reservation_id: str
    buckets: tuple[BucketSpec, ...]
    amounts: tuple[float, ...]
    # Level of each bucket right after the debit (for RateLimit headers).
    levels: tuple[float, ...]


class QuotaStore(Protocol):
    """Token-bucket state shared by every gateway replica that uses the same store."""

    async def reserve(
        self,
        buckets: Sequence[BucketSpec],
        amounts: Sequence[float],
        now: float,
        reservation_id: str | None = None,
    ) -> Reservation:
        """Debit `amounts` from `buckets` at time `now`, all or nothing, as reservation `reservation_id`
        (a fresh id when None). Called again with the id of a granted reservation, returns that reservation
        and debits nothing. A store with an authoritative clock of its own (Redis server time) may use it
        instead of `now`.

        Raises QuotaExceededError (with the wait until it fits), QuotaImpossibleError, ReservationClosedError,
        QuotaBusyError, QuotaBackendError."""
        ...

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        """Settle a reservation with the amounts actually used. Returns True if this call settled a granted
        reservation; False if it was settled before, or was never granted (then its id is closed, so a late
        reserve with it is refused)."""
        ...

    async def levels(self, buckets: Sequence[BucketSpec], now: float) -> tuple[float, ...]:
        """Current level of each bucket (refilled to `now`), without changing anything."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
