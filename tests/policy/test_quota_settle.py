"""Settlement that survives faults: retried with backoff (time injected, nothing sleeps), drained at
shutdown with a bound, and reserves whose reply was lost settled by id on memory and real Redis alike."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import pytest

from policy.quota import (
    BucketSpec,
    MemoryQuotaStore,
    QuotaBackendError,
    QuotaBusyError,
    QuotaImpossibleError,
    QuotaStore,
    Reservation,
    ReservationClosedError,
    SettlePolicy,
    Settler,
)
from policy.quota.meter import QuotaMeter, QuotaUnavailableError, applicable
from policy.tenants.models import ApiKey, Limits, Quotas, Tenant
from tests.backends import FakeClock, WrappedQuotaStore, redis_quota

A = BucketSpec(key="{t}:a", capacity=100.0, rate=10.0)
LIMITS = Limits(requests_per_second=1, request_burst=10, tokens_per_second=1, token_burst=1_000)
KEY = ApiKey(key_id="k1", tenant_id="acme", roles=("consumer",), created_at=0.0)


def tenant(fail_mode: str) -> Tenant:
    quotas = Quotas(tenant=LIMITS, fail_mode=fail_mode)  # type: ignore[arg-type]
    return Tenant(tenant_id="acme", display_name="Acme", quotas=quotas)


class Sleeps:
    """An injected sleep: records each delay and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class Flaky(WrappedQuotaStore):
    """A store whose reconcile fails `failures` times (backend error, or busy pool) before it works."""

    def __init__(self, inner: QuotaStore, failures: int, busy: bool = False) -> None:
        super().__init__(inner)
        self.failures = failures
        self.busy = busy
        self.calls = 0

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        self.calls += 1
        if self.calls <= self.failures:
            raise QuotaBusyError("busy") if self.busy else QuotaBackendError("down")
        return await super().reconcile(reservation, actual, now)


class LostReply(Flaky):
    """A store whose reserve runs on the backend and then times out on the way back (the reply is lost);
    with `late`, it times out first and the reserve only arrives later (`arrive`), like a command queued in a
    stalled Redis."""

    def __init__(self, inner: QuotaStore, late: bool = False) -> None:
        super().__init__(inner, failures=0)
        self.late = late
        self.queued: list[tuple[Sequence[BucketSpec], Sequence[float], float, str | None]] = []

    async def reserve(
        self,
        buckets: Sequence[BucketSpec],
        amounts: Sequence[float],
        now: float,
        reservation_id: str | None = None,
    ) -> Reservation:
        if self.late:
            self.queued.append((buckets, amounts, now, reservation_id))
        else:
            await self.inner.reserve(buckets, amounts, now, reservation_id)
        raise QuotaBackendError("timed out waiting for the reply")

    async def arrive(self) -> int:
        """The queued reserves finally run (their callers are long gone); how many were refused."""
        refused = 0
        for buckets, amounts, now, rid in self.queued:
            try:
                await self.inner.reserve(buckets, amounts, now, rid)
            except ReservationClosedError:
                refused += 1
        return refused


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    """Each backend, from empty state, on the injected clock."""
    if request.param == "memory":
        yield MemoryQuotaStore()
        return
    async with redis_quota(f"lockgate:test:settle:{uuid.uuid4().hex}:") as redis_store:
        yield redis_store


async def test_a_failed_settlement_is_retried_with_exponential_backoff(store: QuotaStore) -> None:
    clock, sleeps, counters = FakeClock(), Sleeps(), Counter[str]()
    flaky = Flaky(store, failures=4)
    policy = SettlePolicy(attempts=10, first_delay=0.05, max_delay=0.3)
    settler = Settler(flaky, clock, counters, policy=policy, sleep=sleeps)
    reservation = await flaky.reserve([A], [60.0], clock())
    await settler.submit(reservation, [10.0])
    assert sleeps.delays == [0.05, 0.1, 0.2, 0.3]  # Doubling, capped.
    assert counters == Counter(settle_retried=4, settled=1)
    assert await store.levels([A], clock()) == (90.0,)


async def test_a_busy_pool_is_retried_and_counted_as_such(store: QuotaStore) -> None:
    clock, counters = FakeClock(), Counter[str]()
    flaky = Flaky(store, failures=2, busy=True)
    settler = Settler(flaky, clock, counters, sleep=Sleeps())
    reservation = await flaky.reserve([A], [60.0], clock())
    await settler.submit(reservation, [60.0])
    assert counters == Counter(pool_exhausted=2, settle_retried=2, settled=1)


async def test_settlement_gives_up_after_its_attempts_and_says_so(store: QuotaStore) -> None:
    clock, counters = FakeClock(), Counter[str]()
    flaky = Flaky(store, failures=1_000)
    settler = Settler(flaky, clock, counters, policy=SettlePolicy(attempts=3), sleep=Sleeps())
    reservation = await flaky.reserve([A], [60.0], clock())
    await settler.submit(reservation, [0.0])
    assert counters == Counter(settle_retried=2, settle_given_up=1)
    assert await store.levels([A], clock()) == (40.0,)  # Charged in full: never under-charged.


async def test_drain_waits_for_settlements_then_cuts_off_the_stuck_ones() -> None:
    clock, counters = FakeClock(), Counter[str]()
    store = MemoryQuotaStore()
    release = asyncio.Event()

    async def blocked(seconds: float) -> None:
        await release.wait()  # A retry that would wait past the drain bound.

    settler = Settler(Flaky(store, failures=1), clock, counters, sleep=blocked)
    stuck = settler.submit(await store.reserve([A], [60.0], clock()), [0.0])
    done = Settler(store, clock, counters)
    finished = done.submit(await store.reserve([A], [10.0], clock()), [0.0])
    await done.drain(60.0)
    assert finished.done()
    assert done.in_flight == 0
    await settler.drain(0.0)
    assert stuck.cancelled()
    assert settler.in_flight == 0
    assert counters["settle_given_up"] == 1
    assert counters["settled"] == 1


@pytest.mark.parametrize("in_process", [True, False], ids=["settled-in-place", "settler-task"])
async def test_settlements_are_not_cancelled_with_the_request_that_ended(in_process: bool) -> None:
    clock = FakeClock()
    store = MemoryQuotaStore()
    # Behind a wrapper the meter does not know the store settles in place: a settler task does it.
    meter = QuotaMeter(store if in_process else Flaky(store, failures=0), clock)
    charge = await meter.reserve(tenant("closed"), KEY, 100)

    async def request() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            meter.settle_later(charge, 30)  # Called while this task is being cancelled.

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await meter.drain(60.0)
    assert meter.counters["settled"] == 1
    [_, tokens] = [b for _, b, _ in applicable(tenant("closed"), KEY)]
    assert await store.levels([tokens], clock()) == (1_000.0 - 30,)


@pytest.mark.parametrize("late", [False, True], ids=["ran-then-timed-out", "timed-out-then-ran"])
async def test_a_refused_request_whose_reserve_outcome_is_unknown_leaks_nothing(
    store: QuotaStore, late: bool
) -> None:
    clock = FakeClock()
    lossy = LostReply(store, late=late)
    meter = QuotaMeter(lossy, clock, sleep=Sleeps())
    with pytest.raises(QuotaUnavailableError):
        await meter.reserve(tenant("closed"), KEY, 100)
    await meter.drain(60.0)
    # A late reserve finds its id closed: refused, it debits nothing.
    assert await lossy.arrive() == (1 if late else 0)
    buckets = [b for _, b, _ in applicable(tenant("closed"), KEY)]
    assert await store.levels(buckets, clock()) == (10.0, 1_000.0)
    assert meter.counters["reserve_unknown"] == meter.counters["fail_closed"] == 1
    assert meter.counters["settled" if not late else "settle_noop"] == 1


async def test_a_fail_open_request_whose_reserve_ran_is_charged_its_usage(store: QuotaStore) -> None:
    clock = FakeClock()
    meter = QuotaMeter(LostReply(store), clock, sleep=Sleeps())
    charge = await meter.reserve(tenant("open"), KEY, 100)
    assert charge.fail_open
    assert charge.reservation is None
    meter.settle_later(charge, 42)
    await meter.drain(60.0)
    buckets = [b for _, b, _ in applicable(tenant("open"), KEY)]
    # The reserve had run after all: settled by id like any request, charged exactly what it used.
    assert await store.levels(buckets, clock()) == (9.0, 1_000.0 - 42)
    assert meter.counters["settled"] == meter.counters["fail_open"] == 1


async def test_a_busy_pool_is_not_a_fail_open_or_fail_closed_decision() -> None:
    class Busy(Flaky):
        async def reserve(
            self,
            buckets: Sequence[BucketSpec],
            amounts: Sequence[float],
            now: float,
            reservation_id: str | None = None,
        ) -> Reservation:
            raise QuotaBusyError("no connection came free")

    meter = QuotaMeter(Busy(MemoryQuotaStore(), failures=0), FakeClock())
    for fail_mode in ("open", "closed"):
        with pytest.raises(QuotaBusyError):
            await meter.reserve(tenant(fail_mode), KEY, 100)
    assert meter.counters == Counter(pool_exhausted=2)


async def test_every_reservation_a_meter_makes_has_an_id_of_its_own_and_so_do_two_meters() -> None:
    # Two gateway replicas on one store: the exactly-once marker is keyed by the id, so no two may share one.
    clock = FakeClock()
    store = MemoryQuotaStore()
    big = Limits(requests_per_second=1_000, request_burst=10_000, tokens_per_second=1, token_burst=10_000)
    acme = Tenant(tenant_id="acme", display_name="Acme", quotas=Quotas(tenant=big))
    meters = [QuotaMeter(store, clock), QuotaMeter(store, clock)]
    ids = []
    for _ in range(200):
        for meter in meters:
            charge = await meter.reserve(acme, KEY, 1)
            assert charge.reservation is not None
            ids.append(charge.reservation.reservation_id)
    assert len(set(ids)) == len(ids) == 400


async def test_a_keys_buckets_are_remembered_until_its_tenants_quotas_change() -> None:
    store = MemoryQuotaStore()
    meter = QuotaMeter(store, FakeClock())
    acme = tenant("closed")
    first = meter.buckets_for(acme, KEY)
    assert meter.buckets_for(acme, KEY) is first
    assert first.names == ("tenant-requests", "tenant-tokens")
    assert first.buckets == tuple(b for _, b, _ in applicable(acme, KEY))
    assert first.policy == '"tenant-requests";q=10;w=10, "tenant-tokens";q=1000;w=1000'
    # An administrator lowers the token burst: the next request draws from the new bucket.
    lower = Limits(requests_per_second=1, request_burst=10, tokens_per_second=1, token_burst=50)
    changed = Tenant(tenant_id="acme", display_name="Acme", quotas=Quotas(tenant=lower))
    with pytest.raises(QuotaImpossibleError):
        await meter.reserve(changed, KEY, 100)
    assert meter.buckets_for(changed, KEY).buckets[1].capacity == 50
    # Another key of the tenant has buckets of its own.
    other = ApiKey(key_id="k2", tenant_id="acme", roles=("consumer",), created_at=0.0)
    unlimited = Tenant(tenant_id="acme", display_name="Acme", quotas=Quotas(tenant=LIMITS, per_key=LIMITS))
    assert meter.buckets_for(unlimited, other).buckets[2].key == "key:{acme}:k2:req"


async def test_the_in_process_store_is_settled_at_once_without_a_task() -> None:
    clock = FakeClock()
    store = MemoryQuotaStore()
    meter = QuotaMeter(store, clock)
    charge = await meter.reserve(tenant("closed"), KEY, 100)
    meter.settle_later(charge, 30)
    assert meter.settler.in_flight == 0
    assert meter.counters == Counter(reserved=1, settled=1)
    [_, tokens] = [b for _, b, _ in applicable(tenant("closed"), KEY)]
    assert await store.levels([tokens], clock()) == (1_000.0 - 30,)
    meter.settle_later(charge, 30)  # settled before: nothing changes
    assert meter.counters == Counter(reserved=1, settled=1, settle_noop=1)
    assert await store.levels([tokens], clock()) == (1_000.0 - 30,)
