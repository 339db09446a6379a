"""One contract suite for every `QuotaStore` backend, memory and real Redis, driven by an injected clock.

Redis must run on 127.0.0.1:6379: without it the redis cases fail; they never skip."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio
import redis.exceptions
from hypothesis import given, settings
from hypothesis import strategies as st

import policy.quota
from policy.quota import (
    BucketSpec,
    MemoryQuotaStore,
    QuotaExceededError,
    QuotaImpossibleError,
    QuotaStore,
    RedisQuotaStore,
    Reservation,
    ReservationClosedError,
)
from policy.quota.memory import RECORD_TTL, TOMBSTONE_TTL

REDIS_URL = "redis://127.0.0.1:6379/0"
T0 = 1_700_000_000.0  # A realistic epoch time: refill arithmetic must stay exact at this magnitude.
A = BucketSpec(key="tenant:a:tok", capacity=100.0, rate=10.0)
B = BucketSpec(key="key:b:tok", capacity=50.0, rate=5.0)


async def redis_store() -> tuple[RedisQuotaStore, redis.asyncio.Redis, str]:
    """A store under a fresh key prefix; fails the test (never skips) if Redis is unreachable."""
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except redis.exceptions.ConnectionError as exc:
        await client.aclose()
        pytest.fail(f"the Redis quota contract needs Redis at {REDIS_URL}: {exc}")
    prefix = f"lockgate:test:{uuid.uuid4().hex}:"
    # Generous timeout: a loaded CI machine must not turn a slow reply into a flaky failure. The caller's
    # (injected) clock, not the server's: the suite drives time itself.
    store = RedisQuotaStore(client, prefix=prefix, op_timeout=5.0, server_time=False)
    return store, client, prefix


async def drop_redis_store(store: RedisQuotaStore, client: redis.asyncio.Redis, prefix: str) -> None:
    """Delete every key under the test's prefix, then close the store."""
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await store.close()


@pytest.fixture(params=["memory", "redis"])
async def quota_store(request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    """Every backend, each test starting from empty state."""
    if request.param == "memory":
        memory = MemoryQuotaStore()
        yield memory
        await memory.close()
        return
    store, client, prefix = await redis_store()
    yield store
    await drop_redis_store(store, client, prefix)


def test_the_package_exports_exactly_its_public_names() -> None:
    assert set(policy.quota.__all__) == {
        "BucketSpec",
        "LeasePolicy",
        "LeasedQuotaStore",
        "MemoryQuotaStore",
        "QuotaBackendError",
        "QuotaBusyError",
        "QuotaError",
        "QuotaExceededError",
        "QuotaImpossibleError",
        "QuotaStore",
        "RedisQuotaStore",
        "Reservation",
        "ReservationClosedError",
        "SettlePolicy",
        "Settler",
    }
    assert all(hasattr(policy.quota, name) for name in policy.quota.__all__)


async def test_new_bucket_starts_full(quota_store: QuotaStore) -> None:
    assert await quota_store.levels([A, B], T0) == (100.0, 50.0)
    reservation = await quota_store.reserve([A], [1.0], T0)
    assert reservation.levels == (99.0,)


async def test_burst_then_exact_retry_after(quota_store: QuotaStore) -> None:
    await quota_store.reserve([A], [40.0], T0)
    assert (await quota_store.reserve([A], [40.0], T0)).levels == (20.0,)
    with pytest.raises(QuotaExceededError) as denied:
        await quota_store.reserve([A], [40.0], T0)
    assert denied.value.bucket == A.key
    assert denied.value.retry_after == 2.0  # (40 - 20) / 10 per second
    assert denied.value.levels == (20.0,)
    assert await quota_store.levels([A], T0) == (20.0,)


async def test_refill_over_time_and_cap(quota_store: QuotaStore) -> None:
    await quota_store.reserve([A], [80.0], T0)
    assert await quota_store.levels([A], T0 + 1.5) == (35.0,)
    assert (await quota_store.reserve([A], [35.0], T0 + 1.5)).levels == (0.0,)
    assert await quota_store.levels([A], T0 + 1000.0) == (100.0,)  # Capped at capacity.


async def test_fractional_levels_are_exact(quota_store: QuotaStore) -> None:
    tiny = BucketSpec(key="tiny", capacity=1.0, rate=0.1)
    assert (await quota_store.reserve([tiny], [0.3], T0 + 0.123456789)).levels == (1.0 - 0.3,)
    assert await quota_store.levels([tiny], T0 + 1.123456789) == ((1.0 - 0.3) + 0.1 * 1.0,)


async def test_all_or_nothing_across_buckets(quota_store: QuotaStore) -> None:
    assert (await quota_store.reserve([A, B], [10.0, 50.0], T0)).levels == (90.0, 0.0)
    with pytest.raises(QuotaExceededError) as denied:
        await quota_store.reserve([A, B], [10.0, 1.0], T0)
    assert (denied.value.bucket, denied.value.retry_after) == (B.key, 0.2)
    assert await quota_store.levels([A, B], T0) == (90.0, 0.0)  # A was not debited.


async def test_reconcile_refunds_unused_up_to_capacity(quota_store: QuotaStore) -> None:
    reservation = await quota_store.reserve([A, B], [60.0, 1.0], T0)
    assert await quota_store.reconcile(reservation, [20.0, 1.0], T0)
    assert await quota_store.levels([A, B], T0) == (80.0, 49.0)
    reservation = await quota_store.reserve([A], [60.0], T0)
    assert await quota_store.reconcile(reservation, [0.0], T0 + 5.0)  # Refilled to 70, refund 60.
    assert await quota_store.levels([A], T0 + 5.0) == (100.0,)


async def test_reconcile_charges_overrun(quota_store: QuotaStore) -> None:
    reservation = await quota_store.reserve([A], [60.0], T0)
    assert await quota_store.reconcile(reservation, [150.0], T0)
    assert await quota_store.levels([A], T0) == (-50.0,)  # Debt: 40 - 90.
    with pytest.raises(QuotaExceededError) as denied:
        await quota_store.reserve([A], [10.0], T0)
    assert denied.value.retry_after == 6.0  # (10 - (-50)) / 10 per second.
    assert (await quota_store.reserve([A], [10.0], T0 + 6.0)).levels == (0.0,)


async def test_reconcile_is_exactly_once(quota_store: QuotaStore) -> None:
    reservation = await quota_store.reserve([A], [60.0], T0)
    assert await quota_store.reconcile(reservation, [10.0], T0)
    assert not await quota_store.reconcile(reservation, [10.0], T0)
    assert not await quota_store.reconcile(reservation, [100.0], T0)
    assert await quota_store.levels([A], T0) == (90.0,)


async def test_impossible_amount(quota_store: QuotaStore) -> None:
    with pytest.raises(QuotaImpossibleError) as never:
        await quota_store.reserve([A, B], [10.0, 51.0], T0)
    assert (never.value.bucket, never.value.amount, never.value.capacity) == (B.key, 51.0, 50.0)
    assert await quota_store.levels([A, B], T0) == (100.0, 50.0)


async def test_levels_do_not_mutate(quota_store: QuotaStore) -> None:
    await quota_store.reserve([A], [50.0], T0)
    assert await quota_store.levels([A], T0 + 2.0) == (70.0,)
    # Had `levels` written its refill at T0 + 2, the bucket's clock would now be ahead of T0 + 1.
    assert await quota_store.levels([A], T0 + 1.0) == (60.0,)


async def test_time_going_backwards_mints_nothing(quota_store: QuotaStore) -> None:
    await quota_store.reserve([A], [50.0], T0 + 10.0)
    assert (await quota_store.reserve([A], [10.0], T0)).levels == (40.0,)
    assert await quota_store.levels([A], T0 + 5.0) == (40.0,)
    assert await quota_store.levels([A], T0 + 11.0) == (50.0,)


async def test_reserve_is_idempotent_by_reservation_id(quota_store: QuotaStore) -> None:
    first = await quota_store.reserve([A, B], [30.0, 5.0], T0, "r-1")
    # A retry (the first reply was lost): the recorded outcome, debited once.
    again = await quota_store.reserve([A, B], [30.0, 5.0], T0 + 1.0, "r-1")
    assert again == first
    assert first.reservation_id == "r-1"
    assert await quota_store.levels([A, B], T0) == (70.0, 45.0)
    assert await quota_store.reconcile(first, [10.0, 5.0], T0)
    assert await quota_store.levels([A, B], T0) == (90.0, 45.0)


async def test_a_settled_id_is_never_granted_again(quota_store: QuotaStore) -> None:
    reservation = await quota_store.reserve([A], [30.0], T0, "r-2")
    assert await quota_store.reconcile(reservation, [0.0], T0)
    with pytest.raises(ReservationClosedError):
        await quota_store.reserve([A], [30.0], T0, "r-2")
    assert await quota_store.levels([A], T0) == (100.0,)


async def test_settling_an_id_never_granted_refunds_nothing_and_closes_it(quota_store: QuotaStore) -> None:
    # The reserve's reply was lost before it ran: the caller settles the id anyway, with nothing used.
    unknown = Reservation(reservation_id="r-3", buckets=(A,), amounts=(30.0,), levels=())
    assert not await quota_store.reconcile(unknown, [0.0], T0)
    assert await quota_store.levels([A], T0) == (100.0,)  # Nothing minted.
    # The reserve arrives late (it was queued in a stalled server): refused, nothing debited.
    with pytest.raises(ReservationClosedError):
        await quota_store.reserve([A], [30.0], T0, "r-3")
    assert await quota_store.levels([A], T0) == (100.0,)


async def test_a_granted_reservation_settles_long_after_a_tombstone_would_be_forgotten(
    quota_store: QuotaStore,
) -> None:
    # A long stream: granted records live for RECORD_TTL, not for the tombstones' shorter TTL.
    reservation = await quota_store.reserve([B], [50.0], T0, "r-long")
    later = T0 + TOMBSTONE_TTL + 60.0
    assert await quota_store.reconcile(reservation, [60.0], later)  # Refilled to full, then 10 over.
    assert await quota_store.levels([B], later) == (40.0,)


async def test_memory_store_forgets_tombstones_after_their_ttl_and_granted_records_after_theirs() -> None:
    store = MemoryQuotaStore()
    closed = await store.reserve([A], [30.0], T0, "r-closed")
    assert await store.reconcile(closed, [30.0], T0)
    stale = await store.reserve([B], [50.0], T0, "r-stale")  # Never settled in time.
    with pytest.raises(ReservationClosedError):
        await store.reserve([A], [1.0], T0 + TOMBSTONE_TTL - 1.0, "r-closed")
    # Past the tombstone's TTL the id is forgotten: a reserve that late is a new one, debited anew.
    assert (await store.reserve([A], [1.0], T0 + TOMBSTONE_TTL + 1.0, "r-closed")).levels == (99.0,)
    # Past RECORD_TTL a granted id is forgotten too: its late reconcile is a no-op (no overrun charged).
    late = T0 + RECORD_TTL + 1.0
    assert not await store.reconcile(stale, [60.0], late)
    assert await store.levels([B], late) == (50.0,)
    await store.close()


async def test_a_denied_reserve_is_not_recorded(quota_store: QuotaStore) -> None:
    await quota_store.reserve([A], [90.0], T0)
    with pytest.raises(QuotaExceededError):
        await quota_store.reserve([A], [50.0], T0, "r-4")
    # Nothing was debited, so the same id may simply be granted once it fits.
    assert (await quota_store.reserve([A], [50.0], T0 + 4.0, "r-4")).levels == (0.0,)


# --- Property test: random operation sequences against a pure-Python reference model ---

# (kind: 0 advance / 1 reserve / 2 reconcile, clock step, bucket order, amounts, pick of an earlier
# reservation). The clock may step back: that must never mint tokens.
Op = tuple[int, float, tuple[int, ...], tuple[float, float], int]
AMOUNT = st.floats(0.0, 130.0)
OPS = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.floats(-1.0, 5.0),
        st.sampled_from([(0,), (1,), (0, 1), (1, 0)]),
        st.tuples(AMOUNT, AMOUNT),
        st.integers(0, 1_000),
    ),
    max_size=40,
)
SPECS = st.tuples(st.floats(1.0, 120.0), st.floats(0.1, 50.0), st.floats(1.0, 120.0), st.floats(0.1, 50.0))


def refilled(state: dict[str, tuple[float, float]], spec: BucketSpec, now: float) -> tuple[float, float]:
    """The reference refill, (level, ts): the textbook token bucket, with time that never goes backwards."""
    if spec.key not in state:
        return spec.capacity, now
    level, ts = state[spec.key]
    return min(spec.capacity, level + spec.rate * (max(now, ts) - ts)), max(now, ts)


async def check_sequence(store: QuotaStore, specs: tuple[BucketSpec, BucketSpec], ops: list[Op]) -> None:
    """Run `ops` on `store` and on the model side by side; they must agree after every step."""
    state: dict[str, tuple[float, float]] = {}
    granted: list[Reservation] = []
    settled: set[str] = set()
    now = T0
    for kind, step, order, amounts, pick in ops:
        now += step if kind == 0 else 0.0
        if kind == 1:
            buckets = [specs[i] for i in order]
            wanted = amounts[: len(buckets)]
            model = [(*refilled(state, b, now), b, w) for b, w in zip(buckets, wanted, strict=True)]
            waits = [(w - lv) / b.rate + (ts - now) for lv, ts, b, w in model if lv < w]
            if any(w > b.capacity for _, _, b, w in model):
                with pytest.raises(QuotaImpossibleError):
                    await store.reserve(buckets, wanted, now)
            elif waits:
                with pytest.raises(QuotaExceededError) as denied:
                    await store.reserve(buckets, wanted, now)
                assert denied.value.retry_after == pytest.approx(max(waits), abs=1e-6)
            else:
                granted.append(await store.reserve(buckets, wanted, now))
                state.update({b.key: (lv - w, ts) for lv, ts, b, w in model})
                assert granted[-1].levels == pytest.approx([lv - w for lv, _, _, w in model], abs=1e-6)
        elif kind == 2 and granted:
            reservation = granted[pick % len(granted)]
            actual = amounts[: len(reservation.buckets)]
            fresh = reservation.reservation_id not in settled
            assert await store.reconcile(reservation, actual, now) == fresh
            settled.add(reservation.reservation_id)
            for b, reserved, used in zip(reservation.buckets, reservation.amounts, actual, strict=True):
                lv, ts = refilled(state, b, now)
                state[b.key] = (min(b.capacity, lv + (reserved - used)), ts) if fresh else state[b.key]
        levels = await store.levels(specs, now)
        assert levels == pytest.approx([refilled(state, b, now)[0] for b in specs], abs=1e-6)
        # Invariant under test: a level never exceeds its capacity.
        assert all(lv <= b.capacity for lv, b in zip(levels, specs, strict=True))


@pytest.fixture(scope="module")
def property_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop of its own: Hypothesis drives examples synchronously, outside pytest-asyncio's loop."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.mark.parametrize("backend", ["memory", "redis"])
@settings(max_examples=60, deadline=None)
@given(raw_specs=SPECS, ops=OPS)
def test_matches_reference_model(
    property_loop: asyncio.AbstractEventLoop,
    backend: str,
    raw_specs: tuple[float, float, float, float],
    ops: list[Op],
) -> None:
    c1, r1, c2, r2 = raw_specs
    specs = (BucketSpec(key="a", capacity=c1, rate=r1), BucketSpec(key="b", capacity=c2, rate=r2))

    async def run() -> None:
        if backend == "memory":
            await check_sequence(MemoryQuotaStore(), specs, ops)
            return
        store, client, prefix = await redis_store()  # A fresh prefix per example.
        try:
            await check_sequence(store, specs, ops)
        finally:
            await drop_redis_store(store, client, prefix)

    property_loop.run_until_complete(run())
