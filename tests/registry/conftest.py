"""Registry test fixtures: a store on each backend (SQLite file, fresh PostgreSQL schema) and a clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from registry import PostgresRegistryStore, Registry, RegistryStore, SqliteRegistryStore
from tests.backends import PG_DSN, FakeClock, SqlBackend, sql_backend

Backend = SqlBackend[RegistryStore]


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """A SQLite file in tmp_path, or a fresh PostgreSQL schema dropped afterwards. No PostgreSQL = failure."""

    async def postgres(schema: str) -> RegistryStore:
        return await PostgresRegistryStore.open(PG_DSN, schema=schema)

    async with sql_backend(request.param, tmp_path, SqliteRegistryStore.open, postgres) as opened:
        yield opened


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
