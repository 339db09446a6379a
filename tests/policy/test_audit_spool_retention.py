"""Retention reaches the audit writer's spool: spooled content is sealed under per-(tenant, hour) keys that
the retention pass deletes, so drafts waiting for the store outlive their content, never the other way
round; and a tampered key file or line never opens to another draft's content."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from policy.audit import AuditDraft, AuditQuery, AuditRecord, AuditUnavailableError, SqliteAuditStore
from policy.audit.keys import MacKey
from policy.audit.records import content_sha256
from policy.audit.retention import DAY_S, purge_expired
from policy.audit.spool import QUARANTINE, Spool
from policy.audit.spool_keys import KEYS_FILE, UNREADABLE_NOTE
from policy.audit.writer import AuditWriter
from policy.tenants import SqliteTenantStore, Tenant
from tests.backends import FakeClock

NOW = 1_800_000_000.0
KEY = MacKey(b"spool-retention-test-key-0123456789")


def draft(tenant: str, n: int, age_days: float, content: str | None = None) -> AuditDraft:
    """A decision of `tenant` with its content (unless given, "secret prompt <n> of <tenant>")."""
    text = content if content is not None else f"secret prompt {n} of {tenant}"
    return AuditDraft(
        tenant=tenant,
        key_id=f"k-{tenant}",
        request_id=f"req-{tenant}-{n}",
        at=NOW - age_days * DAY_S,
        stage="input",
        decision="block" if n % 2 else "allow",
        source="model",
        content_hash=content_sha256(text),
        content=text,
        draft_id=f"d-{tenant}-{n}",
    )


def on_disk(directory: Path) -> bytes:
    """Every byte of every file under `directory`."""
    return b"".join(p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file())


async def read_all(spool: Spool) -> list[AuditDraft]:
    """Replay the whole spool (reading and committing), as the writer does."""
    out: list[AuditDraft] = []
    while not spool.empty:
        drafts, cursor = await spool.read(100)
        out += drafts
        await spool.commit(cursor)
    return out


class DownStore(SqliteAuditStore):
    """The SQLite store, refusing appends while `down`."""

    down = False

    async def append(self, drafts: Sequence[AuditDraft]) -> list[AuditRecord]:
        if self.down:
            raise AuditUnavailableError("down (test)")
        return await super().append(drafts)


@pytest.fixture
async def tenants(tmp_path: Path) -> AsyncIterator[SqliteTenantStore]:
    """`keeper` retains prompts for the default 30 days, `brief` for 7, `private` not at all."""
    store = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    for tenant_id, retain, days in (("keeper", True, None), ("brief", True, 7.0), ("private", False, None)):
        tenant = Tenant(
            tenant_id=tenant_id, display_name=tenant_id, retain_prompts=retain, content_retention_days=days
        )
        await store.create_tenant(tenant, actor="test", now=0.0)
    yield store
    await store.close()


async def fast_sleep(_: float) -> None:
    await asyncio.sleep(0)


async def until(cond: Callable[[], bool], within: float = 60.0) -> None:
    """Let the writer (and its spool threads) run until `cond` holds; fails rather than hang."""
    async with asyncio.timeout(within):
        while not cond():  # noqa: ASYNC110 - polling state the spool threads change
            await asyncio.sleep(0.001)


async def test_the_purge_pass_shreds_spooled_content_by_each_tenants_retention(
    tmp_path: Path, tenants: SqliteTenantStore
) -> None:
    """The store is down, drafts wait in the spool; a purge pass runs: the brief tenant's old content and
    all of the private tenant's become unreadable on disk at once, and replay records their decisions
    without it, while the keeper's (within retention) replays whole."""
    store = await DownStore.open(tmp_path / "audit.sqlite3")
    assert isinstance(store, DownStore)
    store.down = True
    writer = AuditWriter(store, tmp_path / "spool", clock=FakeClock(NOW), sleep=fast_sleep, mac_key=KEY)
    await writer.start()
    drafts = [
        draft("brief", 0, 10.0),
        draft("brief", 1, 1.0),
        draft("keeper", 2, 10.0),
        draft("private", 3, 0),
    ]
    for d in drafts:
        await writer.record(d)  # durable: fsync'd in the spool
    assert writer.counters["spooled"] == 4
    before = on_disk(tmp_path / "spool")
    assert not any(d.content.encode() in before for d in drafts if d.content)  # never in clear
    keys_before = msgspec.json.decode((tmp_path / "spool" / KEYS_FILE).read_bytes())["keys"]
    assert len(keys_before) == 4  # one per tenant and hour

    purged = await purge_expired(store, tenants, NOW, days=30, spool=writer)
    assert purged == {"brief": 0, "keeper": 0, "private": 0}  # nothing in the database yet
    assert writer.counters["spool_keys_shredded"] == 2  # brief's 10-day-old hour, private's hour
    after = on_disk(tmp_path / "spool")
    old_hour = (NOW - 10 * DAY_S) // 3600
    gone = [
        k
        for k in keys_before
        if (k["tenant"], k["bucket"]) in (("private", NOW // 3600), ("brief", old_hour))
    ]
    assert len(gone) == 2
    for key in gone:
        assert key["key"].encode() not in after  # the data key itself is gone from the directory

    store.down = False
    await until(lambda: writer.counters["replayed"] == 4)
    await writer.close()
    content = {
        r.request_id: (r.content, r.content_hash, r.decision)
        for t in ("brief", "keeper", "private")
        for r in await store.query(AuditQuery(tenant=t, limit=10))
    }
    assert content == {
        "req-brief-0": (None, drafts[0].content_hash, "allow"),
        "req-brief-1": (drafts[1].content, drafts[1].content_hash, "block"),
        "req-keeper-2": (drafts[2].content, drafts[2].content_hash, "allow"),
        "req-private-3": (None, drafts[3].content_hash, "block"),
    }
    assert writer.counters["spool_content_unreadable"] == 0
    for record in await store.query(AuditQuery(tenant="brief", limit=10)):
        assert record.detail == ""  # a shredded content reads as a purged one
    assert (await store.verify("brief")).ok
    assert not (tmp_path / "spool" / KEYS_FILE).exists()  # replayed: no key left behind
    await store.close()


async def test_content_past_retention_is_not_sealed_again_after_a_purge(tmp_path: Path) -> None:
    """A late draft of an hour already shredded (an adopted directory's, a skewed clock) is spooled
    without content: no new key brings back what retention ended."""
    spool = Spool(tmp_path, mac_key=KEY)
    await spool.open()
    await spool.shred({"brief": NOW - 7 * DAY_S})
    await spool.append([draft("brief", 0, 8.0), draft("brief", 1, 6.0)])
    assert b"secret prompt 0" not in on_disk(tmp_path)
    assert [d.content for d in await read_all(spool)] == [None, "secret prompt 1 of brief"]
    spool.close()


async def test_sealed_content_survives_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path, mac_key=KEY)
    await spool.open()
    odd = "NUL \x00 and a lone surrogate \ud800 stay exact"
    await spool.append([draft("keeper", 0, 1.0), draft("keeper", 1, 1.0, content=odd)])
    spool.close()  # the process died; its key file stays
    reopened = Spool(tmp_path, mac_key=KEY)
    await reopened.open()
    assert [d.content for d in await read_all(reopened)] == ["secret prompt 0 of keeper", odd]
    reopened.close()


async def test_a_crash_mid_key_write_leaves_the_last_whole_key_file(tmp_path: Path) -> None:
    spool = Spool(tmp_path, mac_key=KEY)
    await spool.open()
    await spool.append([draft("keeper", 0, 1.0)])
    spool.close()
    (tmp_path / f"{KEYS_FILE}.tmp").write_bytes(b'{"keys": [{"kid": "torn')  # died before the rename
    reopened = Spool(tmp_path, mac_key=KEY)
    await reopened.open()
    await reopened.append([draft("keeper", 1, 2.0)])  # another hour: a new key, written over the tmp
    assert [d.content for d in await read_all(reopened)] == [
        "secret prompt 0 of keeper",
        "secret prompt 1 of keeper",
    ]
    assert reopened.counters["spool_keys_unreadable"] == 0
    reopened.close()


async def test_keys_go_with_the_last_spool_file_that_uses_them(tmp_path: Path) -> None:
    """The key file stays bounded: a key is deleted once no spool file left has a line under it."""
    spool = Spool(tmp_path, file_max_bytes=1, mac_key=KEY)  # one file per append
    await spool.open()
    await spool.append([draft("keeper", 0, 2.0)])
    await spool.append([draft("keeper", 1, 1.0)])
    await spool.append([draft("keeper", 2, 1.0)])  # the same hour as draft 1, a later file

    def kids() -> int:
        return len(msgspec.json.decode((tmp_path / KEYS_FILE).read_bytes())["keys"])

    assert kids() == 2
    drafts, cursor = await spool.read(10)
    await spool.commit(cursor)
    assert [d.content for d in drafts] == ["secret prompt 0 of keeper"]
    assert spool.files == 2
    assert kids() == 1
    await read_all(spool)
    assert not (tmp_path / KEYS_FILE).exists()
    spool.close()


async def test_an_adopted_directory_brings_its_content_and_leaves_no_key(tmp_path: Path) -> None:
    first, second = Spool(tmp_path, mac_key=KEY), Spool(tmp_path, mac_key=KEY)
    await first.open()
    await second.open()
    await second.append([draft("keeper", 0, 1.0), draft("brief", 1, 1.0)])
    second.close()  # its worker was not started again
    first.close()
    heir = Spool(tmp_path, mac_key=KEY)
    await heir.open()
    assert heir.directory == tmp_path
    assert [d.content for d in await read_all(heir)] == [
        "secret prompt 0 of keeper",
        "secret prompt 1 of brief",
    ]
    assert not (tmp_path / "worker-1" / KEYS_FILE).exists()
    assert b"secret prompt" not in on_disk(tmp_path)
    heir.close()


async def test_a_purge_reaches_a_directory_no_process_holds(tmp_path: Path) -> None:
    """A dead worker's directory waits for adoption; its content expires meanwhile all the same."""
    alive, dead = Spool(tmp_path, mac_key=KEY), Spool(tmp_path, mac_key=KEY)
    await alive.open()
    await dead.open()
    await dead.append([draft("brief", 0, 10.0), draft("keeper", 1, 10.0)])
    dead.close()
    assert await alive.shred({"brief": NOW - 7 * DAY_S, "keeper": NOW - 30 * DAY_S}) == 1
    alive.close()
    heir = Spool(tmp_path, mac_key=KEY)
    await heir.open()
    replayed = await read_all(heir)
    assert [(d.request_id, d.content) for d in replayed] == [
        ("req-brief-0", None),
        ("req-keeper-1", "secret prompt 1 of keeper"),
    ]
    assert replayed[0].content_hash == draft("brief", 0, 10.0).content_hash
    heir.close()


def lines(directory: Path) -> list[dict[str, Any]]:
    [path] = directory.glob("spool-*.jsonl")
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines()]


def rewrite(directory: Path, rows: list[dict[str, Any]]) -> None:
    [path] = directory.glob("spool-*.jsonl")
    path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in rows))


async def test_a_line_pointed_at_another_tenants_key_opens_to_nothing(tmp_path: Path) -> None:
    """Someone who can write the spool (no MAC key configured, else the MAC stops them first) points a
    line of acme at globex's key, or relabels it as globex's: it never opens, to either's content."""
    spool = Spool(tmp_path)
    await spool.open()
    await spool.append([draft("acme", 0, 1.0), draft("globex", 1, 1.0), draft("acme", 2, 1.0)])
    spool.close()
    acme, globex, acme2 = lines(tmp_path)
    acme_data = acme["sealed"]["data"]
    acme["sealed"] = {**acme["sealed"], "kid": globex["sealed"]["kid"]}  # acme's line, globex's key
    # acme's line relabelled as globex's, with globex's key and nonce
    acme2 = {**acme2, "tenant": "globex", "sealed": {**globex["sealed"], "data": acme2["sealed"]["data"]}}
    globex["sealed"] = {**globex["sealed"], "data": acme_data}  # acme's ciphertext in globex's line
    rewrite(tmp_path, [acme, globex, acme2])
    reopened = Spool(tmp_path)
    await reopened.open()
    replayed = await read_all(reopened)
    assert [d.content for d in replayed] == [None, None, None]
    assert all(UNREADABLE_NOTE in d.detail for d in replayed)
    assert reopened.counters["spool_content_unreadable"] == 3
    reopened.close()


async def test_a_tampered_key_file_never_opens_a_line_to_other_content(tmp_path: Path) -> None:
    spool = Spool(tmp_path, mac_key=KEY)
    await spool.open()
    await spool.append([draft("acme", 0, 1.0), draft("globex", 1, 1.0)])
    spool.close()
    keys = msgspec.json.decode((tmp_path / KEYS_FILE).read_bytes())
    acme_key, globex_key = sorted(keys["keys"], key=lambda k: k["tenant"])
    acme_key["key"], globex_key["key"] = globex_key["key"], acme_key["key"]  # swapped
    (tmp_path / KEYS_FILE).write_bytes(msgspec.json.encode(keys))
    reopened = Spool(tmp_path, mac_key=KEY)
    await reopened.open()
    replayed = await read_all(reopened)
    assert [(d.request_id, d.content) for d in replayed] == [("req-acme-0", None), ("req-globex-1", None)]
    assert reopened.counters["spool_content_unreadable"] == 2
    assert reopened.counters["spool_quarantined"] == 0  # the decisions are authentic: recorded
    reopened.close()


async def test_a_corrupt_key_file_loses_content_not_decisions(tmp_path: Path) -> None:
    spool = Spool(tmp_path, mac_key=KEY)
    await spool.open()
    await spool.append([draft("acme", 0, 1.0)])
    spool.close()
    (tmp_path / KEYS_FILE).write_bytes(b"{not json")
    reopened = Spool(tmp_path, mac_key=KEY)
    await reopened.open()
    assert reopened.counters["spool_keys_unreadable"] == 1
    assert [(d.request_id, d.content) for d in await read_all(reopened)] == [("req-acme-0", None)]
    reopened.close()


async def test_a_quarantined_line_keeps_its_content_sealed(tmp_path: Path) -> None:
    spool = Spool(tmp_path, mac_key=KEY)
    await spool.open()
    await spool.append([draft("acme", 0, 1.0)])
    spool.close()
    [path] = await asyncio.to_thread(lambda: list(tmp_path.glob("spool-*.jsonl")))
    path.write_bytes(b"0" * 64 + path.read_bytes()[64:])  # its MAC broken
    reopened = Spool(tmp_path, mac_key=KEY)
    await reopened.open()
    assert await read_all(reopened) == []
    assert reopened.counters["spool_quarantined"] == 1
    quarantined = (tmp_path / QUARANTINE).read_bytes()
    assert b"sealed" in quarantined
    assert b"secret prompt" not in quarantined
    assert not (tmp_path / KEYS_FILE).exists()  # and its key went with the spool file
    reopened.close()


async def test_ciphertexts_swapped_between_lines_of_one_key_do_not_open(tmp_path: Path) -> None:
    """Two drafts of one tenant and hour share a key: the associated data binds each ciphertext to its own
    draft, so swapping them never shows one request's prompt in another's record."""
    spool = Spool(tmp_path)
    await spool.open()
    await spool.append([draft("acme", 0, 1.0), draft("acme", 1, 1.0)])
    spool.close()
    first, second = lines(tmp_path)
    assert first["sealed"]["kid"] == second["sealed"]["kid"]
    first["sealed"], second["sealed"] = second["sealed"], first["sealed"]
    rewrite(tmp_path, [first, second])
    reopened = Spool(tmp_path)
    await reopened.open()
    assert [d.content for d in await read_all(reopened)] == [None, None]
    assert reopened.counters["spool_content_unreadable"] == 2
    reopened.close()


async def test_a_spool_that_cannot_be_shredded_does_not_stop_the_database_purge(
    tmp_path: Path, tenants: SqliteTenantStore
) -> None:
    class BrokenDisk:
        calls = 0

        async def shred_content(self, cutoffs: Mapping[str, float]) -> int:
            self.calls += 1
            raise OSError("disk gone (test)")

    store = await SqliteAuditStore.open(tmp_path / "audit.sqlite3")
    await store.append([draft("private", 0, 0.0)])
    disk = BrokenDisk()
    assert await purge_expired(store, tenants, NOW, days=30, spool=disk) == {
        "brief": 0,
        "keeper": 0,
        "private": 1,
    }
    assert disk.calls == 1
    await store.close()
