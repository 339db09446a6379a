"""`PostgresTenantStore`: tenants and keys in PostgreSQL, shared by gateway replicas (asyncpg pool).

Each store works in one schema (`search_path` is set on every pooled connection), which it creates and
migrates on `open` (`registry.db.postgres.PostgresStore`). Concurrent replicas starting at once take turns on
an advisory lock while migrating. Losing the database (down, restarting, out of connections, a statement
over `command_timeout`) raises `UnavailableError`; the pool reconnects by itself once the server is back.
"""

from __future__ import annotations

from typing import Any

import msgspec

from policy.tenants.base import ConflictError, NotFoundError, UnavailableError
from policy.tenants.migrations import (
    CHANGE_COLUMNS,
    KEY_COLUMNS,
    KEY_FIELDS,
    MIGRATIONS,
    MIGRATIONS_TABLE,
    RECORD_COLUMNS,
    TENANT_COLUMNS,
    TENANT_FIELDS,
    TENANT_UPDATE_COLUMNS,
    change_from_row,
    change_row,
    key_row,
    stored_key_from_row,
    tenant_from_row,
    tenant_row,
    tenant_update_row,
)
from policy.tenants.models import AdminChange, ApiKey, StoredKey, Tenant
from registry.db.postgres import PostgresStore

# Ids sort by code point, as on SQLite, whatever the database's default collation.
_BY_KEY = 'ORDER BY created_at, key_id COLLATE "C"'

_RECORD = f"INSERT INTO admin_changes ({RECORD_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)"
_INSERT_TENANT = (
    f"INSERT INTO tenants ({TENANT_COLUMNS})"
    f" VALUES ({', '.join(f'${i}' for i in range(1, len(TENANT_FIELDS) + 1))})"
    " ON CONFLICT (tenant_id) DO NOTHING RETURNING 1"
)
_INSERT_KEY = (
    f"INSERT INTO api_keys ({KEY_COLUMNS})"
    f" VALUES ({', '.join(f'${i}' for i in range(1, len(KEY_FIELDS) + 1))})"
    " ON CONFLICT (key_id) DO NOTHING RETURNING 1"
)
_SET = ", ".join(f"{column} = ${i}" for i, column in enumerate(TENANT_UPDATE_COLUMNS, start=1))
_UPDATE_TENANT = f"UPDATE tenants SET {_SET} WHERE tenant_id = ${len(TENANT_UPDATE_COLUMNS) + 1}"


class PostgresTenantStore(PostgresStore):
    """A `TenantStore` in one PostgreSQL schema."""

    what = "tenant"
    unavailable = UnavailableError
    migrations = MIGRATIONS
    migrations_table = MIGRATIONS_TABLE
    # Arbitrary but fixed: every Lockgate replica migrating this store in a schema waits on the same lock.
    lock_key = 0x4C6B6774_656E616E

    async def create_tenant(self, tenant: Tenant, *, actor: str, now: float) -> Tenant:
        """Add a tenant (its `created_at` set to `now`). ConflictError if the id exists."""
        stored = msgspec.structs.replace(tenant, created_at=now)
        async with self._conn(write=True) as conn:
            inserted = await conn.fetchval(_INSERT_TENANT, *tenant_row(stored))
            if inserted is None:
                raise ConflictError(f"tenant {tenant.tenant_id!r} exists")
            await conn.execute(_RECORD, *change_row(now, actor, "tenant.create", None, stored))
        return stored

    async def get_tenant(self, tenant_id: str) -> Tenant:
        """One tenant, or NotFoundError."""
        async with self._conn() as conn:
            return await _tenant(conn, tenant_id)

    async def list_tenants(self) -> list[Tenant]:
        """All tenants, ordered by id."""
        async with self._conn() as conn:
            rows = await conn.fetch(f'SELECT {TENANT_COLUMNS} FROM tenants ORDER BY tenant_id COLLATE "C"')
        return [tenant_from_row(row) for row in rows]

    async def update_tenant(self, tenant: Tenant, *, actor: str, now: float) -> Tenant:
        """Replace a tenant's fields (its id and created_at stay). NotFoundError if absent."""
        async with self._conn(write=True) as conn:
            before = await _tenant(conn, tenant.tenant_id, lock=True)
            after = msgspec.structs.replace(tenant, created_at=before.created_at)
            if after != before:
                await conn.execute(_UPDATE_TENANT, *tenant_update_row(after), tenant.tenant_id)
                await conn.execute(_RECORD, *change_row(now, actor, "tenant.update", before, after))
        return after

    async def add_key(self, key: ApiKey, secret_hash: str, *, actor: str, now: float) -> ApiKey:
        """Store a new key (its `created_at` set to `now`). NotFoundError without its tenant."""
        stored = msgspec.structs.replace(key, created_at=now)
        async with self._conn(write=True) as conn:
            # Tenants are never deleted, so the tenant cannot vanish between this check and the insert.
            await _tenant(conn, key.tenant_id)
            inserted = await conn.fetchval(
                _INSERT_KEY,
                *key_row(stored, secret_hash),
            )
            if inserted is None:
                raise ConflictError(f"key {key.key_id!r} exists")
            await conn.execute(_RECORD, *change_row(now, actor, "key.add", None, stored))
        return stored

    async def get_key(self, key_id: str) -> StoredKey:
        """A key with its secret hash (for authentication), or NotFoundError."""
        async with self._conn() as conn:
            return await _key(conn, key_id)

    async def list_keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        """Keys (of one tenant, or all), ordered by creation time; never their hashes."""
        async with self._conn() as conn:
            if tenant_id is None:
                rows = await conn.fetch(f"SELECT {KEY_COLUMNS} FROM api_keys {_BY_KEY}")
            else:
                sql = f"SELECT {KEY_COLUMNS} FROM api_keys WHERE tenant_id = $1 {_BY_KEY}"
                rows = await conn.fetch(sql, tenant_id)
        return [stored_key_from_row(row).key for row in rows]

    async def revoke_key(self, key_id: str, *, actor: str, now: float) -> ApiKey:
        """Mark a key revoked at `now`; a second call keeps (and records nothing beyond) the first."""
        async with self._conn(write=True) as conn:
            before = (await _key(conn, key_id, lock=True)).key
            if before.revoked_at is not None:
                return before
            after = msgspec.structs.replace(before, revoked_at=now)
            await conn.execute("UPDATE api_keys SET revoked_at = $1 WHERE key_id = $2", float(now), key_id)
            await conn.execute(_RECORD, *change_row(now, actor, "key.revoke", before, after))
        return after

    async def changes(self, limit: int = 100, *, target: str | None = None) -> list[AdminChange]:
        """The newest admin changes first (optionally only those on one target, e.g. "tenant:acme")."""
        async with self._conn() as conn:
            if target is None:
                sql = f"SELECT {CHANGE_COLUMNS} FROM admin_changes ORDER BY id DESC LIMIT $1"
                rows = await conn.fetch(sql, limit)
            else:
                sql = (
                    f"SELECT {CHANGE_COLUMNS} FROM admin_changes WHERE target = $1 ORDER BY id DESC LIMIT $2"
                )
                rows = await conn.fetch(sql, target, limit)
        return [change_from_row(row) for row in rows]


async def _tenant(conn: Any, tenant_id: str, *, lock: bool = False) -> Tenant:
    # FOR UPDATE holds the row until commit, so concurrent read-modify-writes of it run one after the other.
    sql = f"SELECT {TENANT_COLUMNS} FROM tenants WHERE tenant_id = $1" + (" FOR UPDATE" if lock else "")
    row = await conn.fetchrow(sql, tenant_id)
    if row is None:
        raise NotFoundError(f"no tenant {tenant_id!r}")
    return tenant_from_row(row)


async def _key(conn: Any, key_id: str, *, lock: bool = False) -> StoredKey:
    sql = f"SELECT {KEY_COLUMNS} FROM api_keys WHERE key_id = $1" + (" FOR UPDATE" if lock else "")
    row = await conn.fetchrow(sql, key_id)
    if row is None:
        raise NotFoundError(f"no key {key_id!r}")
    return stored_key_from_row(row)
