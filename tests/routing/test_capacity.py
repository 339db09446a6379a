"""The capacity ledger (`routing.capacity`): one contract for the memory and the Redis ledger, and gateways
sharing one engine through it: four schedulers, each its own view of one simulated engine at saturation,
never hold more in flight together than the engine's budget."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
import redis.asyncio

from engines.base import EngineRequest, SamplingSpec
from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.vllm_remote import RemoteEngineConfig
from gateway.config import Config, ConfigError, ReplicaSpec, load_config
from gateway.fleet import capacity_ledger
from routing.admission_types import AdmissionConfig
from routing.capacity.base import NOTHING, Capacity, CapacityLedger
from routing.capacity.memory import MemoryLedger
from routing.capacity.redis import RedisLedger, ledger_key
from routing.config import RouterConfig
from routing.router import Router
from routing.scheduler import Scheduler
from tests.backends import REDIS_URL
from tests.conftest import make_config
from tests.routing.test_replicas import CONFIG, FakeClock, make_replica
from tests.routing.test_scheduler import route, ticket

BUDGET = Capacity(1000, 16)
TTL = 3.0


@pytest.fixture(params=["memory", "redis"])
async def ledger(request: pytest.FixtureRequest) -> AsyncIterator[CapacityLedger]:
    if request.param == "memory":
        yield MemoryLedger()
        return
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    store = RedisLedger(client, op_timeout=2.0)
    try:
        yield store
    finally:
        await store.close()


def replica_name() -> str:
    return f"test-{uuid.uuid4().hex}"


async def renew(
    ledger: CapacityLedger,
    replica: str,
    holder: str,
    want: Capacity,
    used: Capacity = NOTHING,
    now: float = 0.0,
) -> Capacity:
    return await ledger.renew(replica, holder, want=want, used=used, budget=BUDGET, now=now, ttl=TTL)


async def test_a_lone_holder_gets_what_it_wants_within_the_budget(ledger: CapacityLedger) -> None:
    name = replica_name()
    assert await renew(ledger, name, "a", Capacity(300, 4)) == Capacity(300, 4)
    assert await renew(ledger, name, "a", Capacity(5000, 40)) == BUDGET


async def test_holders_that_want_more_than_the_budget_share_it_by_their_wants(ledger: CapacityLedger) -> None:
    name = replica_name()
    assert await renew(ledger, name, "a", Capacity(1000, 16)) == BUDGET
    # "a" holds everything: "b" gets nothing yet, but its want is on record.
    assert await renew(ledger, name, "b", Capacity(1000, 16)) == Capacity(0, 0)
    # "a" renews: its share is half now, and never less than what it has in flight.
    assert await renew(ledger, name, "a", Capacity(1000, 16), used=Capacity(700, 3)) == Capacity(700, 8)
    assert await renew(ledger, name, "b", Capacity(1000, 16)) == Capacity(300, 8)
    assert await renew(ledger, name, "a", Capacity(1000, 16), used=Capacity(200, 2)) == Capacity(500, 8)
    assert await renew(ledger, name, "b", Capacity(1000, 16)) == Capacity(500, 8)


async def test_a_lapsed_or_released_lease_frees_its_share(ledger: CapacityLedger) -> None:
    name = replica_name()
    await renew(ledger, name, "dead", BUDGET, now=0.0)
    assert await renew(ledger, name, "b", BUDGET, now=TTL - 0.1) == Capacity(0, 0)
    assert await renew(ledger, name, "b", BUDGET, now=TTL + 0.1) == BUDGET  # "dead" lapsed
    await ledger.release(name, "b")
    assert await renew(ledger, name, "c", BUDGET, now=TTL + 0.2) == BUDGET


async def test_random_renewals_never_lease_more_than_the_budget(ledger: CapacityLedger) -> None:
    name = replica_name()
    rng = random.Random(7)
    leases: dict[str, Capacity] = {}
    for step in range(300):
        holder = f"g{rng.randrange(4)}"
        held = leases.get(holder, Capacity(0, 0))
        # A holder never has more in flight than its last lease.
        used = Capacity(rng.randint(0, held.tokens), rng.randint(0, held.sequences))
        want = Capacity(rng.randint(0, 1500), rng.randint(0, 24))
        leases[holder] = await renew(ledger, name, holder, want, used, now=step * 0.01)
        assert leases[holder].tokens >= used.tokens
        assert sum(c.tokens for c in leases.values()) <= BUDGET.tokens
        assert sum(c.sequences for c in leases.values()) <= BUDGET.sequences


async def test_the_redis_ledger_keeps_each_replica_under_its_own_hash_tag() -> None:
    assert (
        ledger_key("remote:http://vllm-0.vllm:8000") == "lockgate:capacity:{remote:http://vllm-0.vllm:8000}"
    )


async def test_four_gateways_on_one_engine_never_hold_more_than_its_budget(ledger: CapacityLedger) -> None:
    """Each scheduler is one gateway process: its own replica view of the one engine, its own lease. At
    saturation (80 requests against KV for about 8), what they hold in flight together stays within the
    engine's budget at every step, and every request is served."""
    config = SimulatorConfig(
        decode_step_s=0.0, decode_step_s_per_seq=0.0, prefill_s_per_token=0.0, kv_capacity_tokens=1000
    )
    engine = SimulatedEngine(config, replica_id=replica_name())
    await engine.start()
    clock = FakeClock()
    gateways = []
    for g in range(4):
        replica = make_replica(engine, clock, config=msgspec.structs.replace(CONFIG, growth_reserve_cap=64))  # type: ignore[arg-type]
        replica.shared_by = 4
        scheduler = Scheduler(
            [replica],
            Router(RouterConfig()),
            AdmissionConfig(initial_service_rate=1e9),
            clock,
            ledger=ledger,
            holder=f"gateway-{g}",
        )
        await scheduler.refresh()
        gateways.append(scheduler)
    budget = gateways[0].replicas[0].budget
    assert budget.tokens == 1000
    most = 0

    async def serve(scheduler: Scheduler, rid: str) -> int:
        nonlocal most
        lease = await scheduler.admit(ticket(rid, clock, max_tokens=64), route(rid, prompt=60, max_tokens=64))
        try:
            held = sum(g.replicas[0].held_tokens for g in gateways)
            most = max(most, held)
            assert held <= budget.tokens
            request = EngineRequest(
                request_id=rid,
                prompt_token_ids=lease.route.prompt_token_ids,
                sampling=SamplingSpec(max_tokens=64),
            )
            tokens = 0
            async for delta in engine.generate(request):
                tokens += len(delta.token_ids)
                lease.observe(len(delta.token_ids))
            return tokens
        finally:
            lease.release()

    async def renewing() -> None:
        while True:  # each gateway's refresh loop, in virtual turns
            for scheduler in gateways:
                await scheduler.refresh()
            await asyncio.sleep(0)

    loop = asyncio.create_task(renewing())
    try:
        counts = await asyncio.gather(*(serve(gateways[i % 4], f"r{i}") for i in range(80)))
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert counts == [64] * 80
    # Saturated: most of the budget was used, never more (each request holds 60 + 64; split in four leases,
    # each fits whole requests only).
    assert budget.tokens * 0.6 < most <= budget.tokens
    for scheduler in gateways:
        await scheduler.release_leases()
    await engine.shutdown()


def fleet_config(
    *, quota: str, remote: bool, cluster: bool = False, mode: str = "auto", url: str = ""
) -> Config:
    """The test config with one engine (remote or simulated), the quota store and capacity ledger given."""
    engines = [
        ReplicaSpec(
            kind="vllm_remote" if remote else "simulated",
            remote=RemoteEngineConfig(url="http://vllm:8000", served_model="m", max_model_len=2048)
            if remote
            else None,
        )
    ]
    config = make_config()
    replicas = msgspec.structs.replace(config.routing.replicas, capacity_ledger=mode, capacity_ledger_url=url)
    return msgspec.structs.replace(
        config,
        engines=engines,
        quota=msgspec.structs.replace(config.quota, backend=quota, redis_cluster=cluster),
        routing=msgspec.structs.replace(config.routing, replicas=replicas),
    )


async def test_the_ledger_is_redis_where_gateways_may_share_an_engine() -> None:
    shared = capacity_ledger(fleet_config(quota="redis", remote=True))
    assert isinstance(shared, RedisLedger)
    await shared.close()
    # Each process its own engine, or quotas in one process: nobody to share with.
    assert capacity_ledger(fleet_config(quota="redis", remote=False)) is None
    assert capacity_ledger(fleet_config(quota="memory", remote=True)) is None
    assert capacity_ledger(fleet_config(quota="redis", remote=True, mode="none")) is None
    # A Redis Cluster needs a server of the ledger's own.
    assert capacity_ledger(fleet_config(quota="redis", remote=True, cluster=True)) is None
    cluster_ledger = {
        "LOCKGATE_QUOTA__BACKEND": "redis",
        "LOCKGATE_QUOTA__REDIS_CLUSTER": "true",
        "LOCKGATE_ROUTING__REPLICAS__CAPACITY_LEDGER": "redis",
    }
    with pytest.raises(ConfigError, match="capacity_ledger_url"):
        load_config(env=cluster_ledger)
    load_config(env={**cluster_ledger, "LOCKGATE_ROUTING__REPLICAS__CAPACITY_LEDGER_URL": REDIS_URL})
    named = capacity_ledger(fleet_config(quota="redis", remote=True, cluster=True, url=REDIS_URL))
    assert isinstance(named, RedisLedger)
    await named.close()
