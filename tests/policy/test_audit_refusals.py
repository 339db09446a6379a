"""Repeated no-cost refusals are tallied: a key refused at line rate leaves a handful of records with counts,
never one record each, and none of them is lost (interval end, memory limit, a full trail, shutdown); through
the real writer into SQLite and PostgreSQL, where the counted records chain and verify."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from policy.audit import AuditQuery, AuditStore, PostgresAuditStore, SqliteAuditStore
from policy.audit.records import AuditDraft
from policy.audit.refusals import OVERFLOW_KEY_ID, RefusalTally
from policy.audit.writer import AuditBufferFullError, AuditWriter
from tests.backends import PG_DSN, FakeClock, SqlBackend, sql_backend

INTERVAL = 60.0


def refusal(clock: FakeClock, n: int, key: str = "k1", source: str = "rate_limit_exceeded") -> AuditDraft:
    return AuditDraft(
        tenant="acme",
        key_id=key,
        request_id=f"req-{key}-{n}",
        at=clock(),
        stage="quota",
        decision="deny",
        source=source,
        detail=f"denial {n}",
    )


class Trail:
    """The writer's `submit`, into a list; `full` makes it refuse as a full trail does."""

    def __init__(self) -> None:
        self.drafts: list[AuditDraft] = []
        self.full = False

    def submit(self, draft: AuditDraft) -> None:
        if self.full:
            raise AuditBufferFullError("full (test)")
        self.drafts.append(draft)

    def total(self) -> int:
        return sum(d.count for d in self.drafts)


@pytest.fixture
def clock() -> FakeClock:
    # At the start of an interval, so that one interval holds the whole flood.
    return FakeClock(start=1_800_000_000.0 - 1_800_000_000.0 % INTERVAL)


def test_ten_thousand_refusals_of_one_key_leave_two_records_counting_all_of_them(clock: FakeClock) -> None:
    trail = Trail()
    tally = RefusalTally(trail.submit, clock, interval=INTERVAL)
    for n in range(10_000):
        tally.add(refusal(clock, n))
        clock.advance(0.001)
    # The first is recorded at once; the rest wait for the interval's end.
    assert [(d.request_id, d.count) for d in trail.drafts] == [("req-k1-0", 1)]
    assert tally.flush() == 0
    clock.advance(INTERVAL)
    assert tally.flush() == 1
    first, counted = trail.drafts
    assert (counted.count, counted.request_id, counted.key_id, counted.source) == (
        9_999,
        "req-k1-1",
        "k1",
        "rate_limit_exceeded",
    )
    assert counted.at == pytest.approx(first.at + 0.001)
    assert counted.last_at == pytest.approx(first.at + 9.999)
    assert "9999 refusals" in counted.detail
    assert trail.total() == 10_000
    assert tally.pending == 0


def test_each_key_and_reason_and_interval_is_its_own_tally(clock: FakeClock) -> None:
    trail = Trail()
    tally = RefusalTally(trail.submit, clock, interval=INTERVAL)
    for n in range(30):
        tally.add(
            refusal(
                clock,
                n,
                key=f"k{n % 2}",
                source=("rate_limit_exceeded", "quota_exceeds_capacity")[n % 3 == 0],
            )
        )
    clock.advance(INTERVAL)
    # A refusal in the next interval is recorded at once, and writes the last interval's tallies (no timer).
    tally.add(refusal(clock, 99))
    keys = {(d.key_id, d.source) for d in trail.drafts}
    assert keys == {(k, s) for k in ("k0", "k1") for s in ("rate_limit_exceeded", "quota_exceeds_capacity")}
    assert len(trail.drafts) == 4 + 4 + 1
    assert trail.total() == 31


def test_memory_is_bounded_and_overflow_is_counted_per_tenant(clock: FakeClock) -> None:
    trail = Trail()
    tally = RefusalTally(trail.submit, clock, interval=INTERVAL, max_keys=8)
    for n in range(1_000):
        tally.add(refusal(clock, n, key=f"key-{n}"))  # every one a new key: an attacker with many keys
        assert tally.pending <= 8 + 1
    tally.close()
    assert trail.total() == 1_000
    # The first 8 keys recorded their first refusal; the rest were folded into the tenant's overflow tally.
    overflow = [d for d in trail.drafts if d.key_id == OVERFLOW_KEY_ID]
    assert [d.count for d in overflow] == [992]
    assert len(trail.drafts) == 9


def test_the_hard_limit_writes_early_rather_than_drop(clock: FakeClock) -> None:
    trail = Trail()
    tally = RefusalTally(trail.submit, clock, interval=INTERVAL, max_keys=8)
    for n in range(200):
        # Many reasons: each overflow tally (tenant, reason) is a new one too.
        tally.add(refusal(clock, n, key=f"key-{n}", source=f"reason-{n}"))
        assert tally.pending <= 9
    assert tally.counters["early_flushes"] > 0
    tally.close()
    assert trail.total() == 200


def test_a_full_trail_keeps_the_counts_for_later(clock: FakeClock) -> None:
    trail = Trail()
    tally = RefusalTally(trail.submit, clock, interval=INTERVAL)
    trail.full = True
    for n in range(100):
        tally.add(refusal(clock, n))
    assert trail.drafts == []
    clock.advance(INTERVAL)
    assert tally.flush() == 0  # still full: kept
    trail.full = False
    assert tally.flush() == 1
    assert [d.count for d in trail.drafts] == [100]  # the first, refused at once, counted too


def test_a_full_trail_is_retried_later_not_on_every_refusal(clock: FakeClock) -> None:
    trail = Trail()
    tally = RefusalTally(trail.submit, clock, interval=INTERVAL)
    calls = 0
    real_flush = tally.flush

    def counting_flush(now: float | None = None) -> int:
        nonlocal calls
        calls += 1
        return real_flush(now)

    tally.flush = counting_flush  # type: ignore[method-assign]
    for n in range(10):
        tally.add(refusal(clock, n))
    trail.full = True
    clock.advance(INTERVAL)
    for n in range(1_000):
        tally.add(refusal(clock, 100 + n))
    assert calls == 1  # the due flush failed once; the next try waits a second
    clock.advance(1.0)
    trail.full = False
    tally.add(refusal(clock, 2_000))
    assert calls == 2
    tally.close()
    assert trail.total() == 1_011


def test_close_writes_what_is_tallied_before_its_interval_ends(clock: FakeClock) -> None:
    trail = Trail()
    tally = RefusalTally(trail.submit, clock, interval=INTERVAL)
    for n in range(50):
        tally.add(refusal(clock, n))
    assert tally.close() == 1
    assert [d.count for d in trail.drafts] == [1, 49]
    assert tally.pending == 0


async def test_run_writes_at_each_intervals_end(clock: FakeClock) -> None:
    trail = Trail()
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)
        await asyncio.sleep(0)

    tally = RefusalTally(trail.submit, clock, interval=INTERVAL, sleep=sleep)
    clock.advance(10)
    for n in range(5):
        tally.add(refusal(clock, n))
    task = asyncio.create_task(tally.run())
    async with asyncio.timeout(30):  # only a bug reaches it
        while len(trail.drafts) < 2:  # noqa: ASYNC110 - the task's own sleep moves the clock
            await asyncio.sleep(0)
    task.cancel()
    assert slept[0] == pytest.approx(INTERVAL - 10)  # to the interval's end, not a whole interval
    assert [d.count for d in trail.drafts] == [1, 4]


# --- through the writer, into both databases ---------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AuditStore]:
    async def postgres(schema: str) -> AuditStore:
        return await PostgresAuditStore.open(PG_DSN, schema=schema)

    backend: SqlBackend[AuditStore]
    async with sql_backend(request.param, tmp_path, SqliteAuditStore.open, postgres) as backend:
        yield await backend.open()


async def test_a_flood_of_refusals_is_a_handful_of_chained_records(
    store: AuditStore, clock: FakeClock, tmp_path: Path
) -> None:
    writer = AuditWriter(store, tmp_path / "spool", clock=clock, flush_interval=0.0)
    await writer.start()
    tally = RefusalTally(writer.submit, clock, interval=INTERVAL)
    for n in range(10_000):
        tally.add(refusal(clock, n, source=("rate_limit_exceeded", "quota_exceeds_capacity")[n % 2]))
        clock.advance(0.005)  # 50 s: one interval
    clock.advance(INTERVAL)
    tally.flush()
    tally.add(refusal(clock, 10_000))  # the next interval's first
    for n in range(10):  # and its rest, written at shutdown
        tally.add(refusal(clock, 10_001 + n))
    tally.close()
    await writer.close()
    records = await store.query(AuditQuery(tenant="acme"))
    assert len(records) == 6
    assert sum(r.count for r in records) == 10_011
    counted = [r for r in records if r.count > 1]
    assert sorted(r.count for r in counted) == [10, 4_999, 4_999]
    for record in counted:
        assert record.last_at is not None
        assert record.last_at >= record.at
        assert await store.get("acme", record.seq) == record
    report = await store.verify("acme")
    assert (report.ok, report.checked) == (True, 6)
