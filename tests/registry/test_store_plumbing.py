"""The store plumbing every SQL store builds on (`registry.db`): `open_store` opens the backend the storage
settings name, and each family's errors come out of the shared bases as its own (an unreachable PostgreSQL
pool, a closed SQLite store)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from policy.appeals import APPEAL_STORE
from policy.audit import (
    AUDIT_STORE,
    AuditStoreError,
    AuditUnavailableError,
    PostgresAuditStore,
    SqliteAuditStore,
)
from policy.audit.keys import MacKey
from policy.tenants import TENANT_STORE, PostgresTenantStore, SqliteTenantStore, TenantStoreError
from policy.tenants import UnavailableError as TenantUnavailableError
from registry import REGISTRY_STORE, PostgresRegistryStore, RegistryError, SqliteRegistryStore
from registry import UnavailableError as RegistryUnavailableError
from registry.db.stores import StoreKind, open_store
from tests.backends import PG_DSN, postgres_schema
from tests.policy.test_audit_store import draft


@dataclass(frozen=True)
class Storage:
    backend: Literal["sqlite", "postgres"] = "sqlite"
    sqlite_path: str = ""
    postgres_dsn: str = PG_DSN
    postgres_schema: str = "public"
    postgres_connect_timeout: float = 5.0
    postgres_command_timeout: float = 10.0


async def _read(store: Any) -> object:
    """One read each family has."""
    if isinstance(store, SqliteTenantStore | PostgresTenantStore):
        return await store.get_tenant("acme")
    if isinstance(store, SqliteRegistryStore | PostgresRegistryStore):
        return await store.generation()
    if isinstance(store, SqliteAuditStore | PostgresAuditStore):
        return await store.heads()
    return await store.get(None, "apl_x")


KINDS: list[tuple[StoreKind[Any], type[Exception], type[Exception], str]] = [
    (TENANT_STORE, TenantStoreError, TenantUnavailableError, "tenant"),
    (REGISTRY_STORE, RegistryError, RegistryUnavailableError, "registry"),
    (AUDIT_STORE, AuditStoreError, AuditUnavailableError, "audit"),
    (APPEAL_STORE, AuditStoreError, AuditUnavailableError, "appeal"),
]


@pytest.mark.parametrize(("kind", "closed", "unavailable", "what"), KINDS, ids=[k[0].name for k in KINDS])
async def test_sqlite_stores_open_by_kind_and_refuse_once_closed(
    tmp_path: Path, kind: StoreKind[Any], closed: type[Exception], unavailable: type[Exception], what: str
) -> None:
    # The file's directory does not exist yet: open_store creates it.
    path = tmp_path / "nested" / "dir" / "lockgate.sqlite3"
    store = await open_store(kind, Storage(sqlite_path=str(path)))
    assert type(store).__name__.startswith("Sqlite")
    assert path.exists()
    assert (path.stat().st_mode & 0o777) == 0o600
    await store.close()
    with pytest.raises(closed, match=f"the {what} store is closed") as caught:
        await _read(store)
    assert not isinstance(caught.value, unavailable)


@pytest.mark.parametrize(("kind", "closed", "unavailable", "what"), KINDS, ids=[k[0].name for k in KINDS])
async def test_postgres_stores_open_by_kind_and_losing_the_pool_is_their_unavailable_error(
    kind: StoreKind[Any], closed: type[Exception], unavailable: type[Exception], what: str
) -> None:
    async with postgres_schema() as (schema, _admin):
        store = await open_store(kind, Storage(backend="postgres", postgres_schema=schema))
        assert type(store).__name__.startswith("Postgres")
        await store.close()
        # A closed pool is what the driver reports as an interface error: "unreachable", not a bug.
        with pytest.raises(unavailable, match=f"the {what} database is unreachable"):
            await _read(store)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_open_store_passes_the_audit_key_on(
    tmp_path: Path, backend: Literal["sqlite", "postgres"]
) -> None:
    key = MacKey(b"s" * 32)
    async with postgres_schema() as (schema, _admin):
        storage = Storage(backend=backend, sqlite_path=str(tmp_path / "a.sqlite3"), postgres_schema=schema)
        store = await open_store(AUDIT_STORE, storage, mac_key=key)
        try:
            [record] = await store.append([draft()])
            assert record.mac is not None
            assert key.chain_mac(record.hash) == record.mac
        finally:
            await store.close()
