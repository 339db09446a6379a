"""A chain a database writer cannot rewrite: MACs under a key outside the database, signed checkpoints
outside it, paged and incremental verification, authenticated spool lines. Stores run on SQLite and on a
real PostgreSQL; each test plays the attacker with raw SQL, triggers disabled."""

from __future__ import annotations

import asyncio
import itertools
import os
import sqlite3
import stat
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway import cli
from policy.audit import AuditRecord, AuditStore, PostgresAuditStore, SqliteAuditStore, record_hash
from policy.audit.checkpoints import Checkpointer, CheckpointError, read_checkpoints, sign
from policy.audit.keys import AuditKeyError, MacKey, load_mac_key, load_public_key, load_signing_key
from policy.audit.records import Checkpoint
from policy.audit.spool import QUARANTINE, Spool
from policy.audit.verify import verify_tenant, verify_tenants
from policy.audit.writer import AuditWriter
from tests.backends import PG_DSN, FakeClock, SqlBackend, sql_backend
from tests.policy.test_audit_store import APPEND_ONLY, KEY, bypass_triggers, draft

Backend = SqlBackend[AuditStore]


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """A SQLite file, or a fresh PostgreSQL schema; stores MAC with KEY. No PostgreSQL = failure."""

    async def sqlite(path: Path) -> AuditStore:
        return await SqliteAuditStore.open(path, KEY)

    async def postgres(schema: str) -> AuditStore:
        return await PostgresAuditStore.open(PG_DSN, schema=schema, mac_key=KEY)

    async with sql_backend(request.param, tmp_path, sqlite, postgres) as opened:
        yield opened


@pytest.fixture
async def store(backend: Backend) -> AuditStore:
    return await backend.open()


@pytest.fixture
def signer() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def checkpointer(store: AuditStore, signer: Ed25519PrivateKey, tmp_path: Path) -> Checkpointer:
    return Checkpointer(store, KEY, signer, tmp_path / "checkpoints.jsonl", FakeClock())


async def bypass_everything(backend: Backend) -> None:
    """Raw SQL may change and delete records and set heads back (a writer with database access)."""
    await bypass_triggers(backend)
    if backend.name == "sqlite":
        await backend.raw("DROP TRIGGER audit_heads_forward")
    else:
        await backend.raw("ALTER TABLE {schema}.audit_heads DISABLE TRIGGER USER")


async def rewrite(backend: Backend, records: list[AuditRecord], seq: int, *, strip_macs: bool) -> None:
    """Change the decision of record `seq` and recompute the plain hashes (and head) from it on, as an
    attacker without the key can: the old MACs stay (or all are nulled)."""
    prev = records[seq - 2].hash if seq > 1 else ""
    for record in records[seq - 1 :]:
        changed = msgspec.structs.replace(record, prev_hash=prev)
        if record.seq == seq:
            changed = msgspec.structs.replace(changed, decision="block")
        digest = record_hash(changed, changed.seq, prev)
        await backend.raw(
            f"UPDATE {{schema}}.audit_records SET decision = '{changed.decision}', prev_hash = '{prev}',"
            f" hash = '{digest}' WHERE tenant = 'acme' AND seq = {record.seq}"
        )
        prev = digest
    await backend.raw(f"UPDATE {{schema}}.audit_heads SET hash = '{prev}' WHERE tenant = 'acme'")
    if strip_macs:
        await backend.raw("UPDATE {schema}.audit_records SET mac = NULL WHERE tenant = 'acme'")


async def chain_of(store: AuditStore, tenant: str = "acme") -> list[AuditRecord]:
    heads = await store.heads(tenant)
    return [await store.get(tenant, seq) for seq in range(1, heads[tenant][0] + 1)]


async def test_rewriting_a_record_and_recomputing_the_hashes_fails_on_the_mac(
    backend: Backend, store: AuditStore, signer: Ed25519PrivateKey, tmp_path: Path
) -> None:
    await store.append([draft(n=i) for i in range(6)])
    assert (await store.verify("acme")).ok
    records = await chain_of(store)
    assert all(r.mac == KEY.chain_mac(r.hash) for r in records)
    # The triggers cover the new column: a MAC is never changed through SQL while they stand.
    with pytest.raises(APPEND_ONLY, match="append-only"):
        await backend.raw("UPDATE {schema}.audit_records SET mac = NULL WHERE seq = 3")
    await bypass_everything(backend)
    await rewrite(backend, records, 3, strip_macs=False)
    # The plain chain is consistent again: hashes, links and head. Only the MAC shows it.
    report = await store.verify("acme")
    assert (report.ok, report.first_bad_seq, report.reason, report.last_seq) == (False, 3, "mac", 2)
    # Nor is the forged head ever signed.
    writer = checkpointer(store, signer, tmp_path)
    assert await writer.once() == []
    assert writer.counters["refused"] == 1
    assert not (tmp_path / "checkpoints.jsonl").exists()


async def test_stripping_every_mac_verifies_only_as_unkeyed_and_fails_against_the_checkpoint(
    backend: Backend, store: AuditStore, signer: Ed25519PrivateKey, tmp_path: Path
) -> None:
    await store.append([draft(n=i) for i in range(6)])
    [cp] = await checkpointer(store, signer, tmp_path).once()
    assert (cp.tenant, cp.seq, cp.mac) == ("acme", 6, KEY.chain_mac(cp.hash))
    records = await chain_of(store)
    await bypass_everything(backend)
    await rewrite(backend, records, 3, strip_macs=True)
    report = await store.verify("acme")
    assert (report.ok, report.unkeyed) == (True, 6)  # reported as unkeyed, as records from before keys
    report = await verify_tenant(store, "acme", key=KEY, checkpoints=[cp])
    assert (report.ok, report.first_bad_seq, report.reason) == (False, 6, "checkpoint")
    # A checkpointer (a restart: it reads its file) never signs a head that differs from its checkpoint.
    again = checkpointer(store, signer, tmp_path)
    assert await again.once() == []
    assert again.counters["refused"] == 1


async def test_cutting_the_tail_and_setting_the_head_back_fails_against_the_checkpoint(
    backend: Backend, store: AuditStore, signer: Ed25519PrivateKey, tmp_path: Path
) -> None:
    await store.append([draft(n=i) for i in range(5)])
    [cp] = await checkpointer(store, signer, tmp_path).once()
    records = await chain_of(store)
    await bypass_everything(backend)
    await backend.raw("DELETE FROM {schema}.audit_records WHERE tenant = 'acme' AND seq >= 4")
    await backend.raw(
        f"UPDATE {{schema}}.audit_heads SET seq = 3, hash = '{records[2].hash}' WHERE tenant = 'acme'"
    )
    assert (await store.verify("acme")).ok  # consistent in itself: only the checkpoint knows better
    report = await verify_tenant(store, "acme", key=KEY, checkpoints=[cp])
    assert (report.ok, report.first_bad_seq, report.reason, report.last_seq) == (False, 4, "checkpoint", 3)
    assert report.checked == 3


async def test_incremental_verify_starts_from_the_last_verified_checkpoint(
    backend: Backend, store: AuditStore, signer: Ed25519PrivateKey, tmp_path: Path
) -> None:
    writer = checkpointer(store, signer, tmp_path)
    await store.append([draft(n=i) for i in range(5)])
    [cp5] = await writer.once()
    await store.append([draft(n=i) for i in range(5, 8)])
    state: dict[str, Checkpoint] = {}
    checkpoints = {"acme": [cp5]}

    async def run(from_checkpoint: bool) -> tuple[bool, int, str | None]:
        reports = await verify_tenants(
            store, ["acme"], key=KEY, checkpoints=checkpoints, state=state, from_checkpoint=from_checkpoint
        )
        return reports["acme"].ok, reports["acme"].checked, reports["acme"].reason

    assert await run(False) == (True, 8, None)
    assert state == {"acme": cp5}
    assert await run(True) == (True, 3, None)  # only seq 6..8 read
    # A record before the checkpoint changed without recomputing: a full run finds it, an incremental not.
    await bypass_everything(backend)
    await backend.raw("UPDATE {schema}.audit_records SET detail = 'x' WHERE tenant = 'acme' AND seq = 2")
    assert await run(False) == (False, 2, "hash")
    assert await run(True) == (True, 3, None)
    # Recomputing the hashes from before the checkpoint on changes the checkpoint's record: found.
    await rewrite(backend, await chain_of(store), 4, strip_macs=False)
    ok, checked, reason = await run(True)
    assert (ok, checked, reason) == (False, 1, "checkpoint")  # only the checkpoint's record read
    assert state == {"acme": cp5}  # a failed run never moves the state on


async def test_verify_pages_through_long_chains(store: AuditStore) -> None:
    await store.append([draft(n=i) for i in range(25)])
    report = await verify_tenant(store, "acme", key=KEY, page=4)
    assert (report.ok, report.checked, report.last_seq) == (True, 25, 25)
    # A verifier with another key finds the first record.
    report = await verify_tenant(store, "acme", key=MacKey(b"o" * 32), page=4)
    assert (report.ok, report.first_bad_seq, report.reason) == (False, 1, "mac")


async def test_records_from_before_keys_verify_as_unkeyed_only_before_the_first_keyed(
    backend: Backend, store: AuditStore
) -> None:
    """A store opened without a key (before the upgrade), then with one: the old records verify as
    unkeyed; a record without a MAC after a keyed one does not."""
    unkeyed: AuditStore
    if backend.name == "sqlite":
        unkeyed = await SqliteAuditStore.open(backend.location)
    else:
        unkeyed = await PostgresAuditStore.open(PG_DSN, schema=backend.location)
    try:
        await unkeyed.append([draft(n=i) for i in range(3)])
        await store.append([draft(n=i) for i in range(3, 5)])
        report = await store.verify("acme")
        assert (report.ok, report.checked, report.unkeyed) == (True, 5, 3)
        await unkeyed.append([draft(n=9)])
        report = await store.verify("acme")
        assert (report.ok, report.first_bad_seq, report.reason) == (False, 6, "mac")
    finally:
        await unkeyed.close()


def test_checkpoint_lines_are_signed(signer: Ed25519PrivateKey, tmp_path: Path) -> None:
    path = tmp_path / "checkpoints.jsonl"
    cp = Checkpoint(tenant="acme", seq=5, hash="h" * 64, mac="m" * 64, at=1.0)
    path.write_bytes(msgspec.json.encode(sign(cp, signer)) + b"\n" + b'{"torn')
    assert read_checkpoints(path, signer.public_key()) == {"acme": [cp]}
    forged = msgspec.structs.replace(sign(cp, signer), seq=9)
    other = sign(cp, Ed25519PrivateKey.generate())
    for bad in (forged, other):
        path.write_bytes(msgspec.json.encode(bad) + b"\n")
        with pytest.raises(CheckpointError, match="line 1"):
            read_checkpoints(path, signer.public_key())


def test_key_files_are_created_private_once_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "audit-mac.key"
    first = load_mac_key("", path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_mac_key("", path).chain_mac("h") == first.chain_mac("h")
    assert load_mac_key("i" * 32, path).chain_mac("h") == MacKey(b"i" * 32).chain_mac("h")
    with pytest.raises(AuditKeyError):
        load_mac_key("short", path)
    with pytest.raises(FileNotFoundError):
        load_mac_key("", tmp_path / "absent.key", create=False)
    signing = tmp_path / "audit-signing.key"
    key = load_signing_key(signing)
    assert stat.S_IMODE(os.stat(signing).st_mode) == 0o600
    public = load_public_key(tmp_path / "audit-signing.key.pub")
    public.verify(key.sign(b"x"), b"x")
    assert load_signing_key(signing).sign(b"x") == key.sign(b"x")  # Ed25519 is deterministic: same key


async def test_a_forged_or_corrupt_spool_line_is_quarantined_and_counted(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", mac_key=KEY)
    await spool.open()
    await spool.append([draft(n=0), draft(n=1)])
    spool.close()
    [path] = (tmp_path / "spool").glob("spool-*.jsonl")
    body = msgspec.json.encode(draft(n=2, decision="allow", detail="slipped in"))
    with path.open("ab") as f:
        f.write(b"0" * 64 + b" " + body + b"\n")  # a made-up MAC
        f.write(body + b"\n")  # no MAC at all
        f.write(MacKey(b"o" * 32).line_mac(body).encode() + b" " + body + b"\n")  # another key's
        f.write(KEY.line_mac(body).encode() + b" {not json\n")  # MAC of other bytes, garbage
    reopened = Spool(tmp_path / "spool", mac_key=KEY)
    await reopened.open()
    drafts, _ = await reopened.read(100)
    assert [d.request_id for d in drafts] == ["req-acme-0", "req-acme-1"]
    assert reopened.counters["spool_quarantined"] == 4
    lines = (tmp_path / "spool" / QUARANTINE).read_bytes().splitlines()
    assert len(lines) == 4
    reasons = [msgspec.json.decode(line)["reason"] for line in lines]
    assert reasons == [
        "the MAC does not verify",
        "no MAC",
        "the MAC does not verify",
        "the MAC does not verify",
    ]
    # Read again (the batch's append failed): not quarantined twice.
    await reopened.read(100)
    assert reopened.counters["spool_quarantined"] == 4
    reopened.close()


async def test_lockgate_audit_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "state" / "lockgate.sqlite3"
    monkeypatch.setenv("LOCKGATE_STORAGE__SQLITE_PATH", str(db))
    monkeypatch.setenv("LOCKGATE_STORAGE__BACKEND", "sqlite")
    db.parent.mkdir()
    key = load_mac_key("", db.parent / "audit-mac.key")
    signer = load_signing_key(db.parent / "audit-signing.key")
    store = await SqliteAuditStore.open(db, key)
    try:
        await store.append([draft(n=i) for i in range(4)] + [draft("beta", 0)])
        await Checkpointer(store, key, signer, db.parent / "audit-checkpoints.jsonl", FakeClock()).once()
        await store.append([draft(n=9)])
    finally:
        await store.close()

    async def verify(*args: str) -> tuple[int, dict[str, dict[str, object]]]:
        capsys.readouterr()
        code = await asyncio.to_thread(cli.main, ["audit", "verify", *args])
        lines = [msgspec.json.decode(line) for line in capsys.readouterr().out.splitlines()]
        return code, {line["tenant"]: line["report"] for line in lines}

    code, reports = await verify()
    assert code == 0
    assert {t: (r["ok"], r["checked"]) for t, r in reports.items()} == {"acme": (True, 5), "beta": (True, 1)}
    code, reports = await verify("--tenant", "acme", "--from-checkpoint")
    assert (code, reports["acme"]["checked"]) == (0, 1)  # from the checkpoint at seq 4
    # The database changed behind the gateway's back: exit 1.
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TRIGGER audit_records_only_purge")
        conn.execute("UPDATE audit_records SET mac = NULL WHERE seq = 5 AND tenant = 'acme'")
    code, reports = await verify("--tenant", "acme")
    assert (code, reports["acme"]["reason"]) == (1, "mac")


async def test_sqlite_verify_reads_off_the_writer_thread(tmp_path: Path) -> None:
    """A verify never waits for the worker that appends go through (it holds a write transaction here)."""
    store = await SqliteAuditStore.open(tmp_path / "audit.sqlite3", KEY)
    try:
        await store.append([draft(n=i) for i in range(5)])
        release = threading.Event()

        def hold(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            release.wait(30)
            conn.execute("ROLLBACK")

        held = asyncio.ensure_future(store._db.run(hold))
        try:
            report = await asyncio.wait_for(store.verify("acme"), 10)
            assert (report.ok, report.checked) == (True, 5)
            assert not held.done()  # the worker was busy all along
        finally:
            release.set()
            await held
    finally:
        await store.close()


async def test_the_writer_replays_only_authentic_spool_lines_and_counts_the_rest(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", mac_key=KEY)
    await spool.open()
    await spool.append([draft(n=0)])
    spool.close()
    [path] = (tmp_path / "spool").glob("spool-*.jsonl")
    with path.open("ab") as f:  # someone with access to the spool directory, but not to the key
        f.write(msgspec.json.encode(draft(n=1, detail="forged")) + b"\n")
    store = await SqliteAuditStore.open(tmp_path / "audit.sqlite3", KEY)
    writer = AuditWriter(store, tmp_path / "spool", clock=FakeClock(), mac_key=KEY)
    try:
        await writer.start()
        writer.submit(draft(n=2))
        async with asyncio.timeout(60):  # replay runs in the writer's task; bounded by time, not turns
            for _ in itertools.count():
                if (await store.heads()).get("acme", (0, ""))[0] >= 2:
                    break
                await asyncio.sleep(0.01)
        await writer.close()
        assert [r.request_id for r in await chain_of(store)] == ["req-acme-0", "req-acme-2"]
        assert writer.counters["spool_quarantined"] == 1
        assert (await store.verify("acme")).ok
        quarantined = msgspec.json.decode((tmp_path / "spool" / QUARANTINE).read_bytes())
        assert (quarantined["reason"], "forged" in quarantined["line"]) == ("no MAC", True)
    finally:
        await store.close()


async def test_the_checkpointer_signs_each_moved_head_every_interval(
    store: AuditStore, signer: Ed25519PrivateKey, tmp_path: Path
) -> None:
    await store.append([draft(n=0), draft("beta", 0)])
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            await store.append([draft(n=1)])
        if len(slept) == 5:
            raise asyncio.CancelledError

    writer = checkpointer(store, signer, tmp_path)
    with pytest.raises(asyncio.CancelledError):
        await writer.run(60.0, sleep)
    assert slept == [60.0] * 5
    written = read_checkpoints(tmp_path / "checkpoints.jsonl", signer.public_key())
    # Passes where no head moved write nothing.
    assert {t: [cp.seq for cp in cps] for t, cps in written.items()} == {"acme": [1, 2], "beta": [1]}
    assert stat.S_IMODE(os.stat(tmp_path / "checkpoints.jsonl").st_mode) == 0o600
