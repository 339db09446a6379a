"""The two deployments every end-to-end policy test runs on: memory + SQLite (embedded) and Redis +
PostgreSQL (multi-replica), with an injected clock. Both services are required: unreachable means failure."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
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
    """A tenant store and a quota store of one deployment."""

    def __init__(self, name: str, tenants: TenantStore, quota: QuotaStore) -> None:
        self.name = name
        self.tenants = tenants
        self.quota = quota


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
async def postgres_tenants() -> AsyncIterator[PostgresTenantStore]:
    """A PostgreSQL tenant store in a fresh schema, dropped afterwards."""
    schema = f"test_{secrets.token_hex(6)}"
    try:
        admin = await asyncpg.connect(PG_DSN, timeout=10)
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.fail(f"PostgreSQL is required and unreachable at {PG_DSN}: {exc!r}")
    store = await PostgresTenantStore.open(PG_DSN, schema=schema)
    try:
        yield store
    finally:
        await store.close()
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await admin.close()


@asynccontextmanager
async def deployment(name: str, tmp_path: Path) -> AsyncIterator[Backends]:
    """The stores of deployment `name` (one of DEPLOYMENTS)."""
    if name == "memory+sqlite":
        tenants = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
        try:
            yield Backends(name, tenants, MemoryQuotaStore())
        finally:
            await tenants.close()
        return
    async with postgres_tenants() as pg, redis_quota(f"lockgate:test:{secrets.token_hex(6)}:") as quota:
        yield Backends(name, pg, quota)
