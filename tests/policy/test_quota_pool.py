"""The Redis quota store under load and skew: a small pool at saturation meters every request exactly, a pool
that stays busy is its own condition (never "unreachable"), bucket time is the Redis server's, and the pool's
connection is opened at start.
Needs Redis on 127.0.0.1:6379 (fails, never skips, without it)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from policy.quota import BucketSpec, QuotaBackendError, QuotaBusyError, QuotaExceededError, RedisQuotaStore
from policy.quota.meter import QuotaMeter, applicable
from policy.tenants.models import ApiKey, Limits, Quotas, Tenant
from tests.backends import REDIS_URL, FakeClock

REQUESTS = 500
LIMITS = Limits(
    requests_per_second=1, request_burst=REQUESTS, tokens_per_second=1, token_burst=100 * REQUESTS
)
KEY = ApiKey(key_id="k1", tenant_id="acme", roles=("consumer",), created_at=0.0)


async def drop(prefix: str) -> None:
    """Delete every key under `prefix`."""
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A fresh key prefix, cleaned up afterwards."""
    name = f"lockgate:test:{uuid.uuid4().hex}:"
    yield name
    await drop(name)


async def test_a_small_pool_at_saturation_meters_every_request_exactly(prefix: str) -> None:
    # Two connections for 500 concurrent requests: all of them wait their turn; none is refused, none is
    # taken for an unreachable Redis, and every reservation settles.
    store = RedisQuotaStore.from_url(
        REDIS_URL, pool_size=2, pool_timeout=120.0, op_timeout=30.0, prefix=prefix, server_time=False
    )
    clock = FakeClock()  # Time stands still: no refill, so the final levels are exact sums.
    meter = QuotaMeter(store, clock)
    tenant = Tenant(tenant_id="acme", display_name="Acme", quotas=Quotas(tenant=LIMITS, fail_mode="open"))

    async def request(i: int) -> int:
        charge = await meter.reserve(tenant, KEY, 100)
        assert charge.reservation is not None
        used = i % 100
        meter.settle_later(charge, used)
        return used

    try:
        used = await asyncio.gather(*(request(i) for i in range(REQUESTS)))
        await meter.drain(120.0)
        buckets = [b for _, b, _ in applicable(tenant, KEY)]
        assert await store.levels(buckets, clock()) == (0.0, 100.0 * REQUESTS - sum(used))
    finally:
        await store.close()
    counters = meter.counters
    assert counters["reserved"] == counters["settled"] == REQUESTS
    assert counters["fail_open"] == counters["pool_exhausted"] == counters["settle_retried"] == 0


async def test_a_pool_that_stays_busy_is_busy_not_unreachable() -> None:
    connected = asyncio.Event()

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        await reader.read()  # Accept and never answer: the one connection stays busy.
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisQuotaStore.from_url(
        f"redis://127.0.0.1:{port}/0", pool_size=1, pool_timeout=0.05, op_timeout=60.0
    )
    spec = BucketSpec(key="{acme}:t", capacity=10.0, rate=1.0)
    holder = asyncio.create_task(store.reserve([spec], [1.0], 0.0))
    try:
        async with asyncio.timeout(30):
            await connected.wait()
        # The only slot is taken (by a healthy-looking, merely slow operation): wait, bounded, then busy.
        with pytest.raises(QuotaBusyError):
            await store.reserve([spec], [1.0], 0.0)
        assert not issubclass(QuotaBusyError, QuotaBackendError)
    finally:
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        await store.close()
        server.close()
        await server.wait_closed()


async def test_a_replica_with_a_fast_clock_gets_no_extra_refill(prefix: str) -> None:
    spec = BucketSpec(key="{acme}:tok", capacity=100.0, rate=1.0)
    honest = RedisQuotaStore.from_url(REDIS_URL, prefix=prefix, op_timeout=30.0)
    skewed = RedisQuotaStore.from_url(REDIS_URL, prefix=prefix, op_timeout=30.0)
    try:
        await honest.reserve([spec], [100.0], time.time())
        # An hour ahead would refill the bucket 36 times over on the replica's own clock; on the server's
        # clock it refilled only for the real time elapsed between two calls (far from the 100 s to full).
        with pytest.raises(QuotaExceededError):
            await skewed.reserve([spec], [100.0], time.time() + 3600.0)
        [level] = await skewed.levels([spec], time.time() + 3600.0)
        assert level < 100.0
    finally:
        await honest.close()
        await skewed.close()


async def test_with_client_time_the_same_skew_would_mint_tokens(prefix: str) -> None:
    # The counterpart that shows what server time prevents (client time is for deterministic tests only).
    spec = BucketSpec(key="{acme}:tok", capacity=100.0, rate=1.0)
    store = RedisQuotaStore.from_url(REDIS_URL, prefix=prefix, op_timeout=30.0, server_time=False)
    try:
        now = time.time()
        await store.reserve([spec], [100.0], now)
        assert (await store.reserve([spec], [100.0], now + 3600.0)).levels == (0.0,)
    finally:
        await store.close()


async def test_warming_opens_the_connection_so_a_burst_opens_none(prefix: str) -> None:
    pool = redis.asyncio.BlockingConnectionPool.from_url(REDIS_URL, max_connections=5)
    store = RedisQuotaStore(redis.asyncio.Redis.from_pool(pool), pool_size=5, prefix=prefix)
    try:
        assert await store.warm() == 1
        opened = []
        make = pool.make_connection

        def counted() -> object:
            opened.append(1)
            return make()  # type: ignore[no-untyped-call]

        pool.make_connection = counted  # type: ignore[method-assign]
        spec = [BucketSpec(key="burst", capacity=100.0, rate=1.0)]
        await asyncio.gather(*(store.reserve(spec, [1.0], time.time()) for _ in range(5)))
        assert opened == []  # five at once, on the one connection opened at start
    finally:
        await store.close()


async def test_warming_a_store_whose_redis_is_down_gives_up_without_raising() -> None:
    store = RedisQuotaStore.from_url("redis://127.0.0.1:1", pool_size=5, op_timeout=0.5)
    try:
        assert await store.warm() == 0
    finally:
        await store.close()
