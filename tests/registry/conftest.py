"""Registry test fixtures: a store on each backend (SQLite file, fresh PostgreSQL schema) and a clock."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from registry import PostgresRegistryStore, Registry, RegistryStore, SqliteRegistryStore
from tests.backends import PG_DSN, FakeClock


@dataclass
class Backend:
    """One database location: open stores on it (closed after the test) and run raw SQL on it.

    Raw SQL names tables as `{schema}.table`: the test's schema on PostgreSQL, nothing on SQLite.
    """

    name: str
    open: Callable[[], Awaitable[RegistryStore]]
    raw: Callable[[str], Awaitable[list[tuple[Any, ...]]]]
    location: str  # the SQLite path or the PostgreSQL schema


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """A SQLite file in tmp_path, or a fresh PostgreSQL schema dropped afterwards. No PostgreSQL = failure."""
    opened: list[RegistryStore] = []
    if request.param == "sqlite":
        path = tmp_path / "registry.db"

        async def open_sqlite() -> RegistryStore:
            opened.append(await SqliteRegistryStore.open(path))
            return opened[-1]

        def query(sql: str) -> list[tuple[Any, ...]]:
            with closing(sqlite3.connect(path, isolation_level=None)) as conn:
                return conn.execute(sql.replace("{schema}.", "")).fetchall()

        yield Backend("sqlite", open_sqlite, lambda sql: asyncio.to_thread(query, sql), str(path))
    else:
        schema = f"test_registry_{secrets.token_hex(6)}"
        try:
            admin = await asyncpg.connect(PG_DSN, timeout=10)
        except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
            pytest.fail(f"PostgreSQL is required and unreachable at {PG_DSN}: {exc!r}")

        async def open_postgres() -> RegistryStore:
            opened.append(await PostgresRegistryStore.open(PG_DSN, schema=schema))
            return opened[-1]

        async def raw(sql: str) -> list[tuple[Any, ...]]:
            return [tuple(row) for row in await admin.fetch(sql.replace("{schema}", schema))]

        try:
            yield Backend("postgres", open_postgres, raw, schema)
        finally:
            for store in opened:
                await store.close()
            opened.clear()
            await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            await admin.close()
    for store in opened:
        await store.close()


@pytest.fixture
async def store(backend: Backend) -> RegistryStore:
    """A migrated, empty store on each backend."""
    return await backend.open()


@pytest.fixture
def clock() -> FakeClock:
    """Time that moves only when the test says so."""
    return FakeClock(start=1000.0)


@pytest.fixture
async def registry(tmp_path: Path, clock: FakeClock) -> AsyncIterator[Registry]:
    """A registry on a fresh SQLite file (service tests need one backend; the contract runs on both)."""
    store = await SqliteRegistryStore.open(tmp_path / "service.db")
    yield await Registry.load(store, clock)
    await store.close()
