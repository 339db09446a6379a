"""The Redis quota store on a real Redis Cluster: three private primaries started by the test. Every key of
one tenant's request carries the hash tag `{tenant}`, so each script stays in one slot; tenants spread over
the nodes."""

from __future__ import annotations

import time
from pathlib import Path

import redis.asyncio

from gateway.app import open_quota_store
from gateway.config import Config, QuotaConfig
from policy.quota.meter import QuotaMeter, applicable
from policy.quota.redis import RedisQuotaStore
from policy.tenants.models import ApiKey, Limits, Quotas, Tenant
from tests.backends import FakeClock
from tests.redis_servers import redis_cluster

LIMITS = Limits(requests_per_second=10, request_burst=100, tokens_per_second=10, token_burst=10_000)
TENANTS = [f"tenant-{i}" for i in range(8)]


async def test_reserve_and_settle_for_many_tenants_on_a_three_node_cluster(tmp_path: Path) -> None:
    async with redis_cluster(tmp_path) as nodes:
        store = RedisQuotaStore.from_url(
            nodes[0].url, cluster=True, pool_size=4, op_timeout=5.0, server_time=False
        )
        clock = FakeClock()
        meter = QuotaMeter(store, clock)
        try:
            for i, tenant_id in enumerate(TENANTS):
                tenant = Tenant(
                    tenant_id=tenant_id,
                    display_name=tenant_id,
                    quotas=Quotas(tenant=LIMITS, per_key=LIMITS),
                )
                key = ApiKey(key_id=f"k{i}", tenant_id=tenant_id, roles=("consumer",), created_at=0.0)
                charges = [await meter.reserve(tenant, key, 100) for _ in range(3)]
                for charge in charges:
                    await meter.settle(charge, 40 + i)
                levels = await store.levels([b for _, b, _ in applicable(tenant, key)], clock())
                # Tenant and key buckets: 3 requests each, and exactly the tokens used.
                assert levels == (97.0, 10_000 - 3 * (40 + i), 97.0, 10_000 - 3 * (40 + i))
            assert meter.counters["reserved"] == meter.counters["settled"] == 3 * len(TENANTS)
            # The tenants' slots fall on more than one primary: the scripts really ran cluster-wide.
            holding = 0
            for node in nodes:
                client = redis.asyncio.Redis(host="127.0.0.1", port=node.port)
                holding += bool(await client.dbsize())
                await client.aclose()
            assert holding >= 2
        finally:
            await store.close()


async def test_the_configured_store_runs_on_a_cluster(tmp_path: Path) -> None:
    async with redis_cluster(tmp_path) as nodes:
        config = Config(
            quota=QuotaConfig(backend="redis", redis_url=nodes[1].url, redis_cluster=True, op_timeout=5.0)
        )
        store = await open_quota_store(config, time.time)
        meter = QuotaMeter(store, FakeClock())
        try:
            for tenant_id in TENANTS:
                tenant = Tenant(tenant_id=tenant_id, display_name=tenant_id, quotas=Quotas(per_key=LIMITS))
                key = ApiKey(key_id="k", tenant_id=tenant_id, roles=("consumer",), created_at=0.0)
                await meter.settle(await meter.reserve(tenant, key, 100), 10)
        finally:
            await store.close()
        assert meter.counters["reserved"] == meter.counters["settled"] == len(TENANTS)
