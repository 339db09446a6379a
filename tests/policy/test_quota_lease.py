"""`LeasedQuotaStore` over each shared store (memory and real Redis), on an injected clock: requests granted
from leases without a round trip, settled exactly once, never more admitted than the shared buckets hold, the
unused part of every lease returned, and a store that fails or runs low handled by reserving per request.
Redis must run on 127.0.0.1:6379: without it the redis cases fail; they never skip."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import QuotaConfig
from gateway.generation.prompts import PromptRenderer
from policy.quota import (
    BucketSpec,
    LeasedQuotaStore,
    LeasePolicy,
    MemoryQuotaStore,
    QuotaBackendError,
    QuotaExceededError,
    QuotaStore,
    RedisQuotaStore,
    Reservation,
    ReservationClosedError,
)
from policy.quota.meter import QuotaMeter
from policy.tenants.models import ApiKey, Limits, Quotas, Tenant
from tests.backends import FakeClock, WrappedQuotaStore, redis_quota
from tests.conftest import MODEL, Tenancy, add_key, billed, keyless_metrics, make_config, serving

# No refill: every level below is exact arithmetic on what was granted and used.
REQ = BucketSpec(key="tenant:{t}:req", capacity=100.0, rate=0.0)
TOK = BucketSpec(key="tenant:{t}:tok", capacity=10_000.0, rate=0.0)
BUCKETS = (REQ, TOK)
ASK = (1.0, 100.0)
# A lease: 4 requests' worth (4 requests, 400 tokens), within 10% of each bucket (10 and 1,000).
POLICY = LeasePolicy(requests=4, fraction=0.1, seconds=1.0, floor=0.25)


class Shared(WrappedQuotaStore):
    """The shared store, counting the reserves that reach it and failing every call while `down`."""

    def __init__(self, inner: QuotaStore) -> None:
        super().__init__(inner)
        self.reserves = 0
        self.down = False

    async def reserve(
        self,
        buckets: Sequence[BucketSpec],
        amounts: Sequence[float],
        now: float,
        reservation_id: str | None = None,
    ) -> Reservation:
        self.reserves += 1
        if self.down:
            raise QuotaBackendError("down")
        return await super().reserve(buckets, amounts, now, reservation_id)

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        if self.down:
            raise QuotaBackendError("down")
        return await super().reconcile(reservation, actual, now)

    async def close(self) -> None:
        """Left open: the fixture closes the store under it."""


@pytest.fixture(params=["memory", "redis"])
async def shared(request: pytest.FixtureRequest) -> AsyncIterator[Shared]:
    if request.param == "memory":
        yield Shared(MemoryQuotaStore())
        return
    async with redis_quota(f"lockgate:test:{uuid.uuid4().hex}:") as store:
        yield Shared(store)


def leased(shared: Shared, clock: FakeClock, policy: LeasePolicy = POLICY) -> LeasedQuotaStore:
    return LeasedQuotaStore(shared, clock, policy)


async def test_requests_are_granted_from_leases_and_settled_exactly(shared: Shared) -> None:
    clock = FakeClock()
    store = leased(shared, clock)
    granted = [await store.reserve(BUCKETS, ASK, clock()) for _ in range(12)]
    await store.taken()
    # One reserve per lease on the shared store: the first request waits for its lease, the others draw on
    # it, and the next lease is taken in the background once the one drawn on holds under half a lease.
    assert store.counters["lease_grants"] == 12
    assert store.counters["lease_misses"] == 0
    assert shared.reserves == store.counters["lease_taken"] == 4
    # What the shared store holds is what was leased; with what the leases hold unused, the true level.
    assert await shared.levels(BUCKETS, clock()) == (84.0, 8_400.0)
    assert await store.levels(BUCKETS, clock()) == (88.0, 8_800.0)
    assert granted[-1].levels == (88.0, 8_800.0)
    # Each request used 30 tokens of the 100 it reserved; one overran to 150.
    for reservation in granted[:-1]:
        assert await store.reconcile(reservation, (1.0, 30.0), clock())
    assert await store.reconcile(granted[-1], (1.0, 150.0), clock())
    await store.close()
    assert await shared.levels(BUCKETS, clock()) == (88.0, 10_000.0 - 11 * 30 - 150)


async def test_settlement_is_once_and_ids_are_the_callers(shared: Shared) -> None:
    clock = FakeClock()
    store = leased(shared, clock)
    first = await store.reserve(BUCKETS, ASK, clock(), "r1")
    # A retried reserve of a granted id returns it, debited once.
    assert await store.reserve(BUCKETS, ASK, clock(), "r1") == first
    assert await store.levels(BUCKETS, clock()) == (99.0, 9_900.0)
    assert await store.reconcile(first, (1.0, 0.0), clock())
    assert not await store.reconcile(first, (1.0, 0.0), clock())
    with pytest.raises(ReservationClosedError):
        await store.reserve(BUCKETS, ASK, clock(), "r1")
    await store.close()
    assert await shared.levels(BUCKETS, clock()) == (99.0, 10_000.0)


async def test_spent_leases_are_settled_before_their_time(shared: Shared) -> None:
    """At a high rate (here no time passes at all) a lease runs out of requests long before `seconds`: it
    is retired then, and settled on the shared store once its requests are, not kept to its time."""
    clock = FakeClock()
    store = leased(shared, clock)
    for _ in range(40):
        granted = await store.reserve(BUCKETS, ASK, clock())
        assert await store.reconcile(granted, (1.0, 30.0), clock())
        await store.taken()
    taken = store.counters["lease_taken"]
    assert taken >= 10
    async with asyncio.timeout(60):  # the settlements run in tasks (Redis: real round trips)
        while store.counters["settled"] < taken - 2:  # noqa: ASYNC110 - polling the settler's tasks
            await asyncio.sleep(0.001)
    # Every lease but the one drawn on now (and the next, maybe taken already) is settled: the shared
    # store keeps what the requests used (30 tokens each), not the 400 tokens of each lease.
    [requests, tokens] = await shared.levels(BUCKETS, clock())
    assert tokens >= 10_000 - 40 * 30 - 2 * 400
    assert requests >= 100 - 40 - 2 * 4
    assert await store.levels(BUCKETS, clock()) == (60.0, 10_000.0 - 40 * 30)
    await store.close()


async def test_a_lease_is_returned_once_its_time_is_up_and_its_requests_settled(shared: Shared) -> None:
    clock = FakeClock()
    store = leased(shared, clock)
    running = await store.reserve(BUCKETS, ASK, clock())
    assert await shared.levels(BUCKETS, clock()) == (96.0, 9_600.0)
    clock.advance(POLICY.seconds)
    store.expire(clock())
    await asyncio.sleep(0)
    # Past its time, but a request still draws on it: nothing is returned yet, nothing more drawn on it.
    assert await shared.levels(BUCKETS, clock()) == (96.0, 9_600.0)
    assert await store.reconcile(running, (1.0, 10.0), clock())
    await store.close()
    assert await shared.levels(BUCKETS, clock()) == (99.0, 9_990.0)


async def test_leases_expire_on_a_timer_when_no_request_comes(shared: Shared) -> None:
    clock = FakeClock()
    store = leased(shared, clock, LeasePolicy(requests=4, fraction=0.1, seconds=0.01))
    settled = await store.reserve(BUCKETS, ASK, clock())
    assert await store.reconcile(settled, (1.0, 1.0), clock())
    clock.advance(0.01)

    async def returned() -> bool:
        return await shared.levels(BUCKETS, clock()) == (99.0, 9_999.0)

    for _ in range(500):
        if await returned():
            break
        await asyncio.sleep(0.01)
    assert await returned()
    await store.close()


async def test_replicas_never_admit_more_than_the_shared_buckets_hold(shared: Shared) -> None:
    clock = FakeClock()
    replicas = [leased(shared, clock), leased(shared, clock)]
    granted: list[tuple[LeasedQuotaStore, Reservation]] = []
    denied = 0
    for i in range(300):
        store = replicas[i % 2]
        try:
            granted.append((store, await store.reserve(BUCKETS, ASK, clock())))
        except QuotaExceededError:
            denied += 1
    assert denied > 0
    # Never more than the 100 requests the bucket holds; short of it by at most the leases the other
    # replica holds unused (two leases of 4 requests each at most), since below a quarter of the bucket
    # each request reserves on its own.
    assert 100 - 2 * 4 <= len(granted) <= 100
    assert sum(store.counters["lease_misses"] for store in replicas) > 0
    for store, reservation in granted:
        assert await store.reconcile(reservation, ASK, clock())
    for store in replicas:
        await store.close()
    assert await shared.levels(BUCKETS, clock()) == (100.0 - len(granted), 10_000.0 - 100 * len(granted))


async def test_concurrent_requests_wait_for_one_lease(shared: Shared) -> None:
    clock = FakeClock()
    store = leased(shared, clock)
    granted = await asyncio.gather(*(store.reserve(BUCKETS, ASK, clock()) for _ in range(6)))
    await store.taken()
    # One lease for the first four (the next one taken in the background as it ran low); the two it had no
    # room for reserve on their own.
    assert store.counters["lease_taken"] == 2
    assert store.counters["lease_grants"] == 4
    assert store.counters["lease_misses"] == 2
    for reservation in granted:
        assert await store.reconcile(reservation, (1.0, 0.0), clock())
    await store.close()
    assert await shared.levels(BUCKETS, clock()) == (94.0, 10_000.0)


async def test_an_ask_too_large_to_lease_reserves_on_its_own(shared: Shared) -> None:
    clock = FakeClock()
    store = leased(shared, clock)
    big = await store.reserve(BUCKETS, (1.0, 2_000.0), clock())
    assert store.counters["lease_taken"] == 0
    assert store.counters["lease_misses"] == 1
    assert big.levels == (99.0, 8_000.0)
    assert await store.reconcile(big, (1.0, 500.0), clock())
    assert await shared.levels(BUCKETS, clock()) == (99.0, 9_500.0)


async def test_low_buckets_are_not_leased(shared: Shared) -> None:
    clock = FakeClock()
    await shared.reserve(BUCKETS, (80.0, 0.0), clock())
    store = leased(shared, clock)
    first = await store.reserve(BUCKETS, ASK, clock())
    # The first request finds nothing known and takes a lease; the shared store's answer shows the request
    # bucket below a quarter, so once that lease is drawn the next ones reserve on their own, exactly.
    assert first.levels == (19.0, 9_900.0)
    for _ in range(3):
        await store.reserve(BUCKETS, (1.0, 10.0), clock())
    assert store.counters["lease_taken"] == 1
    assert store.counters["lease_misses"] == 0
    await store.reserve(BUCKETS, (1.0, 10.0), clock())
    assert store.counters["lease_misses"] == 1
    assert store.counters["lease_taken"] == 1


async def test_an_unreachable_store_fails_the_request_and_is_not_asked_twice(shared: Shared) -> None:
    clock = FakeClock()
    store = leased(shared, clock)
    shared.down = True
    # The requests waiting for the lease fail with it (the meter's fail mode decides), without asking again.
    outcomes = await asyncio.gather(
        *(store.reserve(BUCKETS, ASK, clock()) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(outcome, QuotaBackendError) for outcome in outcomes)
    assert (store.counters["lease_failed"], shared.reserves) == (1, 1)
    with pytest.raises(QuotaBackendError):
        await store.reserve(BUCKETS, ASK, clock())
    assert shared.reserves == 2  # no lease asked for within `seconds` of the failure: its own reserve
    shared.down = False
    clock.advance(POLICY.seconds)
    await store.reserve(BUCKETS, ASK, clock())
    assert store.counters["lease_taken"] == 1


async def test_the_meter_settles_lease_grants_in_place(shared: Shared) -> None:
    clock = FakeClock()
    store = leased(shared, clock)
    meter = QuotaMeter(store, clock)
    limits = Limits(requests_per_second=1.0, request_burst=100.0, tokens_per_second=1.0, token_burst=10_000.0)
    tenant = Tenant(tenant_id="t", display_name="t", quotas=Quotas(tenant=limits))
    key = ApiKey(key_id="k", tenant_id="t", roles=("consumer",), created_at=0.0)
    charge = await meter.reserve(tenant, key, 100)
    meter.settle_later(charge, 40)
    # Settled here and now: no task handed to the settler.
    assert meter.settler.in_flight == 0
    assert meter.counters["settled"] == 1
    buckets = meter.buckets_for(tenant, key).buckets
    assert await store.levels(buckets, clock()) == (99.0, 9_960.0)


async def test_the_configured_gateway_grants_from_leases_and_returns_them_at_shutdown(
    tenancy: Tenancy, sim_engine: SimulatedEngine, renderer: PromptRenderer
) -> None:
    tenant_id = f"lease-{uuid.uuid4().hex[:8]}"
    # Refill too slow to move a level by a token while the test runs (Redis keeps its own time).
    limits = Limits(requests_per_second=1e-6, request_burst=100, tokens_per_second=1e-6, token_burst=100_000)
    await tenancy.store.create_tenant(
        Tenant(tenant_id=tenant_id, display_name="Lease", quotas=Quotas(tenant=limits)), actor="test", now=0.0
    )
    key = await add_key(tenancy.store, tenant_id, ("consumer",))
    config = msgspec.structs.replace(
        keyless_metrics(make_config()), quota=QuotaConfig(backend="redis", op_timeout=5.0, lease=POLICY)
    )
    app = create_app(config, engine=sim_engine, renderer=renderer, tenants=tenancy.store)
    used = 0
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        for _ in range(6):
            response = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                headers={"authorization": f"Bearer {key}"},
            )
            assert response.status_code == 200, response.text
            used += billed(response.json()["usage"])
        scrape = (await http.get("/metrics")).text
    samples = {s.name: s.value for family in text_string_to_metric_families(scrape) for s in family.samples}
    assert samples["lockgate:quota_lease_grants_total"] == 6
    assert samples["lockgate:quota_leases_total"] >= 2
    assert samples["lockgate:quota_lease_misses_total"] == 0
    # Shut down: every lease went back, so Redis holds exactly what the six requests used.
    bucket = BucketSpec(key=f"tenant:{{{tenant_id}}}:tok", capacity=100_000, rate=1e-6)
    requests = BucketSpec(key=f"tenant:{{{tenant_id}}}:req", capacity=100, rate=1e-6)
    check = RedisQuotaStore.from_url(config.quota.redis_url)
    try:
        levels = await check.levels([requests, bucket], 0.0)
    finally:
        await check.close()
    assert levels == pytest.approx((94.0, 100_000.0 - used), abs=0.01)


async def test_keys_without_leases_are_forgotten_past_the_bound(
    shared: Shared, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("policy.quota.lease.KEYS_MAX", 3)
    clock = FakeClock()
    store = leased(shared, clock)
    for n in range(5):
        spec = BucketSpec(key=f"key:{{t}}:{n}:tok", capacity=10_000.0, rate=0.0)
        await store.reserve([spec], [100.0], clock())
        if n == 1:
            clock.advance(POLICY.seconds)  # the leases of keys 0 and 1 expire: those keys may be forgotten
    assert store.counters["lease_taken"] == 5
    assert store.keys_known == 3  # keys 0 and 1 were forgotten when key 3 came
    await store.close()
