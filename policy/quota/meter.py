"""Per-request quota policy: which buckets apply, reserve before, settle after, and fail-open/closed.

Each request reserves 1 request and `prompt_tokens + max_tokens` tokens on every bucket that applies (tenant
and key scopes), atomically. When it ends, however it ended, `settle` refunds what it did not use. While the
store is unreachable the tenant's `fail_mode` decides: `open` admits unmetered (logged and counted), `closed`
refuses (QuotaUnavailableError).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable

import msgspec

from policy.quota.base import BucketSpec, QuotaBackendError, QuotaStore, Reservation
from policy.tenants.models import ApiKey, Limits, Tenant

log = logging.getLogger("lockgate.quota")
Clock = Callable[[], float]


class QuotaUnavailableError(Exception):
    """The quota store is unreachable and the tenant's quotas fail closed."""


class Charge(msgspec.Struct, frozen=True, kw_only=True):
    """One request's reservation (None when unmetered), with what the RateLimit headers need."""

    reservation: Reservation | None
    names: tuple[str, ...]
    # Per bucket: whether it counts tokens (else requests).
    counts_tokens: tuple[bool, ...]
    fail_open: bool = False


def _buckets(scope: str, ident: str, limits: Limits | None) -> list[tuple[str, BucketSpec, bool]]:
    """(header name, bucket, counts tokens) for one scope's request and token buckets."""
    if limits is None:
        return []
    return [
        (
            f"{scope}-requests",
            BucketSpec(
                key=f"{scope}:{ident}:req", capacity=limits.request_burst, rate=limits.requests_per_second
            ),
            False,
        ),
        (
            f"{scope}-tokens",
            BucketSpec(
                key=f"{scope}:{ident}:tok", capacity=limits.token_burst, rate=limits.tokens_per_second
            ),
            True,
        ),
    ]


def applicable(tenant: Tenant, key: ApiKey) -> list[tuple[str, BucketSpec, bool]]:
    """Every bucket a request of this key draws from."""
    return _buckets("tenant", tenant.tenant_id, tenant.quotas.tenant) + _buckets(
        "key", key.key_id, tenant.quotas.per_key
    )


class QuotaMeter:
    """Reserves and settles one request's quota against a `QuotaStore`."""

    def __init__(self, store: QuotaStore, clock: Clock) -> None:
        self.store = store
        self._clock = clock
        # Fail-open / fail-closed decisions and settle failures, by name (exported as metrics later).
        self.counters: Counter[str] = Counter()

    async def reserve(self, tenant: Tenant, key: ApiKey, tokens: int) -> Charge:
        """Reserve 1 request and `tokens` tokens on every applicable bucket, or raise.

        Raises QuotaExceededError (retry later), QuotaImpossibleError (never fits), QuotaUnavailableError."""
        spec = applicable(tenant, key)
        names = tuple(name for name, _, _ in spec)
        counts_tokens = tuple(flag for _, _, flag in spec)
        if not spec:
            return Charge(reservation=None, names=(), counts_tokens=())
        buckets = [bucket for _, bucket, _ in spec]
        amounts = [float(tokens) if flag else 1.0 for flag in counts_tokens]
        try:
            reservation = await self.store.reserve(buckets, amounts, self._clock())
        except QuotaBackendError as exc:
            if tenant.quotas.fail_mode == "open":
                self.counters["fail_open"] += 1
                log.warning(
                    "quota store unreachable (%s): tenant %s fails open, request unmetered",
                    exc,
                    tenant.tenant_id,
                )
                return Charge(reservation=None, names=names, counts_tokens=counts_tokens, fail_open=True)
            self.counters["fail_closed"] += 1
            log.warning(
                "quota store unreachable (%s): tenant %s fails closed, request refused", exc, tenant.tenant_id
            )
            raise QuotaUnavailableError("the quota service is unavailable; retry shortly") from exc
        return Charge(reservation=reservation, names=names, counts_tokens=counts_tokens)

    async def settle(self, charge: Charge, used_tokens: int) -> None:
        """Reconcile with what the request used: 1 request, `used_tokens` tokens (exactly once)."""
        reservation = charge.reservation
        if reservation is None:
            return
        actual = [float(used_tokens) if flag else 1.0 for flag in charge.counts_tokens]
        try:
            await self.store.reconcile(reservation, actual, self._clock())
        except QuotaBackendError as exc:
            # The reservation stays charged in full: the tenant is never under-charged by an outage.
            self.counters["settle_failed"] += 1
            log.warning("could not settle reservation %s: %s", reservation.reservation_id, exc)


def rate_limit_headers(
    names: tuple[str, ...], buckets: tuple[BucketSpec, ...], levels: tuple[float, ...]
) -> dict[str, str]:
    """`RateLimit-Policy` and `RateLimit` (IETF httpapi ratelimit-headers draft) for token buckets.

    Policy: `q` = burst capacity, `w` = seconds to refill from empty. Current: `r` = what is left now, `t` =
    seconds until the bucket is full again."""
    if not names:
        return {}
    policy = []
    current = []
    for name, bucket, level in zip(names, buckets, levels, strict=True):
        window = math.ceil(bucket.capacity / bucket.rate) if bucket.rate > 0 else 0
        policy.append(f'"{name}";q={math.floor(bucket.capacity)};w={window}')
        left = max(0.0, level)
        reset = math.ceil((bucket.capacity - level) / bucket.rate) if bucket.rate > 0 else 0
        current.append(f'"{name}";r={math.floor(left)};t={max(0, reset)}')
    return {"RateLimit-Policy": ", ".join(policy), "RateLimit": ", ".join(current)}
