"""The two deployments every end-to-end policy test runs on: memory + SQLite (embedded) and Redis +
PostgreSQL (multi-replica), with an injected clock. Both services are required: unreachable means failure."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import asyncpg  # type: ignore[import-untyped]
import pytest
import redis.asyncio

from policy.quota.base import BucketSpec, QuotaStore, Reservation
from policy.quota.memory import MemoryQuotaStore
from policy.quota.redis import RedisQuotaStore
from policy.tenants.base import TenantStore
from policy.tenants.postgres import PostgresTenantStore
from policy.tenants.sqlite import SqliteTenantStore
from registry.base import RegistryStore
from registry.store.postgres import PostgresRegistryStore
from registry.store.sqlite import SqliteRegistryStore

PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
DEPLOYMENTS = ["memory+sqlite", "redis+postgres"]


class FakeClock:
    """Time that moves only when a test says so."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        self.now += seconds


class WrappedQuotaStore:
    """A QuotaStore that passes every call to `inner`: tests subclass it to count or fail some calls."""

    def __init__(self, inner: QuotaStore) -> None:
        self.inner = inner

    async def reserve(
        self,
        buckets: Sequence[BucketSpec],
        amounts: Sequence[float],
        now: float,
        reservation_id: str | None = None,
    ) -> Reservation:
        return await self.inner.reserve(buckets, amounts, now, reservation_id)

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        return await self.inner.reconcile(reservation, actual, now)

    async def levels(self, buckets: Sequence[BucketSpec], now: float) -> tuple[float, ...]:
        return await self.inner.levels(buckets, now)

    async def close(self) -> None:
        await self.inner.close()


class Backends:
    """The tenant, quota and registry stores of one deployment."""

    def __init__(
        self, name: str, tenants: TenantStore, quota: QuotaStore, registry: RegistryStore, schema: str = ""
    ) -> None:
        self.name = name
        self.tenants = tenants
        self.quota = quota
        self.registry = registry
        # The PostgreSQL schema of the redis+postgres deployment (another replica opens its own stores on it).
        self.schema = schema


@asynccontextmanager
async def redis_quota(
    prefix: str, op_timeout: float = 5.0, url: str = REDIS_URL
) -> AsyncIterator[RedisQuotaStore]:
    """A Redis quota store under `prefix`, on the caller's (injected) clock; its keys are dropped after."""
    client = redis.asyncio.Redis.from_url(url)
    store = RedisQuotaStore(client, prefix=prefix, op_timeout=op_timeout, server_time=False)
    try:
        yield store
    finally:
        async for key in client.scan_iter(match=f"{prefix}*"):
            await client.delete(key)
        await store.close()


@asynccontextmanager
async def postgres_schema() -> AsyncIterator[tuple[str, Any]]:
    """A fresh PostgreSQL schema name and an admin connection; the schema is dropped afterwards."""
    schema = f"test_{secrets.token_hex(6)}"
    try:
        admin = await asyncpg.connect(PG_DSN, timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        pytest.fail(f"PostgreSQL is required and unreachable at {PG_DSN}: {exc!r}")
    try:
        yield schema, admin
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await admin.close()


class Closable(Protocol):
    """A store."""

    async def close(self) -> None: ...


StoreT = TypeVar("StoreT", bound=Closable)


@dataclass
class SqlBackend(Generic[StoreT]):
    """One database location: open stores on it (closed after the test) and run raw SQL on it.

    Raw SQL names tables as `{schema}.table`: the test's schema on PostgreSQL, nothing on SQLite.
    """

    name: str
    open: Callable[[], Awaitable[StoreT]]
    raw: Callable[[str], Awaitable[list[tuple[Any, ...]]]]
    location: str  # the SQLite path or the PostgreSQL schema


@asynccontextmanager
async def sql_backend(
    name: str,
    tmp_path: Path,
    sqlite: Callable[[Path], Awaitable[StoreT]],
    postgres: Callable[[str], Awaitable[StoreT]],
) -> AsyncIterator[SqlBackend[StoreT]]:
    """A SQLite file in tmp_path ("sqlite") or a fresh PostgreSQL schema ("postgres"); stores opened through
    it are closed afterwards. No PostgreSQL is a failure, never a skip."""
    opened: list[StoreT] = []
    async with AsyncExitStack() as stack:

        async def close_all() -> None:
            for store in opened:
                await store.close()

        if name == "sqlite":
            path = tmp_path / "store.sqlite3"
            stack.push_async_callback(close_all)

            async def open_sqlite() -> StoreT:
                opened.append(await sqlite(path))
                return opened[-1]

            def query(sql: str) -> list[tuple[Any, ...]]:
                with closing(sqlite3.connect(path, isolation_level=None)) as conn:
                    return conn.execute(sql.replace("{schema}.", "")).fetchall()

            yield SqlBackend(name, open_sqlite, lambda sql: asyncio.to_thread(query, sql), str(path))
            return
        schema, admin = await stack.enter_async_context(postgres_schema())
        # Registered after the schema: runs before the schema is dropped.
        stack.push_async_callback(close_all)

        async def open_postgres() -> StoreT:
            opened.append(await postgres(schema))
            return opened[-1]

        async def raw(sql: str) -> list[tuple[Any, ...]]:
            return [tuple(row) for row in await admin.fetch(sql.replace("{schema}", schema))]

        yield SqlBackend(name, open_postgres, raw, schema)


@asynccontextmanager
async def deployment(name: str, tmp_path: Path) -> AsyncIterator[Backends]:
    """The stores of deployment `name` (one of DEPLOYMENTS); tenants and registry share one database."""
    async with AsyncExitStack() as stack:
        if name == "memory+sqlite":
            path = tmp_path / "lockgate.sqlite3"
            tenants: TenantStore = await SqliteTenantStore.open(path)
            stack.push_async_callback(tenants.close)
            registry: RegistryStore = await SqliteRegistryStore.open(path)
            stack.push_async_callback(registry.close)
            yield Backends(name, tenants, MemoryQuotaStore(), registry)
            return
        schema, _admin = await stack.enter_async_context(postgres_schema())
        tenants = await PostgresTenantStore.open(PG_DSN, schema=schema)
        stack.push_async_callback(tenants.close)
        registry = await PostgresRegistryStore.open(PG_DSN, schema=schema)
        stack.push_async_callback(registry.close)
        quota = await stack.enter_async_context(redis_quota(f"lockgate:test:{secrets.token_hex(6)}:"))
        yield Backends(name, tenants, quota, registry, schema)
