"""AuditWriter: outage -> spool -> replay without losing or reordering a draft, restart, backpressure,
`record` durability, close, and a round trip through the real SQLite store."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import pytest

from policy.audit.base import AuditQuery, AuditRecordError, AuditUnavailableError, NotFoundError
from policy.audit.records import (
    GENESIS_HASH,
    AuditDraft,
    AuditRecord,
    ChainReport,
    InvalidDraftError,
    chain,
    content_sha256,
    verify_chain,
)
from policy.audit.spool import Spool
from policy.audit.sqlite import SqliteAuditStore
from policy.audit.writer import (
    AuditBackpressureError,
    AuditSpoolFullError,
    AuditWriter,
    AuditWriterClosedError,
    RetryPolicy,
)

TENANTS = ("acme", "globex", "initech")


async def fast_sleep(_: float) -> None:
    """Every flush interval and backoff elapses at the next turn of the loop."""
    await asyncio.sleep(0)


async def never(_: float) -> None:
    """A timer that never fires: only batch_size, `record` and `close` flush."""
    await asyncio.Event().wait()


class FakeStore:
    """An in-memory AuditStore that chains records like the real ones and can be switched to fail."""

    def __init__(self) -> None:
        self.records: dict[str, list[AuditRecord]] = {}
        self.down = False
        self.error: Exception | None = None  # raised once by the next append (an unexpected failure)
        self.gate: asyncio.Event | None = None  # when set: appends wait for it
        self.calls = 0
        self.on_append: Callable[[], None] | None = None
        # A draft this refuses as a record (`AuditRecordError`) whenever it is in a batch, with or without
        # its content: request ids refused with their content, and refused in any form.
        self.poison: set[str] = set()
        self.poison_always: set[str] = set()

    async def append(self, drafts: Sequence[AuditDraft]) -> list[AuditRecord]:
        self.calls += 1
        if self.on_append is not None:
            self.on_append()
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.down:
            raise AuditUnavailableError("database is down")
        for draft in drafts:
            if draft.request_id in self.poison_always or (
                draft.request_id in self.poison and draft.content is not None
            ):
                raise AuditRecordError(f"refused {draft.request_id}")
        out = []
        for draft in drafts:
            chain_ = self.records.setdefault(draft.tenant, [])
            prev = chain_[-1].hash if chain_ else GENESIS_HASH
            chain_.append(chain(draft, len(chain_) + 1, prev))
            out.append(chain_[-1])
        return out

    async def get(self, tenant: str, seq: int) -> AuditRecord:
        try:
            return self.records[tenant][seq - 1]
        except (KeyError, IndexError):
            raise NotFoundError(f"{tenant} {seq}") from None

    async def find(self, tenant: str | None, request_id: str) -> list[AuditRecord]:
        return [r for rs in self.records.values() for r in rs if r.request_id == request_id]

    async def query(self, q: AuditQuery) -> list[AuditRecord]:
        return list(self.records.get(q.tenant or "", []))[: q.page_size()]

    async def verify(self, tenant: str) -> ChainReport:
        return verify_chain(self.records.get(tenant, []), tenant=tenant)

    async def purge_content(self, tenant: str, before: float) -> int:
        return 0

    async def close(self) -> None:
        return None

    def ids(self, tenant: str) -> list[str]:
        return [r.request_id for r in self.records.get(tenant, [])]

    def total(self) -> int:
        return sum(len(rs) for rs in self.records.values())


def draft(i: int, tenant: str | None = None) -> AuditDraft:
    return AuditDraft(
        tenant=tenant or TENANTS[i % len(TENANTS)],
        key_id="k1",
        request_id=f"req-{i:05d}",
        at=float(i),
        stage="input",
        decision="allow",
        source="model",
        content_hash="0" * 64,
    )


def expected(ids: range, tenant: str) -> list[str]:
    return [f"req-{i:05d}" for i in ids if TENANTS[i % len(TENANTS)] == tenant]


async def until(cond: Callable[[], bool], within: float = 120.0) -> None:
    """Let the writer (and its spool threads) run until `cond` holds; fails rather than hang. Bounded by
    time, not loop turns: the spool's threads take as long as a slow machine needs."""
    async with asyncio.timeout(within):
        while not cond():  # noqa: ASYNC110 - polling state the spool threads change
            await asyncio.sleep(0.001)


def make(store: FakeStore | SqliteAuditStore, spool: Path, **kw: object) -> AuditWriter:
    opts: dict[str, object] = {"batch_size": 50, "sleep": fast_sleep, "retry": RetryPolicy()}
    opts.update(kw)
    clock = itertools.count().__next__
    return AuditWriter(store, spool, clock=lambda: float(clock()), **opts)  # type: ignore[arg-type]


async def test_outage_half_way_loses_nothing_and_keeps_each_tenants_order(tmp_path: Path) -> None:
    store = FakeStore()
    writer = make(store, tmp_path / "spool")
    await writer.start()
    for i in range(1000):
        if i == 500:
            await until(lambda: store.total() > 0)
            store.down = True
        writer.submit(draft(i))
        if i % 97 == 0:
            await asyncio.sleep(0)
    await until(lambda: writer.counters["spooled"] > 0 and not writer.state().store_up)
    assert writer.state().dropped == 0
    store.down = False
    await until(lambda: store.total() == 1000 and writer.state().spooled_bytes == 0)
    await writer.close()
    assert store.total() == 1000
    for tenant in TENANTS:
        assert store.ids(tenant) == expected(range(1000), tenant)
        assert (await store.verify(tenant)).ok
    c = writer.counters
    assert c["appended"] + c["replayed"] == 1000
    assert c["replayed"] > 0
    assert c["flush_failures"] > 0
    assert writer.state().spool_files == 0


async def test_submissions_during_replay_go_behind_the_spool(tmp_path: Path) -> None:
    store = FakeStore()
    writer = make(store, tmp_path / "spool", batch_size=10)
    await writer.start()
    store.down = True
    for i in range(100):
        writer.submit(draft(i))
    await until(lambda: writer.state().spooled_bytes > 0 and writer.state().buffered == 0)
    submitted = iter(range(100, 200))

    def submit_more() -> None:
        # While the spool replays, new drafts keep coming: they must land after every spooled one.
        for i in itertools.islice(submitted, 10):
            writer.submit(draft(i))

    store.on_append = submit_more
    store.down = False
    await until(lambda: store.total() == 200 and writer.state().spooled_bytes == 0)
    store.on_append = None
    for i in range(200, 230):  # back to direct appends
        writer.submit(draft(i))
    await writer.close()
    for tenant in TENANTS:
        assert store.ids(tenant) == expected(range(230), tenant)
    assert writer.counters["replayed"] >= 100


async def test_restart_replays_leftover_spool_first(tmp_path: Path) -> None:
    store = FakeStore()
    store.down = True
    first = make(store, tmp_path / "spool", sleep=never)
    await first.start()
    for i in range(120):
        first.submit(draft(i))
    await first.close()  # the store is down: everything buffered goes to the spool
    assert store.total() == 0
    assert first.counters["spooled"] == 120
    store.down = False
    second = make(store, tmp_path / "spool")
    await second.start()
    assert second.state().spooled_bytes > 0
    for i in range(120, 150):
        second.submit(draft(i))
    await until(lambda: store.total() == 150)
    await second.close()
    for tenant in TENANTS:
        assert store.ids(tenant) == expected(range(150), tenant)
    assert second.counters["replayed"] >= 120  # the new ones may be spooled behind them
    assert not list((tmp_path / "spool").glob("spool-*"))


async def test_spool_full_refuses_and_drops_nothing(tmp_path: Path) -> None:
    store = FakeStore()
    store.down = True
    writer = make(store, tmp_path / "spool", batch_size=5, spool_max_bytes=3000)
    await writer.start()
    accepted = 0
    refused: AuditSpoolFullError | None = None
    while refused is None and accepted < 10_000:
        try:
            writer.submit(draft(accepted))
        except AuditSpoolFullError as exc:
            refused = exc
            break
        accepted += 1
        await until(lambda: writer.state().buffered < 5)
    assert refused is not None
    assert 0 < accepted < 10_000
    state = writer.state()
    assert state.spooled_bytes >= 3000
    assert not state.store_up
    assert state.dropped == 0
    with pytest.raises(AuditBackpressureError):
        await writer.record(draft(accepted))
    store.down = False
    await until(lambda: store.total() == accepted and writer.state().spooled_bytes == 0)
    writer.submit(draft(accepted))  # accepted again once the spool drained
    await writer.close()
    assert store.total() == accepted + 1
    for tenant in TENANTS:
        assert store.ids(tenant) == expected(range(accepted + 1), tenant)


async def test_a_full_spool_still_takes_refusals_into_their_reserve(tmp_path: Path) -> None:
    store = FakeStore()
    store.down = True
    writer = make(store, tmp_path / "spool", batch_size=1, spool_max_bytes=3000)
    await writer.start()
    accepted: list[AuditDraft] = []
    i = 0
    while True:  # allows, until the spool is full
        try:
            writer.submit(draft(i))
        except AuditSpoolFullError:
            break
        accepted.append(draft(i))
        i += 1
        await until(lambda: writer.state().buffered == 0)
    full_at = writer.state().spooled_bytes
    # Refusals before the gate (free to the client) and the refusals a full trail causes draw on no
    # reserve: a flood of them cannot use up the room kept for the gate's blocks.
    for free in (
        msgspec.structs.replace(draft(i), stage="quota", decision="deny", source="rate_limited"),
        msgspec.structs.replace(draft(i), stage="admission", decision="refuse", source="queue_full"),
    ):
        with pytest.raises(AuditSpoolFullError):
            writer.submit(free)
    # The gate's refusals are still taken, from an eighth more of the spool; allows are not.
    refusals = 0
    while True:
        block = msgspec.structs.replace(draft(i), decision="block")
        try:
            writer.submit(block)
        except AuditSpoolFullError:
            break
        accepted.append(block)
        refusals += 1
        i += 1
        await until(lambda: writer.state().buffered == 0)
        with pytest.raises(AuditSpoolFullError):
            writer.submit(draft(10_000 + i))
    assert refusals > 0
    assert full_at >= 3000
    # Each check is made at submission: the last draft taken may cross the bound by its own size.
    assert 3000 * 9 / 8 <= writer.state().spooled_bytes < 3000 * 9 / 8 + 1000
    store.down = False
    await until(lambda: store.total() == len(accepted) and writer.state().spooled_bytes == 0)
    await writer.close()
    assert [r.decision for t in TENANTS for r in store.records.get(t, [])].count("block") == refusals


async def test_record_returns_only_once_durable(tmp_path: Path) -> None:
    store = FakeStore()
    store.gate = asyncio.Event()
    writer = make(store, tmp_path / "spool", sleep=never)
    await writer.start()
    writer.submit(draft(0))
    task = asyncio.create_task(writer.record(draft(1)))
    await until(lambda: store.calls == 1)
    for _ in range(50):
        await asyncio.sleep(0)
    assert not task.done()  # the store has not answered
    store.gate.set()
    await task
    assert store.total() == 2
    # During an outage, durable means fsync'd in the spool.
    store.down = True
    await writer.record(draft(2))
    assert writer.counters["spooled"] == 1
    assert writer.state().spooled_bytes > 0
    await writer.close()


async def test_close_flushes_to_the_store_or_the_spool(tmp_path: Path) -> None:
    store = FakeStore()
    writer = make(store, tmp_path / "a", sleep=never, batch_size=1000)
    await writer.start()
    for i in range(30):
        writer.submit(draft(i))
    assert store.total() == 0  # neither batch_size nor a timer reached
    await writer.close()
    assert store.total() == 30
    with pytest.raises(AuditWriterClosedError):
        writer.submit(draft(99))
    # A store that hangs: close's bound cuts the append off, the drafts go to the spool.
    hung = FakeStore()
    hung.gate = asyncio.Event()
    writer = make(hung, tmp_path / "b", sleep=never, batch_size=5)
    await writer.start()
    for i in range(7):
        writer.submit(draft(i))
    await until(lambda: hung.calls == 1)
    await writer.close(within=0.0)
    assert writer.state().buffered == 0
    assert writer.counters["spooled"] == 7
    spool = Spool(tmp_path / "b")
    await spool.open()
    drafts, _ = await spool.read(100)
    assert [d.request_id for d in drafts] == [f"req-{i:05d}" for i in range(7)]


async def test_unexpected_append_error_does_not_kill_the_writer(tmp_path: Path) -> None:
    store = FakeStore()
    store.error = RuntimeError("a bug in the driver")
    writer = make(store, tmp_path / "spool", batch_size=10)
    await writer.start()
    for i in range(40):
        writer.submit(draft(i))
    await until(lambda: store.total() == 40)
    for i in range(40, 60):
        writer.submit(draft(i))
    await writer.close()
    assert store.total() == 60
    assert writer.counters["flush_failures"] == 1
    assert writer.state().last_error == "RuntimeError: a bug in the driver"
    for tenant in TENANTS:
        assert store.ids(tenant) == expected(range(60), tenant)


async def test_a_record_the_store_refuses_is_set_apart_and_the_trail_goes_on(tmp_path: Path) -> None:
    # One draft the store refuses with its content, one it refuses in any form: before, each stopped the
    # trail for every tenant (the batch retried forever); now the batch goes on without them.
    store = FakeStore()
    store.poison = {"req-00007"}
    store.poison_always = {"req-00013"}
    writer = make(store, tmp_path / "spool", batch_size=10)
    await writer.start()
    drafts = [msgspec.structs.replace(draft(i), content=f"text {i}", content_hash="") for i in range(30)]
    for d in drafts:
        writer.submit(d)
    await writer.close()
    assert store.total() == 29
    # The first is recorded without its content, saying why; its content hash stays.
    [bare] = [r for r in store.records[drafts[7].tenant] if r.request_id == "req-00007"]
    assert bare.content is None
    assert bare.content_hash == content_sha256("text 7")
    assert "content not stored" in bare.detail
    # The second is written to the quarantine file beside the spool, without its content (a file outside
    # the store is never purged when retention ends): its content hash stays.
    raw = (tmp_path / "spool" / "quarantine.jsonl").read_bytes()
    quarantined = [msgspec.json.decode(x, type=AuditDraft) for x in raw.splitlines()]
    assert [(q.request_id, q.content, q.content_hash) for q in quarantined] == [
        ("req-00013", None, content_sha256("text 13"))
    ]
    assert b"text 13" not in raw
    assert (tmp_path / "spool" / "quarantine.jsonl").stat().st_mode & 0o777 == 0o600
    assert (writer.counters["refused_records"], writer.counters["quarantined"]) == (2, 1)
    # Every other draft is recorded, in order, and no batch was spooled for a retry.
    for tenant in TENANTS:
        assert store.ids(tenant) == [x for x in expected(range(30), tenant) if x != "req-00013"]
    assert writer.counters["spooled"] == 0


async def test_invalid_draft_is_refused_at_submission(tmp_path: Path) -> None:
    writer = make(FakeStore(), tmp_path / "spool")
    await writer.start()
    with pytest.raises(InvalidDraftError):
        writer.submit(msgspec.structs.replace(draft(0), at=float("nan")))
    await writer.close()


def crash_mid_write(spool_dir: Path) -> None:
    """A torn last line, and a restart after the first file's cursor moved on, before its delete."""
    files = sorted(spool_dir.glob("spool-*"))
    with files[-1].open("ab") as f:
        f.write(b'{"tenant": "acme", "torn')
    (spool_dir / "cursor.json").write_bytes(b'{"file": 2, "offset": 0}')


async def test_spool_skips_a_torn_tail_and_survives_a_crash_after_the_cursor_write(tmp_path: Path) -> None:
    spool = Spool(tmp_path, file_max_bytes=1)  # one file per append
    await spool.open()
    await spool.append([draft(0), draft(1)])
    await spool.append([draft(2)])
    await asyncio.to_thread(crash_mid_write, tmp_path)
    spool.close()  # the process died: its lock went with it
    spool = Spool(tmp_path)
    await spool.open()
    assert spool.files == 1
    drafts, cursor = await spool.read(10)
    assert [d.request_id for d in drafts] == ["req-00002"]
    await spool.commit(cursor)
    assert (await spool.read(10))[0] == []
    assert spool.empty
    assert spool.files == 0


async def test_sqlite_round_trip_through_an_outage_verifies(tmp_path: Path) -> None:
    real = await SqliteAuditStore.open(tmp_path / "audit.db")
    down = False

    class Flaky(FakeStore):
        async def append(self, drafts: Sequence[AuditDraft]) -> list[AuditRecord]:
            if down:
                raise AuditUnavailableError("sqlite is away")
            return await real.append(drafts)

    writer = make(Flaky(), tmp_path / "spool", batch_size=25)
    await writer.start()
    try:
        for i in range(300):
            if i == 150:
                down = True
            writer.submit(draft(i))
            await asyncio.sleep(0)
        await until(lambda: writer.state().spooled_bytes > 0)
        down = False
        await until(lambda: writer.counters["appended"] + writer.counters["replayed"] == 300)
        await writer.close()
        for tenant in TENANTS:
            records = await real.query(AuditQuery(tenant=tenant, limit=1000))
            assert [r.request_id for r in records] == expected(range(300), tenant)
            assert (await real.verify(tenant)).ok
    finally:
        await real.close()


async def test_each_process_claims_a_spool_directory_of_its_own(tmp_path: Path) -> None:
    """Workers of one gateway share the configured directory: the first holds it, the next ones get a
    worker-<n> directory each, and one freed (its process died) is taken over with what it left."""
    first, second, third = Spool(tmp_path), Spool(tmp_path), Spool(tmp_path)
    for spool in (first, second, third):
        await spool.open()
    assert [s.directory for s in (first, second, third)] == [
        tmp_path,
        tmp_path / "worker-1",
        tmp_path / "worker-2",
    ]
    await second.append([draft(0), draft(1)])
    assert first.empty
    assert third.empty
    second.close()
    heir = Spool(tmp_path)
    await heir.open()
    assert heir.directory == tmp_path / "worker-1"
    drafts, _ = await heir.read(10)
    assert [d.request_id for d in drafts] == ["req-00000", "req-00001"]
    for spool in (first, third, heir):
        spool.close()


async def test_a_directory_no_process_holds_is_adopted_with_what_it_had_not_replayed(tmp_path: Path) -> None:
    """`--workers` lowered: the directories of workers not started again are taken over by the next process
    that opens a spool; one a live process holds is left to it."""
    spools = [Spool(tmp_path) for _ in range(4)]
    for spool in spools:
        await spool.open()
    base, one, two, three = spools
    await base.append([draft(0)])
    await one.append([draft(1), draft(2), draft(3)])
    await one.commit((await one.read(1))[1])  # draft 1 was replayed before the worker stopped
    await two.append([draft(4)])
    await three.append([draft(5)])
    for spool in (base, one, two):
        spool.close()  # `three` stays: its process is alive
    heir = Spool(tmp_path)
    await heir.open()
    assert heir.directory == tmp_path
    replayed: list[str] = []
    while not heir.empty:
        drafts, cursor = await heir.read(10)
        replayed += [d.request_id for d in drafts]
        await heir.commit(cursor)
    assert replayed == ["req-00000", "req-00002", "req-00003", "req-00004"]  # each directory in its order
    assert not list((tmp_path / "worker-1").glob("spool-*"))
    assert not list((tmp_path / "worker-2").glob("spool-*"))
    assert len(list((tmp_path / "worker-3").glob("spool-*"))) == 1  # held: not adopted
    freed = Spool(tmp_path)
    await freed.open()  # the adopted directories are free and empty again
    assert freed.directory == tmp_path / "worker-1"
    assert freed.empty
    for spool in (three, heir, freed):
        spool.close()


async def test_spool_and_database_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    # Spooled drafts and the SQLite database hold what the trail holds (prompts, where retained).
    old = os.umask(0o022)
    try:
        (tmp_path / "data").mkdir()
        sqlite = await SqliteAuditStore.open(tmp_path / "data" / "audit.db")
        await sqlite.close()
        store = FakeStore()
        store.down = True  # the drafts go to the spool
        writer = make(store, tmp_path / "spool" / "audit", batch_size=10)
        await writer.start()
        for i in range(5):
            writer.submit(draft(i))
        await until(lambda: writer.counters["spooled"] == 5)
        spool_files = [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]
        spool_dirs = [p for p in (tmp_path / "spool").rglob("*") if p.is_dir()]
        modes = {oct(p.stat().st_mode & 0o777) for p in spool_files}
        store.down = False
        await writer.close()
    finally:
        os.umask(old)
    assert spool_files
    assert modes == {"0o600"}
    assert {oct(d.stat().st_mode & 0o777) for d in [tmp_path / "spool", *spool_dirs]} == {"0o700"}
    assert oct((tmp_path / "data" / "audit.db").stat().st_mode & 0o777) == "0o600"
