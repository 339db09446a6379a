"""The migration lock of `open_pool` on real PostgreSQL: one per store and schema, waited for under its own
bound (`lock_timeout`), not a statement's (`command_timeout`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from registry.db.migrations import Migration
from registry.db.postgres import migration_lock, open_pool
from tests.backends import PG_DSN, postgres_schema
from tests.conftest import eventually

STORE = 0x4C6B6774_6C6F636B
MIGRATIONS = (Migration(version=1, summary="items", shared=("CREATE TABLE items (id INTEGER PRIMARY KEY)",)),)
COMMAND_TIMEOUT = 0.2


@pytest.fixture
async def schemas() -> AsyncIterator[tuple[str, str, Any]]:
    """Two fresh schemas and an admin connection (the "other replica" that holds a lock)."""
    async with postgres_schema() as (first, admin), postgres_schema() as (second, _):
        yield first, second, admin


async def opened(schema: str, lock_timeout: float = 60.0) -> Any:
    return await open_pool(
        PG_DSN,
        schema=schema,
        migrations=MIGRATIONS,
        table="schema_migrations",
        lock_key=STORE,
        min_size=1,
        max_size=1,
        command_timeout=COMMAND_TIMEOUT,
        lock_timeout=lock_timeout,
    )


async def tables(admin: Any, schema: str) -> list[str]:
    rows = await admin.fetch("SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY 1", schema)
    return [row[0] for row in rows]


async def waiting_for(admin: Any, lock: int) -> bool:
    """Whether a session waits for the advisory lock `lock` (a bigint key: its halves in classid/objid)."""
    unsigned = lock & 0xFFFFFFFFFFFFFFFF
    rows = await admin.fetch(
        "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND classid::bigint = $1 "
        "AND objid::bigint = $2",
        unsigned >> 32,
        unsigned & 0xFFFFFFFF,
    )
    return bool(rows)


def test_each_store_and_schema_has_a_lock_of_its_own() -> None:
    assert migration_lock(STORE, "a") == migration_lock(STORE, "a")
    assert len({migration_lock(STORE, "a"), migration_lock(STORE, "b"), migration_lock(STORE + 1, "a")}) == 3
    assert all(-(2**63) <= migration_lock(STORE, s) < 2**63 for s in ("a", "b", "lockgate"))


async def test_a_store_in_another_schema_does_not_wait_for_a_migration(
    schemas: tuple[str, str, Any],
) -> None:
    first, second, admin = schemas
    await admin.execute("SELECT pg_advisory_lock($1)", migration_lock(STORE, first))  # migrating `first`
    pool = await opened(second, lock_timeout=COMMAND_TIMEOUT)
    await pool.close()
    assert await tables(admin, second) == ["items", "schema_migrations"]


async def test_a_replica_waits_out_another_replicas_migration_past_a_statements_time_limit(
    schemas: tuple[str, str, Any],
) -> None:
    schema, _, admin = schemas
    lock = migration_lock(STORE, schema)
    await admin.execute("SELECT pg_advisory_lock($1)", lock)
    opening = asyncio.ensure_future(opened(schema))
    await eventually(lambda: waiting_for(admin, lock))
    # Longer than a statement may take: the wait for the lock is bounded by `lock_timeout` instead.
    await asyncio.sleep(COMMAND_TIMEOUT * 3)
    assert not opening.done()
    await admin.execute("SELECT pg_advisory_unlock($1)", lock)
    pool = await opening
    await pool.close()
    assert await tables(admin, schema) == ["items", "schema_migrations"]


async def test_a_wait_past_the_lock_timeout_fails_to_open(schemas: tuple[str, str, Any]) -> None:
    schema, _, admin = schemas
    await admin.execute("SELECT pg_advisory_lock($1)", migration_lock(STORE, schema))
    with pytest.raises(TimeoutError):
        await opened(schema, lock_timeout=COMMAND_TIMEOUT)
    assert await tables(admin, schema) == []
    # The failed opening left no session behind waiting for the lock.
    assert not await waiting_for(admin, migration_lock(STORE, schema))
