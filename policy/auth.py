"""API key authentication and role checks, with a cache so that the key store is neither the hot spot nor a
single point of failure.

Revocation bound. A verified key is cached for `cache_ttl` seconds (clock injected). While the store answers,
that is the bound on how long a key revoked on another replica keeps working here; a key revoked through this
process is dropped from its cache at once. While the store cannot be reached (a lookup fails, or takes longer
than `store_timeout`), a cached key keeps working for up to `stale_grace` seconds past its TTL: during an
outage, and only then, the bound is `cache_ttl + stale_grace`. Once a lookup has failed, such stale entries
are served at once (no wait on the store) while a background lookup renews them; the first lookup that gets
an answer ends the outage. A key that is not cached gets `StoreUnavailableError` (503) within
`store_timeout`, never a hang and never a 500.

Negative cache. A key id the store does not know is remembered for `negative_ttl` seconds, so repeating a bad
key costs no lookup; concurrent lookups of one key id share one store call, so a flood of one bad key costs
one lookup per `negative_ttl`. Distinct bad ids cost one lookup each, at most as many at once as the store's
connection pool allows. Each cache holds at most `max_entries` ids (the oldest dropped first). Key ids are
random, so a new key is never refused for an id remembered before it existed.

The secret is checked against the stored hash on every request (constant-time compare), cached or not.

Failed-auth flood. Distinct made-up key ids each cost a lookup, so failures and lookups are limited per
source (`policy.auth_limit`: a lookup takes a token as it starts, given back if the key is good): a source
past its budget is served only keys this process has cached, with no store lookup, and gets `ThrottledError`
(429) for anything else. A Bloom filter of issued key ids would
refuse unknown ids without a lookup too, but it cannot stay exact across replicas (a key created on another
one would be refused here until it was rebuilt), so this relies on the negative cache and the source limit.

Exceptions::

    AuthError                401: missing, malformed, unknown, expired or revoked key
    ForbiddenError           403: the key lacks the role the route needs
    StoreUnavailableError    503: the key is not cached and the store cannot answer now (retry later)
    ThrottledError           429: the source failed too often and the key is not cached (retry later)
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import TypeVar

import msgspec

from policy.auth_limit import FailedAuthLimit
from policy.clock import Clock
from policy.tenants.base import NotFoundError, TenantStore, UnavailableError
from policy.tenants.keys import parse_key, verify
from policy.tenants.models import ApiKey, Role, StoredKey, Tenant

_V = TypeVar("_V")
SYSTEM_TENANT = "lockgate"

log = logging.getLogger("lockgate.auth")


class AuthError(Exception):
    """The request carries no valid API key."""


class ForbiddenError(Exception):
    """The key is valid but lacks the role the route needs."""


class StoreUnavailableError(Exception):
    """The key is not cached and the tenant store cannot answer now; `retry_after` is in seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ThrottledError(Exception):
    """The source is past its budget of failed authentications and the key would need a store lookup;
    `retry_after` is in seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _NeedsLookup(Exception):
    """The key is not cached (fresh) and store lookups are not allowed for this call."""


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who is calling: a key of a tenant, with its roles."""

    tenant: Tenant
    key: ApiKey

    @property
    def is_operator_admin(self) -> bool:
        """A policy administrator of the operating organisation, who administers every tenant."""
        return self.tenant.tenant_id == SYSTEM_TENANT and "policy_admin" in self.key.roles


class _Entry(msgspec.Struct, frozen=True, kw_only=True):
    stored: StoredKey
    tenant: Tenant
    fetched_at: float


class Authenticator:
    """Turns an `Authorization` header into a `Principal`; the module docstring states its bounds."""

    def __init__(
        self,
        store: TenantStore,
        clock: Clock,
        cache_ttl: float,
        max_entries: int = 10_000,
        *,
        store_timeout: float = 1.0,
        stale_grace: float = 0.0,
        negative_ttl: float = 0.0,
        failures: FailedAuthLimit | None = None,
    ) -> None:
        """Authenticate against `store`; times from `clock` except `store_timeout`, which is real seconds.
        `failures`: the per-source limit of failed authentications (None: no limit)."""
        self._store = store
        self._failures = failures
        self._clock = clock
        self._ttl = cache_ttl
        self._max = max_entries
        self._timeout = store_timeout
        self._grace = stale_grace
        self._negative_ttl = negative_ttl
        self._retry_after = max(1, math.ceil(store_timeout))
        self._cache: dict[str, _Entry] = {}
        # key id -> clock time until which it is refused without asking the store.
        self._unknown: dict[str, float] = {}
        # key id -> (lookup, loop time it started): concurrent misses of one id share one store call.
        self._inflight: dict[str, tuple[asyncio.Task[_Entry | None], float]] = {}
        # Strong references: a lookup nobody waits for any more (it renews a stale entry, or it outlived its
        # waiters) must not be garbage collected mid-flight.
        self._tasks: set[asyncio.Task[_Entry | None]] = set()
        # Bumped by `forget`: a lookup that started before it must not put back what was just dropped.
        self._epoch = 0
        # Whether the last lookup that ended found the store unreachable.
        self._store_down = False

    def forget(self, key_id: str | None = None, tenant_id: str | None = None) -> None:
        """Drop cached entries of a key, of a tenant's keys, or (no argument) all of them."""
        self._epoch += 1
        if key_id is None and tenant_id is None:
            self._cache.clear()
            self._unknown.clear()
            return
        if key_id is not None:
            self._unknown.pop(key_id, None)
        for cached_id, entry in list(self._cache.items()):
            if cached_id == key_id or entry.tenant.tenant_id == tenant_id:
                del self._cache[cached_id]

    async def _lookup(self, key_id: str, now: float, admit: Callable[[], bool] | None = None) -> _Entry:
        """The cached or stored entry of `key_id`; `admit` (if given) is asked before the store is, and
        False from it is `_NeedsLookup`."""
        entry = self._cache.get(key_id)
        if entry is not None and now - entry.fetched_at < self._ttl:
            return entry
        refused_until = self._unknown.get(key_id)
        if refused_until is not None:
            if now < refused_until:
                raise AuthError("invalid API key")
            del self._unknown[key_id]
        # Joining a lookup of this key already in flight costs the store nothing: only a new one is admitted.
        if admit is not None and not self._running(key_id) and not admit():
            raise _NeedsLookup(key_id)
        stale = entry if entry is not None and now - entry.fetched_at < self._ttl + self._grace else None
        task = self._start(key_id, now)
        if stale is not None and self._store_down:
            # The outage is known: no request waits on the store for it; `task` renews the entry.
            return stale
        # A hard bound of our own: the lookup's own timeout cancels it, but asyncpg may then wait on the
        # server (returning the connection to its pool) before the cancellation completes.
        done, _ = await asyncio.wait({task}, timeout=self._timeout)
        if task in done and not task.cancelled() and task.exception() is None:
            found = task.result()
            if found is None:
                raise AuthError("invalid API key")
            return found
        if task in done and not task.cancelled():
            error = task.exception()
            if not isinstance(error, TimeoutError | UnavailableError):
                raise error  # type: ignore[misc]  # a bug, not an outage: it stays what it is
        self._mark_down(True)
        if stale is not None:
            return stale
        raise StoreUnavailableError(
            "the key store is unavailable; try again shortly", retry_after=self._retry_after
        )

    def _running(self, key_id: str) -> asyncio.Task[_Entry | None] | None:
        """The lookup of `key_id` in flight, if still within its time limit."""
        running = self._inflight.get(key_id)
        if running is not None and asyncio.get_running_loop().time() - running[1] < self._timeout:
            return running[0]
        return None

    def _start(self, key_id: str, now: float) -> asyncio.Task[_Entry | None]:
        """The lookup of `key_id`: the one in flight if still within its time limit, or a new one."""
        loop = asyncio.get_running_loop()
        running = self._running(key_id)
        if running is not None:
            return running
        task = asyncio.create_task(self._fetch(key_id, now, self._epoch))
        self._inflight[key_id] = (task, loop.time())
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._finished(key_id, done))
        return task

    def _finished(self, key_id: str, task: asyncio.Task[_Entry | None]) -> None:
        self._tasks.discard(task)
        running = self._inflight.get(key_id)
        if running is not None and running[0] is task:
            del self._inflight[key_id]
        if not task.cancelled():
            task.exception()  # retrieved: a renewal nobody awaited must not log "never retrieved"

    async def _fetch(self, key_id: str, now: float, epoch: int) -> _Entry | None:
        """Ask the store (within `store_timeout`); cache the answer. None: no such key (or tenant)."""
        try:
            async with asyncio.timeout(self._timeout):
                stored = await self._store.get_key(key_id)
                tenant = await self._store.get_tenant(stored.key.tenant_id)
        except NotFoundError:
            self._mark_down(False)
            self._cache.pop(key_id, None)
            if self._negative_ttl > 0:
                _put(self._unknown, key_id, now + self._negative_ttl, self._max)
            return None
        except (TimeoutError, UnavailableError) as exc:
            self._mark_down(True, exc)
            raise
        self._mark_down(False)
        # `now` is when the lookup started: the answer is at least that fresh, so the TTL is not stretched.
        entry = _Entry(stored=stored, tenant=tenant, fetched_at=now)
        if epoch == self._epoch:
            _put(self._cache, key_id, entry, self._max)
        return entry

    def _mark_down(self, down: bool, exc: BaseException | None = None) -> None:
        if down and not self._store_down:
            log.warning("tenant store unreachable; serving cached keys only: %r", exc)
        elif not down and self._store_down:
            log.warning("tenant store reachable again")
        self._store_down = down

    async def authenticate(self, authorization: str | None, source: str | None = None) -> Principal:
        """The principal of a `Bearer` key, or AuthError saying what is wrong (never which part matched).
        `source` (`policy.auth_limit.source_of` the client's address): failures count against it, and past
        its budget only cached keys are served (ThrottledError otherwise)."""
        limit = self._failures
        if limit is None or source is None:
            return await self._authenticate(authorization, None)
        charged = False

        def admit() -> bool:
            # A store lookup takes a token as it starts (so concurrent ones cannot outrun the bucket).
            nonlocal charged
            charged = limit.take(source)
            return charged

        try:
            principal = await self._authenticate(authorization, admit)
        except AuthError:
            if not charged:
                limit.failed(source)
            raise
        except _NeedsLookup:
            raise ThrottledError(
                "too many failed authentications from this address; retry later",
                retry_after=limit.retry_after(source) or 1.0,
            ) from None
        except BaseException:
            if charged:  # the store could not answer: not the client's failure
                limit.refund(source)
            raise
        if charged:
            limit.refund(source)
        return principal

    async def _authenticate(self, authorization: str | None, admit: Callable[[], bool] | None) -> Principal:
        if not authorization:
            raise AuthError("missing API key: send `Authorization: Bearer <key>`")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("malformed Authorization header: expected `Bearer <key>`")
        parsed = parse_key(token.strip())
        if parsed is None:
            raise AuthError("invalid API key")
        key_id, secret = parsed
        now = self._clock()
        entry = await self._lookup(key_id, now, admit)
        if not verify(secret, entry.stored.secret_hash):
            raise AuthError("invalid API key")
        key = entry.stored.key
        if key.revoked_at is not None and key.revoked_at <= now:
            raise AuthError("this API key has been revoked")
        if key.expires_at is not None and now >= key.expires_at:
            raise AuthError("this API key has expired")
        return Principal(tenant=entry.tenant, key=key)


def require_role(principal: Principal, role: Role) -> None:
    """ForbiddenError unless the key has `role`."""
    if role not in principal.key.roles:
        raise ForbiddenError(f"this API key lacks the `{role}` role")


def _put(cache: dict[str, _V], key: str, value: _V, limit: int) -> None:
    """Insert `value` as the newest entry, dropping the oldest ones beyond `limit` (bounded memory)."""
    cache.pop(key, None)
    while len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value
