"""Fleet-wide fairness (`routing.fairness`): the shared counters' contract on memory, Redis and a Redis
Cluster (each tenant's hash on the node of its slot), and two fair queues (two gateway processes) that share
them: a tenant served at one gateway waits behind the others at the other."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import redis.asyncio

from gateway.fleet import shared_counters
from routing.fair_queue import FairQueue
from routing.fairness.base import CounterUpdate, SharedCounters
from routing.fairness.memory import MemoryCounters
from routing.fairness.redis import RedisCounters, counters_key
from tests.backends import REDIS_URL
from tests.redis_servers import redis_cluster
from tests.routing.test_capacity import fleet_config
from tests.routing.test_fair_queue import config, ticket


@pytest.fixture(params=["memory", "redis", "redis_cluster"])
async def counters(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SharedCounters]:
    if request.param == "memory":
        yield MemoryCounters()
        return
    if request.param == "redis":
        store = RedisCounters(redis.asyncio.Redis.from_url(REDIS_URL), op_timeout=2.0)
        try:
            yield store
        finally:
            await store.close()
        return
    async with redis_cluster(tmp_path) as nodes:
        # As a gateway builds them: the quota store's cluster, one call per tenant routed by its key.
        config = fleet_config(quota="redis", remote=True, cluster=True, url=nodes[0].url)
        config = msgspec.structs.replace(
            config, quota=msgspec.structs.replace(config.quota, redis_url=nodes[0].url, op_timeout=5.0)
        )
        clustered = shared_counters(config)
        assert isinstance(clustered, RedisCounters)
        try:
            yield clustered
        finally:
            await clustered.close()


def fresh() -> str:
    return f"q-{uuid.uuid4().hex}"


async def test_charges_add_up_across_processes_and_a_lift_is_a_floor(counters: SharedCounters) -> None:
    queue, a, b = fresh(), f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    assert await counters.sync(queue, [CounterUpdate(a, 100.0, 100.0)]) == [100.0]
    # Another process charged `a` 50 and lifted `b` (new there) to its virtual time, 80.
    assert await counters.sync(queue, [CounterUpdate(a, 50.0, 50.0), CounterUpdate(b, 0.0, 80.0)]) == [
        150.0,
        80.0,
    ]
    # A lift below the fleet's counter changes nothing; increments still add.
    assert await counters.sync(queue, [CounterUpdate(b, 10.0, 20.0)]) == [90.0]
    # Another queue (model weights) keeps counters of its own.
    assert await counters.sync(fresh(), [CounterUpdate(a, 1.0, 1.0)]) == [1.0]
    assert await counters.sync(queue, []) == []


def test_each_tenants_counters_share_its_hash_tag() -> None:
    assert counters_key("acme") == "lockgate:fair:{acme}"


async def test_a_tenant_served_at_one_gateway_waits_behind_others_at_the_other() -> None:
    shared = MemoryCounters()
    gateways = [FairQueue(config()), FairQueue(config())]
    for queue in gateways:
        queue.share_counters()
    one, two = gateways

    async def sync(queue: FairQueue) -> None:
        updates = queue.sync_updates()
        queue.apply_synced(updates, await shared.sync("weights", updates))

    # Gateway one serves `heavy` ten requests; gateway two has served nobody yet.
    for i in range(10):
        one.push(ticket("heavy", request_id=f"h{i}"), 0.0)
        popped = one.pop(0.0)
        assert popped is not None
        one.charge_output("heavy", popped.max_tokens)
        one.finish(popped.request_id)
    # At gateway two both tenants queue; `heavy` first, then `light`.
    two.push(ticket("heavy", request_id="h-two"), 0.0)
    two.push(ticket("light", request_id="l-two"), 0.0)
    await sync(one)
    await sync(two)
    # The fleet's counters put `light` first: `heavy` had its share at gateway one.
    first = two.pop(0.0)
    assert first is not None
    assert first.tenant == "light"


async def test_without_sharing_each_gateway_is_an_island() -> None:
    one, two = FairQueue(config()), FairQueue(config())
    for i in range(10):
        one.push(ticket("heavy", request_id=f"h{i}"), 0.0)
        popped = one.pop(0.0)
        assert popped is not None
        one.finish(popped.request_id)
    two.push(ticket("heavy", request_id="h-two"), 0.0)
    two.push(ticket("light", request_id="l-two"), 0.0)
    first = two.pop(0.0)
    assert first is not None
    assert first.tenant == "heavy"  # what the fleet served elsewhere is not seen


async def test_a_failed_sync_keeps_the_increments_for_the_next() -> None:
    queue = FairQueue(config())
    queue.share_counters()
    queue.push(ticket("t", request_id="r1", prompt=10), 0.0)
    updates = queue.sync_updates()
    assert [(u.tenant, u.delta) for u in updates] == [("t", 0.0)]  # active, nothing charged yet
    popped = queue.pop(0.0)
    assert popped is not None
    queue.charge_output("t", 5)
    sent = queue.sync_updates()
    queue.unsent(sent)
    again = queue.sync_updates()
    assert [(u.tenant, u.delta) for u in again] == [(u.tenant, u.delta) for u in sent]
    assert again[0].delta == pytest.approx(10 * 1.0 + 5 * 2.0)  # w_in x prompt + w_out x output
