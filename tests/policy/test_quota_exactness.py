"""`RedisQuotaStore` beyond the contract: exact under contention from several processes, bounded when Redis
is dead or stalled, and its keys expire. Needs Redis on 127.0.0.1:6379 (fails, never skips, without it)."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
import uuid
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

import pytest
import redis.asyncio

from policy.quota import (
    BucketSpec,
    LeasedQuotaStore,
    LeasePolicy,
    QuotaBackendError,
    QuotaExceededError,
    QuotaImpossibleError,
    QuotaStore,
    RedisQuotaStore,
)
from policy.quota.memory import RECORD_TTL, TOMBSTONE_TTL

REDIS_URL = "redis://127.0.0.1:6379/0"
REPLICAS = 4
SECONDS = 2.0
MAX_ITERATIONS = 50_000  # Per replica: bounds the run even on a machine fast enough to skip the deadline.
# Demand (thousands of requests a second, 25 tokens each) far exceeds supply, so the bucket is the only limit.
SPEC = BucketSpec(key="tenant:exact:tok", capacity=1_000.0, rate=2_000.0)
T0 = 1_700_000_000.0

Grant = tuple[float, int]  # (now, amount)
# (grants, denials, grants from a lease), or the worker's error
Outcome = tuple[list[Grant], int, int] | str


def replica(prefix: str, seed: int, start: Barrier, results: Queue[Outcome], leased: bool) -> None:
    """One stand-in gateway replica (its own process and connection): reserve as fast as it can; `leased`:
    granting from leases (`LeasedQuotaStore`, taken whenever the store allows: no floor, short leases)."""

    async def hammer() -> tuple[list[Grant], int, int]:
        # Client time: the bound below is computed from the `now` each grant passed.
        store: QuotaStore = RedisQuotaStore(
            redis.asyncio.Redis.from_url(REDIS_URL), prefix=prefix, op_timeout=5.0, server_time=False
        )
        if leased:
            store = LeasedQuotaStore(store, time.time, LeasePolicy(floor=0.0, seconds=0.05))
        rng = random.Random(seed)
        grants: list[Grant] = []
        denials = 0
        await store.levels([SPEC], time.time())  # Connect and load the scripts before the start line.
        await asyncio.to_thread(start.wait, 30.0)
        deadline = time.monotonic() + SECONDS
        for _ in range(MAX_ITERATIONS):
            if time.monotonic() >= deadline:
                break
            amount, now = rng.randint(1, 50), time.time()
            try:
                await store.reserve([SPEC], [float(amount)], now)
                grants.append((now, amount))
            except QuotaExceededError:
                denials += 1
        from_leases = store.counters["lease_grants"] if isinstance(store, LeasedQuotaStore) else 0
        await store.close()
        return grants, denials, from_leases

    try:
        results.put(asyncio.run(hammer()))
    except BaseException as exc:  # Reported to the parent, which fails the test with it.
        results.put(f"replica {seed} failed: {exc!r}")
        raise


async def drop_prefix(prefix: str) -> None:
    """Delete the keys the test wrote."""
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.mark.parametrize("leased", [False, True], ids=["exact", "leased"])
def test_replicas_never_overdraw_one_bucket(leased: bool) -> None:
    prefix = f"lockgate:test:{uuid.uuid4().hex}:"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(REPLICAS)
    results: Queue[Outcome] = ctx.Queue()
    workers = [
        ctx.Process(target=replica, args=(prefix, seed, start, results, leased)) for seed in range(REPLICAS)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=60.0) for _ in workers]
    for worker in workers:
        worker.join(timeout=10.0)
    asyncio.run(drop_prefix(prefix))

    errors = [outcome for outcome in outcomes if isinstance(outcome, str)]
    assert not errors, errors
    grants = [grant for outcome in outcomes if not isinstance(outcome, str) for grant in outcome[0]]
    denials = sum(outcome[1] for outcome in outcomes if not isinstance(outcome, str))
    from_leases = sum(outcome[2] for outcome in outcomes if not isinstance(outcome, str))
    assert (from_leases > 0) == leased
    assert grants
    assert denials, "the bucket must be contended for the test to mean anything"
    stamps = [now for now, _ in grants]
    # Every grant wrote the bucket's clock; denials write nothing. So the refill the bucket ever credited is
    # at most rate x (last grant's now - first grant's now), on top of the full bucket it started as. A
    # lease is debited at the `now` of the request that asked for it, within the same span, and what is
    # granted from it is part of what it debited: the bound holds for leases as it stands.
    bound = SPEC.capacity + SPEC.rate * (max(stamps) - min(stamps))
    granted = sum(amount for _, amount in grants)
    assert granted <= bound + 1e-6, f"granted {granted} > {bound}: overdrawn"
    assert granted >= 0.5 * bound, f"granted {granted} of {bound:.0f}: needlessly stingy"


async def test_dead_redis_is_a_backend_error_not_a_hang() -> None:
    store = RedisQuotaStore(redis.asyncio.Redis(host="127.0.0.1", port=1), op_timeout=0.5)
    with pytest.raises(QuotaImpossibleError):  # Decided before any round trip.
        await store.reserve([SPEC], [1_001.0], T0)
    with pytest.raises(QuotaBackendError):
        await store.reserve([SPEC], [1.0], T0)
    with pytest.raises(QuotaBackendError):
        await store.levels([SPEC], T0)
    await store.close()


async def test_stalled_redis_times_out() -> None:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # Accept the connection and never answer.
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisQuotaStore(redis.asyncio.Redis(host="127.0.0.1", port=port), op_timeout=0.1)
    started = time.monotonic()
    with pytest.raises(QuotaBackendError):
        await store.reserve([SPEC], [1.0], T0)
    assert time.monotonic() - started < 2.0  # op_timeout, not the OS's TCP timeout.
    await store.close()
    server.close()
    await server.wait_closed()


async def test_keys_expire_once_the_bucket_would_be_full_again() -> None:
    prefix = f"lockgate:test:{uuid.uuid4().hex}:"
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    store = RedisQuotaStore(
        redis.asyncio.Redis.from_url(REDIS_URL), prefix=prefix, op_timeout=5.0, server_time=False
    )
    spec = BucketSpec(key="{acme}:t", capacity=100.0, rate=10.0)
    reservation = await store.reserve([spec], [60.0], T0)
    record = f"{prefix}res:{{acme}}:{reservation.reservation_id}"  # Under the bucket's hash tag.
    assert RECORD_TTL - 10 < await client.ttl(record) <= RECORD_TTL
    assert 60 < await client.ttl(f"{prefix}bucket:{{acme}}:t") <= 66  # (100 - 40) / 10 s to full, + 60 s.
    assert await store.reconcile(reservation, [150.0], T0)  # Debt of 50 takes longer to pay back.
    assert 70 < await client.ttl(f"{prefix}bucket:{{acme}}:t") <= 75
    # Now a tombstone, kept for a shorter while: reserve refuses the id, reconcile is a no-op.
    assert TOMBSTONE_TTL - 10 < await client.ttl(record) <= TOMBSTONE_TTL
    await store.close()
    await drop_prefix(prefix)
    await client.aclose()
