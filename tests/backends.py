"""The two deployments every end-to-end policy test runs on: memory + SQLite (embedded) and Redis +
PostgreSQL (multi-replica), with an injected clock. Both services are required: unreachable means failure."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest
import redis.asyncio

from policy.quota.base import QuotaStore
from policy.quota.memory import MemoryQuotaStore
from policy.quota.redis import RedisQuotaStore
from policy.tenants.base import TenantStore
from policy.tenants.postgres import PostgresTenantStore
from policy.tenants.sqlite import SqliteTenantStore
from registry.base import RegistryStore
from registry.postgres import PostgresRegistryStore
from registry.sqlite import SqliteRegistryStore

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
    """A Redis quota store under `prefix`; its keys are deleted afterwards."""
    client = redis.asyncio.Redis.from_url(url)
    store = RedisQuotaStore(client, prefix=prefix, op_timeout=op_timeout)
    try:
        yield store
    finally:
        async for key in client.scan_iter(match=f"{prefix}*"):
            await client.delete(key)
        await store.close()


@asynccontextmanager
async def postgres_schema() -> AsyncIterator[str]:
    """A fresh PostgreSQL schema name, dropped (with everything in it) afterwards."""
    schema = f"test_{secrets.token_hex(6)}"
    try:
        admin = await asyncpg.connect(PG_DSN, timeout=10)
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.fail(f"PostgreSQL is required and unreachable at {PG_DSN}: {exc!r}")
    try:
        yield schema
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await admin.close()


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
        schema = await stack.enter_async_context(postgres_schema())
        tenants = await PostgresTenantStore.open(PG_DSN, schema=schema)
        stack.push_async_callback(tenants.close)
        registry = await PostgresRegistryStore.open(PG_DSN, schema=schema)
        stack.push_async_callback(registry.close)
        quota = await stack.enter_async_context(redis_quota(f"lockgate:test:{secrets.token_hex(6)}:"))
        yield Backends(name, tenants, quota, registry, schema)
