"""`SqliteTenantStore`: the embedded default, on the stdlib `sqlite3` module and one worker thread.

sqlite3 calls block, so every call runs on the single dedicated thread of a `registry.db.sqlite.SqliteWorker`,
which also owns the connection. One thread serialises the calls, so no two transactions of this process
interleave on the connection. An operational error (the file locked by another process past
`busy_timeout`, a disk error) is `UnavailableError`: the same call may succeed later.
"""

from __future__ import annotations

import msgspec

from policy.tenants.base import ConflictError, NotFoundError, TenantStoreError, UnavailableError
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
from registry.db.sqlite import Conn, SqliteStore, transaction

_RECORD = f"INSERT INTO admin_changes ({RECORD_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)"
_INSERT_TENANT = (
    f"INSERT INTO tenants ({TENANT_COLUMNS}) VALUES ({', '.join('?' for _ in TENANT_FIELDS)})"
    " ON CONFLICT (tenant_id) DO NOTHING"
)
_INSERT_KEY = (
    f"INSERT INTO api_keys ({KEY_COLUMNS}) VALUES ({', '.join('?' for _ in KEY_FIELDS)})"
    " ON CONFLICT (key_id) DO NOTHING"
)
_SET = ", ".join(f"{column} = ?" for column in TENANT_UPDATE_COLUMNS)
_UPDATE_TENANT = f"UPDATE tenants SET {_SET} WHERE tenant_id = ?"


class SqliteTenantStore(SqliteStore):
    """A `TenantStore` in one SQLite file (WAL mode), or in memory for ":memory:"."""

    what = "tenant"
    unavailable = UnavailableError
    closed_error = TenantStoreError
    migrations = MIGRATIONS
    migrations_table = MIGRATIONS_TABLE
    # A key must name an existing tenant (api_keys.tenant_id REFERENCES tenants).
    foreign_keys = True

    async def create_tenant(self, tenant: Tenant, *, actor: str, now: float) -> Tenant:
        """Add a tenant (its `created_at` set to `now`). ConflictError if the id exists."""
        stored = msgspec.structs.replace(tenant, created_at=now)

        def create(conn: Conn) -> Tenant:
            with transaction(conn):
                inserted = conn.execute(_INSERT_TENANT, tenant_row(stored)).rowcount
                if inserted == 0:
                    raise ConflictError(f"tenant {tenant.tenant_id!r} exists")
                conn.execute(_RECORD, change_row(now, actor, "tenant.create", None, stored))
            return stored

        return await self._run(create)

    async def get_tenant(self, tenant_id: str) -> Tenant:
        """One tenant, or NotFoundError."""
        return await self._run(lambda conn: _tenant(conn, tenant_id))

    async def list_tenants(self) -> list[Tenant]:
        """All tenants, ordered by id."""
        sql = f"SELECT {TENANT_COLUMNS} FROM tenants ORDER BY tenant_id"
        return await self._run(lambda conn: [tenant_from_row(row) for row in conn.execute(sql)])

    async def update_tenant(self, tenant: Tenant, *, actor: str, now: float) -> Tenant:
        """Replace a tenant's fields (its id and created_at stay). NotFoundError if absent."""

        def update(conn: Conn) -> Tenant:
            with transaction(conn):
                before = _tenant(conn, tenant.tenant_id)
                after = msgspec.structs.replace(tenant, created_at=before.created_at)
                if after != before:
                    conn.execute(_UPDATE_TENANT, (*tenant_update_row(after), tenant.tenant_id))
                    conn.execute(_RECORD, change_row(now, actor, "tenant.update", before, after))
            return after

        return await self._run(update)

    async def add_key(self, key: ApiKey, secret_hash: str, *, actor: str, now: float) -> ApiKey:
        """Store a new key (its `created_at` set to `now`). NotFoundError without its tenant."""
        stored = msgspec.structs.replace(key, created_at=now)

        def add(conn: Conn) -> ApiKey:
            with transaction(conn):
                _tenant(conn, key.tenant_id)
                inserted = conn.execute(
                    _INSERT_KEY,
                    key_row(stored, secret_hash),
                ).rowcount
                if inserted == 0:
                    raise ConflictError(f"key {key.key_id!r} exists")
                conn.execute(_RECORD, change_row(now, actor, "key.add", None, stored))
            return stored

        return await self._run(add)

    async def get_key(self, key_id: str) -> StoredKey:
        """A key with its secret hash (for authentication), or NotFoundError."""
        return await self._run(lambda conn: _key(conn, key_id))

    async def list_keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        """Keys (of one tenant, or all), ordered by creation time; never their hashes."""
        where, args = ("", ()) if tenant_id is None else (" WHERE tenant_id = ?", (tenant_id,))
        sql = f"SELECT {KEY_COLUMNS} FROM api_keys{where} ORDER BY created_at, key_id"
        return await self._run(lambda conn: [stored_key_from_row(row).key for row in conn.execute(sql, args)])

    async def revoke_key(self, key_id: str, *, actor: str, now: float) -> ApiKey:
        """Mark a key revoked at `now`; a second call keeps (and records nothing beyond) the first."""

        def revoke(conn: Conn) -> ApiKey:
            with transaction(conn):
                before = _key(conn, key_id).key
                if before.revoked_at is not None:
                    return before
                after = msgspec.structs.replace(before, revoked_at=now)
                conn.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ?", (now, key_id))
                conn.execute(_RECORD, change_row(now, actor, "key.revoke", before, after))
            return after

        return await self._run(revoke)

    async def changes(self, limit: int = 100, *, target: str | None = None) -> list[AdminChange]:
        """The newest admin changes first (optionally only those on one target, e.g. "tenant:acme")."""
        where, args = ("", (limit,)) if target is None else (" WHERE target = ?", (target, limit))
        sql = f"SELECT {CHANGE_COLUMNS} FROM admin_changes{where} ORDER BY id DESC LIMIT ?"
        return await self._run(lambda conn: [change_from_row(row) for row in conn.execute(sql, args)])


def _tenant(conn: Conn, tenant_id: str) -> Tenant:
    row = conn.execute(f"SELECT {TENANT_COLUMNS} FROM tenants WHERE tenant_id = ?", (tenant_id,)).fetchone()
    if row is None:
        raise NotFoundError(f"no tenant {tenant_id!r}")
    return tenant_from_row(row)


def _key(conn: Conn, key_id: str) -> StoredKey:
    row = conn.execute(f"SELECT {KEY_COLUMNS} FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
    if row is None:
        raise NotFoundError(f"no key {key_id!r}")
    return stored_key_from_row(row)
