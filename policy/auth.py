"""API key authentication and role checks, with a short-lived cache so the key store is not the hot spot.

A verified key is cached for `cache_ttl` seconds (clock injected). That is the bound on how long a key revoked
on another replica keeps working here; a key revoked through this process is dropped from its cache at once.
The secret is checked against the stored hash on every request (constant-time compare), cached or not.

Exceptions::

    AuthError                401: missing, malformed, unknown, expired or revoked key
    ForbiddenError           403: the key lacks the role the route needs
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from policy.tenants.base import NotFoundError, TenantStore
from policy.tenants.keys import parse_key, verify
from policy.tenants.models import ApiKey, Role, StoredKey, Tenant

Clock = Callable[[], float]
SYSTEM_TENANT = "lockgate"


class AuthError(Exception):
    """The request carries no valid API key."""


class ForbiddenError(Exception):
    """The key is valid but lacks the role the route needs."""


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
    """Turns an `Authorization` header into a `Principal`."""

    def __init__(self, store: TenantStore, clock: Clock, cache_ttl: float, max_entries: int = 10_000) -> None:
        self._store = store
        self._clock = clock
        self._ttl = cache_ttl
        self._max = max_entries
        self._cache: dict[str, _Entry] = {}

    def forget(self, key_id: str | None = None, tenant_id: str | None = None) -> None:
        """Drop cached entries of a key, of a tenant's keys, or (no argument) all of them."""
        if key_id is None and tenant_id is None:
            self._cache.clear()
            return
        for cached_id, entry in list(self._cache.items()):
            if cached_id == key_id or entry.tenant.tenant_id == tenant_id:
                del self._cache[cached_id]

    async def _lookup(self, key_id: str, now: float) -> _Entry:
        entry = self._cache.get(key_id)
        if entry is not None and now - entry.fetched_at < self._ttl:
            return entry
        try:
            stored = await self._store.get_key(key_id)
            tenant = await self._store.get_tenant(stored.key.tenant_id)
        except NotFoundError as exc:
            self._cache.pop(key_id, None)
            raise AuthError("invalid API key") from exc
        if len(self._cache) >= self._max:
            self._cache.clear()  # bounded memory; the next requests refill it
        entry = _Entry(stored=stored, tenant=tenant, fetched_at=now)
        self._cache[key_id] = entry
        return entry

    async def authenticate(self, authorization: str | None) -> Principal:
        """The principal of a `Bearer` key, or AuthError saying what is wrong (never which part matched)."""
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
        entry = await self._lookup(key_id, now)
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
