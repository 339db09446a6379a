"""The `TenantStore` protocol: tenants, hashed API keys and the record of every admin change.

Every mutating call names its `actor` (the key id of the administrator, or "bootstrap" for the CLI) and
records an `AdminChange` (who, what, before, after) in the same transaction as the change itself. Actions are
"tenant.create", "tenant.update", "key.add" and "key.revoke"; targets are
"tenant:<tenant_id>" and "key:<key_id>"; `before` and `after` are the object as JSON (None before a create;
a key's JSON never holds its hash). A call that changes nothing (a second revoke) records nothing.

Exceptions::

    TenantStoreError            base
    ├── NotFoundError           no such tenant or key
    ├── ConflictError           the tenant or key id is taken
    └── UnavailableError        the database cannot be reached now (down, restarting, out of
                                connections); retrying later may succeed. Other driver errors are bugs.
"""

from __future__ import annotations

from typing import Protocol

from policy.tenants.models import AdminChange, ApiKey, StoredKey, Tenant


class TenantStoreError(Exception):
    """Base of tenant store failures."""


class NotFoundError(TenantStoreError):
    """No such tenant or key."""


class ConflictError(TenantStoreError):
    """The object already exists."""


class UnavailableError(TenantStoreError):
    """The database cannot be reached now; the same call may succeed later."""


class TenantStore(Protocol):
    """Tenants and keys, in SQLite (embedded default) or PostgreSQL (shared by replicas)."""

    async def create_tenant(self, tenant: Tenant, *, actor: str, now: float) -> Tenant:
        """Add a tenant (its `created_at` set to `now`). ConflictError if the id exists."""
        ...

    async def get_tenant(self, tenant_id: str) -> Tenant:
        """One tenant, or NotFoundError."""
        ...

    async def list_tenants(self) -> list[Tenant]:
        """All tenants, ordered by id."""
        ...

    async def update_tenant(self, tenant: Tenant, *, actor: str, now: float) -> Tenant:
        """Replace a tenant's fields (its id and created_at stay). NotFoundError if absent."""
        ...

    async def add_key(self, key: ApiKey, secret_hash: str, *, actor: str, now: float) -> ApiKey:
        """Store a new key (its `created_at` set to `now`) with the hash of its secret.

        NotFoundError if its tenant does not exist; ConflictError if the key id is taken.
        """
        ...

    async def get_key(self, key_id: str) -> StoredKey:
        """A key with its secret hash (for authentication), or NotFoundError."""
        ...

    async def list_keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        """Keys (of one tenant, or all), ordered by creation time; never their hashes."""
        ...

    async def revoke_key(self, key_id: str, *, actor: str, now: float) -> ApiKey:
        """Mark a key revoked at `now`; a second call keeps the first time. NotFoundError if absent."""
        ...

    async def changes(self, limit: int = 100, *, target: str | None = None) -> list[AdminChange]:
        """The newest admin changes first (optionally only those on one target, e.g. "tenant:acme")."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
