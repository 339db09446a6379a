"""Backend specifics of the registry stores: migrations, sharing a database, threads, schema names."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest

from policy.tenants import SqliteTenantStore, Tenant
from registry import MIGRATIONS, PostgresRegistryStore, RegistryError, SqliteRegistryStore, UnavailableError
from tests.backends import PG_DSN
from tests.registry.conftest import Backend
from tests.registry.specs import store_publish


async def test_migrations_are_idempotent(backend: Backend) -> None:
    first = await backend.open()
    await store_publish(first, "1")
    second = await backend.open()
    assert await second.get("tokenizer", "tok", "1") == await first.get("tokenizer", "tok", "1")
    rows = await backend.raw("SELECT version FROM {schema}.registry_schema_migrations ORDER BY version")
    assert [row[0] for row in rows] == [m.version for m in MIGRATIONS] == [1, 2, 3]
    assert await second.generation() == 1


async def test_the_first_server_secret_stored_is_the_one_every_replica_reads(backend: Backend) -> None:
    first, second = await backend.open(), await backend.open()
    # Two replicas starting together, each with a random candidate: both end up with the same one.
    found = await asyncio.gather(first.server_secret("a" * 64), second.server_secret("b" * 64))
    assert found[0] == found[1] in ("a" * 64, "b" * 64)
    # Never replaced later, and no registry change: a replica's view is not reloaded for it.
    assert await (await backend.open()).server_secret("c" * 64) == found[0]
    assert await first.generation() == 0


async def test_shares_a_sqlite_file_with_the_tenant_store(tmp_path: Path) -> None:
    path = tmp_path / "lockgate.db"
    tenants = await SqliteTenantStore.open(path)
    store = await SqliteRegistryStore.open(path)
    try:
        await tenants.create_tenant(Tenant(tenant_id="acme", display_name="Acme"), actor="t", now=1.0)
        await store_publish(store, "1")
        assert (await tenants.get_tenant("acme")).display_name == "Acme"
        assert await store.generation() == 1
    finally:
        await store.close()
        await tenants.close()


async def test_sqlite_never_blocks_the_event_loop_and_refuses_after_close(tmp_path: Path) -> None:
    store = await SqliteRegistryStore.open(tmp_path / "busy.db")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        for i in range(100):
            await store_publish(store, str(i))
    finally:
        task.cancel()
        await store.close()
    assert ticks >= 100
    with pytest.raises(RegistryError, match="closed"):
        await store.generation()
    await store.close()


async def test_sqlite_in_memory() -> None:
    store = await SqliteRegistryStore.open(":memory:")
    try:
        await store_publish(store, "1")
        assert (await store.snapshot()).generation == 1
    finally:
        await store.close()


async def test_postgres_refuses_unsafe_schema_names() -> None:
    with pytest.raises(ValueError, match="schema"):
        await PostgresRegistryStore.open(PG_DSN, schema='x"; DROP TABLE registry_versions; --')


async def test_postgres_unreachable_is_unavailable() -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # min_size=0: the pool connects on first use, as after a database restart.
    pool = await asyncpg.create_pool(f"postgresql://postgres@127.0.0.1:{port}/test", min_size=0)
    store = PostgresRegistryStore(pool)
    try:
        with pytest.raises(UnavailableError, match="unreachable"):
            await store.generation()
        with pytest.raises(UnavailableError):
            await store.snapshot()
    finally:
        await store.close()


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_postgres_store_survives_a_dropped_connection(backend: Backend) -> None:
    store = await backend.open()
    assert isinstance(store, PostgresRegistryStore)
    await store_publish(store, "1")
    # Kill this store's own connection (min_size=1: its only one) the way a database restart would.
    async with store._pool.acquire() as conn:
        pid = conn.get_server_pid()
    await backend.raw(f"SELECT pg_terminate_backend({pid}, 5000)")  # returns once it is gone
    # The pool replaces the dead connection: at most the call that finds it dead fails, as unavailable.
    try:
        generation = await store.generation()
    except UnavailableError:
        generation = await store.generation()
    assert generation == 1
