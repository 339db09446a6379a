"""Per-request quota policy: which buckets apply, reserve before, settle after, and fail-open/closed.

Each request reserves 1 request and `prompt_tokens + max_tokens` tokens on every bucket that applies (tenant
and key scopes), atomically. When it ends, however it ended, `settle_later` refunds what it did not use, in
the settler's own tasks (retried, drained at shutdown: see `policy.quota.settle`), or at once on the
in-process store and for what a leased store granted from a lease (`policy.quota.lease`), which cannot fail
or wait. While the store is
unreachable the tenant's `fail_mode` decides: `open` admits unmetered (logged and counted), `closed` refuses
(QuotaUnavailableError). Our own connection pool staying busy is not the store being unreachable: it is
counted as `pool_exhausted` and refused as QuotaBusyError whatever the fail mode.

The meter picks each reservation id before it calls the store. A reserve that fails as unreachable may still
have run (the reply was lost, or the command is still queued in a stalled Redis), so its outcome is unknown:
the meter settles that id anyway, by id, with what the request used (nothing when it was refused). If the
reserve had been granted, that refunds it (or charges the usage of a fail-open request); if it had not run
yet, the id is closed and a late arrival of it debits nothing. Only a settlement that is given up leaves a
reservation charged in full: an over-charge, never an under-charge.

Bucket keys carry the tenant as a Redis Cluster hash tag (`tenant:{acme}:tok`, `key:{acme}:<key id>:tok`), so
every key of one request, and its reservation record, live in one cluster slot.

Counters: `reserved` (granted), `denied` (a bucket was short), `reserve_unknown` (outcome unknown, settled by
id), `fail_open`, `fail_closed`, `pool_exhausted`, and the settler's `settled`, `settle_noop`,
`settle_retried`, `settle_given_up`. Once every settlement has finished:
reserved + reserve_unknown == settled + settle_noop + settle_given_up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
from collections import Counter
from collections.abc import Callable, Sequence

import msgspec

from policy.clock import Clock, Sleep
from policy.quota.base import (
    BucketSpec,
    QuotaBackendError,
    QuotaBusyError,
    QuotaExceededError,
    QuotaStore,
    Reservation,
)
from policy.quota.lease import LeasedQuotaStore
from policy.quota.memory import MemoryQuotaStore
from policy.quota.settle import SettlePolicy, Settler
from policy.tenants.models import ApiKey, Limits, Quotas, Tenant

log = logging.getLogger("lockgate.quota")
# Keys whose bucket sets a meter remembers; past this it starts again.
BUCKET_SETS_MAX = 10_000


class QuotaUnavailableError(Exception):
    """The quota store is unreachable and the tenant's quotas fail closed."""


class BucketSet(msgspec.Struct, frozen=True, kw_only=True):
    """The buckets a key's requests draw from, in order, with what every request's headers repeat."""

    # Header names (`tenant-requests`, ...), and per bucket whether it counts tokens (else requests).
    names: tuple[str, ...]
    buckets: tuple[BucketSpec, ...]
    counts_tokens: tuple[bool, ...]
    # The `RateLimit-Policy` header's value ("" without buckets).
    policy: str
    # OpenAI's headers, per kind of bucket present: the three header names (`x-ratelimit-limit-requests`,
    # `...-remaining-...`, `...-reset-...`) and the indices of that kind's buckets (`rate_limit_headers`).
    openai_kinds: tuple[tuple[tuple[str, str, str], tuple[int, ...]], ...] = ()


class Charge(msgspec.Struct, frozen=True, kw_only=True):
    """One request's reservation (None when unmetered), with what the RateLimit headers need."""

    reservation: Reservation | None
    bucket_set: BucketSet
    fail_open: bool = False
    # A fail-open request whose reserve may have run after all: settled by id like a granted one.
    pending: Reservation | None = None


def _buckets(scope: str, ident: str, limits: Limits | None) -> list[tuple[str, BucketSpec, bool]]:
    """(header name, bucket, counts tokens) for one scope's request and token buckets; `ident` carries the
    tenant's hash tag."""
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
    """Every bucket a request of this key draws from, all under the tenant's hash tag `{tenant}`."""
    tag = f"{{{tenant.tenant_id}}}"
    return _buckets("tenant", tag, tenant.quotas.tenant) + _buckets(
        "key", f"{tag}:{key.key_id}", tenant.quotas.per_key
    )


def bucket_set(tenant: Tenant, key: ApiKey) -> BucketSet:
    """`applicable`'s buckets as a `BucketSet`."""
    spec = applicable(tenant, key)
    names = tuple(name for name, _, _ in spec)
    buckets = tuple(bucket for _, bucket, _ in spec)
    policy = ", ".join(
        f'"{name}";q={math.floor(bucket.capacity)};w={_refill_window(bucket)}'
        for name, bucket in zip(names, buckets, strict=True)
    )
    counts_tokens = tuple(flag for _, _, flag in spec)
    openai_kinds = tuple(
        (
            (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}"),
            indices,
        )
        for kind, tokens in (("requests", False), ("tokens", True))
        if (indices := tuple(i for i, flag in enumerate(counts_tokens) if flag is tokens))
    )
    return BucketSet(
        names=names, buckets=buckets, counts_tokens=counts_tokens, policy=policy, openai_kinds=openai_kinds
    )


def _refill_window(bucket: BucketSpec) -> int:
    """Seconds a bucket takes to refill from empty (0 for one that never refills)."""
    return math.ceil(bucket.capacity / bucket.rate) if bucket.rate > 0 else 0


class QuotaMeter:
    """Reserves and settles one request's quota against a `QuotaStore`."""

    def __init__(
        self,
        store: QuotaStore,
        clock: Clock,
        *,
        settle_policy: SettlePolicy | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.store = store
        self._clock = clock
        # Reservation ids: a random prefix of this meter's and a count, unique across replicas (the
        # exactly-once marker is keyed by them) without a UUID and a read of the OS's randomness per request.
        self._id_prefix = secrets.token_hex(12)
        self._id_count = itertools.count()
        # Reservations, fail-open / fail-closed decisions and settlements, by name (see the module docstring).
        self.counters: Counter[str] = Counter()
        self.settler = Settler(store, clock, self.counters, policy=settle_policy, sleep=sleep)
        # The in-process store, and a leased store for what it granted from a lease, settle at once and
        # cannot fail for want of a backend: no task to hand it to, nothing to retry, nothing a cancelled
        # request could cut off (None: not this store's to settle in place). Exactly those classes: a
        # subclass or a wrapper may reconcile otherwise (tests make theirs fail), so it goes through the
        # settler.
        self._settle_now: Callable[[Reservation, Sequence[float], float], bool | None] | None = None
        if type(store) is MemoryQuotaStore:
            self._settle_now = store.reconcile_now
        elif type(store) is LeasedQuotaStore:
            self._settle_now = store.settle_in_place
        # Each key's bucket set, with the tenant's quotas it was made from, by (tenant id, key id): the same
        # for every request until an administrator changes the quotas.
        self._bucket_sets: dict[tuple[str, str], tuple[Quotas, BucketSet]] = {}

    def buckets_for(self, tenant: Tenant, key: ApiKey) -> BucketSet:
        """The buckets a request of this key draws from (`bucket_set`, remembered while the quotas hold)."""
        ident = (tenant.tenant_id, key.key_id)
        known = self._bucket_sets.get(ident)
        if known is not None and known[0] == tenant.quotas:
            return known[1]
        made = bucket_set(tenant, key)
        if len(self._bucket_sets) >= BUCKET_SETS_MAX:
            self._bucket_sets.clear()
        self._bucket_sets[ident] = (tenant.quotas, made)
        return made

    async def tokens_left(self, tenant: Tenant, key: ApiKey) -> float | None:
        """The fewest tokens left in the token buckets this key's requests draw from, changing nothing (None:
        no token quota applies). Raises QuotaBackendError when the store cannot be read."""
        spec = self.buckets_for(tenant, key)
        buckets = [b for b, tokens in zip(spec.buckets, spec.counts_tokens, strict=True) if tokens]
        if not buckets:
            return None
        return min(await self.store.levels(buckets, self._clock()))

    async def reserve(self, tenant: Tenant, key: ApiKey, tokens: int) -> Charge:
        """Reserve 1 request and `tokens` tokens on every applicable bucket, or raise.

        Raises QuotaExceededError (retry later), QuotaImpossibleError (never fits), QuotaUnavailableError."""
        spec = self.buckets_for(tenant, key)
        if not spec.buckets:
            return Charge(reservation=None, bucket_set=spec)
        buckets = spec.buckets
        amounts = tuple(float(tokens) if flag else 1.0 for flag in spec.counts_tokens)
        # Chosen here, before the call: if the reply is lost, this id still names whatever the store did.
        rid = f"{self._id_prefix}{next(self._id_count):x}"
        try:
            reservation = await self.store.reserve(buckets, amounts, self._clock(), rid)
        except QuotaBusyError:
            # Nothing was sent: there is nothing to settle, and Redis is not unreachable.
            self.counters["pool_exhausted"] += 1
            raise
        except QuotaExceededError:
            self.counters["denied"] += 1
            raise
        except QuotaBackendError as exc:
            self.counters["reserve_unknown"] += 1
            unknown = Reservation(reservation_id=rid, buckets=buckets, amounts=amounts, levels=())
            if tenant.quotas.fail_mode == "open":
                self.counters["fail_open"] += 1
                log.warning(
                    "quota store unreachable (%s): tenant %s fails open, request unmetered",
                    exc,
                    tenant.tenant_id,
                )
                return Charge(reservation=None, bucket_set=spec, fail_open=True, pending=unknown)
            self.counters["fail_closed"] += 1
            log.warning(
                "quota store unreachable (%s): tenant %s fails closed, request refused", exc, tenant.tenant_id
            )
            # Refused: if the reserve ran after all, refund all of it (the request never ran).
            self.settler.submit(unknown, [0.0] * len(amounts))
            raise QuotaUnavailableError("the quota service is unavailable; retry shortly") from exc
        self.counters["reserved"] += 1
        return Charge(reservation=reservation, bucket_set=spec)

    def _actual(self, charge: Charge, used_tokens: int) -> list[float]:
        return [float(used_tokens) if flag else 1.0 for flag in charge.bucket_set.counts_tokens]

    def settle_later(self, charge: Charge, used_tokens: int) -> None:
        """Settle with what the request used (1 request, `used_tokens` tokens) in the settler's own task:
        safe to call from a task that is being cancelled; retried on failure; drained at shutdown. On the
        in-process store, settled here and now."""
        reservation = charge.reservation or charge.pending
        if reservation is None:
            return
        actual = self._actual(charge, used_tokens)
        if self._settle_now is not None:
            settled = self._settle_now(reservation, actual, self._clock())
            if settled is not None:
                self.counters["settled" if settled else "settle_noop"] += 1
                return
        self.settler.submit(reservation, actual)

    async def settle(self, charge: Charge, used_tokens: int) -> None:
        """Like `settle_later`, awaited here (retries included)."""
        reservation = charge.reservation or charge.pending
        if reservation is not None:
            await self.settler.settle(reservation, self._actual(charge, used_tokens))

    async def drain(self, within: float) -> None:
        """Wait up to `within` seconds for every settlement in flight (shutdown, before the store closes)."""
        await self.settler.drain(within)


def rate_limit_headers(spec: BucketSet, levels: tuple[float, ...]) -> dict[str, str]:
    """`RateLimit-Policy` and `RateLimit` (IETF httpapi ratelimit-headers draft) for token buckets, and
    OpenAI's `x-ratelimit-*` headers, which clients written against OpenAI read (LiteLLM's router, the
    cookbook's throttlers).

    Policy: `q` = burst capacity, `w` = seconds to refill from empty. Current: `r` = what is left now, `t` =
    seconds until the bucket is full again. OpenAI's, per kind (requests, tokens), from the bucket of that
    kind with the least left (the tenant's or the key's): `limit` its capacity, `remaining` what is left,
    `reset` the time until it is full again (Go's duration format, as OpenAI sends it: `20ms`, `1s`,
    `6m0s`)."""
    if not spec.names:
        return {}
    current = []
    until_full = []
    for name, bucket, level in zip(spec.names, spec.buckets, levels, strict=True):
        full_in = (bucket.capacity - level) / bucket.rate if bucket.rate > 0 else 0.0
        until_full.append(full_in)
        current.append(f'"{name}";r={math.floor(max(0.0, level))};t={max(0, math.ceil(full_in))}')
    headers = {"RateLimit-Policy": spec.policy, "RateLimit": ", ".join(current)}
    for (limit, remaining, reset), indices in spec.openai_kinds:
        i = indices[0] if len(indices) == 1 else min(indices, key=levels.__getitem__)
        headers[limit] = str(math.floor(spec.buckets[i].capacity))
        headers[remaining] = str(math.floor(max(0.0, levels[i])))
        headers[reset] = go_duration(until_full[i])
    return headers


def go_duration(seconds: float) -> str:
    """`seconds`, rounded up to the millisecond, as Go prints a duration: `0s`, `20ms`, `1.5s`, `6m0s`."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    whole, fraction = divmod(ms, 1000)
    text = f"{whole}.{fraction:03d}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return text
