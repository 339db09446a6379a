"""The `AuditStore` contract, run on SQLite (a file) and on a real PostgreSQL; and the hash chain itself."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policy.audit
from policy.audit import (
    GENESIS_HASH,
    MAX_QUERY_LIMIT,
    AuditDraft,
    AuditedStage,
    AuditQuery,
    AuditRecord,
    AuditStore,
    AuditStoreError,
    AuditUnavailableError,
    ChainReport,
    InvalidDraftError,
    NotFoundError,
    PostgresAuditStore,
    SqliteAuditStore,
    content_sha256,
    record_hash,
    verify_chain,
)
from policy.audit.keys import MacKey
from policy.audit.migrations import MIGRATIONS, RECORD_FIELDS, record_row
from policy.audit.records import canonical_json, chain, normalize
from policy.audit.writer import AuditWriter
from policy.tenants import PostgresTenantStore, SqliteTenantStore, Tenant
from tests.audit_versions import write_at_migration
from tests.backends import PG_DSN, SqlBackend, postgres_schema, sql_backend

Backend = SqlBackend[AuditStore]
# The MAC key every store of the contract suite is opened with (the gateway always has one).
KEY = MacKey(b"k" * 32)
APPEND_ONLY = (sqlite3.DatabaseError, asyncpg.PostgresError)

RUNS = (
    AuditedStage(stage="rules", kind="rules", latency_s=0.0001),
    AuditedStage(
        stage="guard@3",
        kind="model",
        model="qwen-guard@1",
        template_hash="t" * 64,
        score=0.8125,
        allow_below=0.2,
        block_above=0.7,
        latency_s=0.031,
    ),
)


def draft(tenant: str = "acme", n: int = 0, **changes: Any) -> AuditDraft:
    """A distinct input decision of `tenant` at time 1000 + n."""
    content = f"prompt {n} of {tenant}"
    fields: dict[str, Any] = {
        "tenant": tenant,
        "key_id": f"k-{tenant}",
        "request_id": f"req-{tenant}-{n}",
        "at": 1000.0 + n,
        "stage": "input",
        "decision": "allow",
        "source": "model",
        "policy": "strict@2",
        "policy_hash": "p" * 64,
        "stages": RUNS,
        "content_hash": content_sha256(content),
        "content": content,
    }
    fields.update(changes)
    return AuditDraft(**fields)


def chained(drafts: list[AuditDraft], key: MacKey | None = KEY) -> list[AuditRecord]:
    """`drafts` of one tenant chained as a store with `key` would."""
    records: list[AuditRecord] = []
    for d in drafts:
        records.append(chain(d, len(records) + 1, records[-1].hash if records else GENESIS_HASH, key))
    return records


# --- the chain, without a database -------------------------------------------------------------------------


def test_record_hash_covers_every_field_but_content() -> None:
    d = draft()
    base = record_hash(d, 1, GENESIS_HASH)
    assert base == record_hash(d, 1, GENESIS_HASH)
    assert len(base) == 64
    # The content itself is not hashed (content_hash stands for it), so a purge keeps the hash.
    assert record_hash(msgspec.structs.replace(d, content=None), 1, GENESIS_HASH) == base
    # An int where a float belongs hashes as the float a database returns.
    assert record_hash(msgspec.structs.replace(d, at=1000), 1, GENESIS_HASH) == base
    changed = {
        "tenant": "other",
        "key_id": "k2",
        "request_id": "r2",
        "at": 1000.5,
        "stage": "output",
        "decision": "block",
        "source": "rules",
        "policy": "strict@3",
        "policy_hash": "q",
        "stages": RUNS[:1],
        "category": "violence",
        "severity": "high",
        "flagged": True,
        "content_hash": "0" * 64,
        "detail": "x",
        "reverses": 1,
        "actor": "reviewer",
        "draft_id": "w-1",
        "count": 7,
        "last_at": 1001.0,
    }
    assert set(changed) == set(AuditDraft.__struct_fields__) - {"content"}
    for name, value in changed.items():
        assert record_hash(msgspec.structs.replace(d, **{name: value}), 1, GENESIS_HASH) != base, name
    other_run = msgspec.structs.replace(RUNS[1], score=0.8126)
    assert record_hash(msgspec.structs.replace(d, stages=(RUNS[0], other_run)), 1, "") != base
    assert record_hash(d, 2, GENESIS_HASH) != base
    assert record_hash(d, 1, "a" * 64) != base
    # A record without a draft id (written before there were any) hashes as it did then: no such key.
    assert b"draft_id" not in canonical_json(d, 1, GENESIS_HASH)
    assert b'"draft_id":"w-1"' in canonical_json(msgspec.structs.replace(d, draft_id="w-1"), 1, GENESIS_HASH)
    # Nor does a record from before counted refusals: count 1 and no last_at are not hashed.
    assert b"count" not in canonical_json(d, 1, GENESIS_HASH)
    assert b"last_at" not in canonical_json(d, 1, GENESIS_HASH)


def test_verify_chain_finds_the_first_bad_record() -> None:
    records = chained([draft(n=i) for i in range(5)])
    report = verify_chain(records, key=KEY)
    assert report == ChainReport(ok=True, checked=5, last_seq=5, last_hash=records[-1].hash)
    assert verify_chain([]) == ChainReport(ok=True, checked=0)

    tampered = [*records]
    tampered[2] = msgspec.structs.replace(records[2], decision="block")
    assert (verify_chain(tampered).first_bad_seq, verify_chain(tampered).reason) == (3, "hash")
    # Rehashing the tampered record moves the break to the next record's prev_hash.
    tampered[2] = chain(msgspec.structs.replace(records[2], decision="block"), 3, records[1].hash, KEY)
    assert (verify_chain(tampered).first_bad_seq, verify_chain(tampered).reason) == (4, "prev_hash")
    # Rehashed without the key, it has no MAC after keyed records; with another key, a wrong one.
    for key in (None, MacKey(b"x" * 32)):
        tampered[2] = chain(msgspec.structs.replace(records[2], decision="block"), 3, records[1].hash, key)
        report = verify_chain(tampered, key=KEY)
        assert (report.first_bad_seq, report.reason) == (3, "mac")

    deleted = records[:2] + records[3:]
    report = verify_chain(deleted)
    assert (report.ok, report.first_bad_seq, report.reason, report.last_seq) == (False, 3, "seq_gap", 2)
    assert verify_chain(records[1:]).first_bad_seq == 1

    swapped = [records[0], records[2], records[1], *records[3:]]
    assert (verify_chain(swapped).first_bad_seq, verify_chain(swapped).reason) == (2, "seq_gap")
    # Swapping the rows' contents but keeping their seqs breaks the hashes instead.
    relabelled = [
        records[0],
        msgspec.structs.replace(records[2], seq=2, prev_hash=records[0].hash),
        msgspec.structs.replace(records[1], seq=3, prev_hash=records[2].hash),
    ]
    assert (verify_chain(relabelled).first_bad_seq, verify_chain(relabelled).reason) == (2, "hash")

    purged = [msgspec.structs.replace(r, content=None) for r in records]
    assert verify_chain(purged).ok
    wrong_content = [records[0], msgspec.structs.replace(records[1], content="not what was checked")]
    assert (verify_chain(wrong_content).first_bad_seq, verify_chain(wrong_content).reason) == (2, "content")

    mixed = [records[0], chain(draft("beta", 1), 2, records[0].hash)]
    assert verify_chain(mixed).reason == "tenant"
    assert verify_chain(records, tenant="beta").reason == "tenant"


def test_drafts_are_checked_and_content_hash_filled() -> None:
    d = draft(content_hash="")
    assert chain(d, 1, "").content_hash == content_sha256(d.content or "")
    with pytest.raises(InvalidDraftError, match="content_hash"):
        chain(draft(content_hash="0" * 64), 1, "")
    with pytest.raises(InvalidDraftError, match="finite"):
        chain(draft(at=float("nan")), 1, "")
    with pytest.raises(InvalidDraftError):
        chain(draft(stage="nowhere"), 1, "")
    with pytest.raises(InvalidDraftError):
        chain(draft(count=0), 1, "")
    with pytest.raises(InvalidDraftError, match="finite"):
        chain(draft(last_at=float("inf")), 1, "")
    # No content (not retained, or nothing checked): content_hash may say what was checked, or be empty.
    assert chain(draft(content=None, content_hash=""), 1, "").content_hash == ""
    # An int where a float belongs (as a database may return it) chains as its float, whether the draft
    # is normalized first (the stores) or by `chain`, and verifies.
    loose = draft(at=1000, stages=(AuditedStage(stage="rules", kind="rules", latency_s=0),))
    record = chain(normalize(loose), 1, "", normalized=True)
    assert record == chain(loose, 1, "")
    assert isinstance(record.at, float)
    assert verify_chain([record]).ok


_PIECES = ["a", "\\", "u0000", "\x00", "\ud800", "\udfff", "é", "漢", " "]
_TEXT = st.lists(st.sampled_from(_PIECES)).map("".join)


@settings(max_examples=200, deadline=None)
@given(detail=_TEXT, source=_TEXT, error=_TEXT, content=_TEXT)
def test_every_text_but_content_is_made_storable_and_nothing_else_changes(
    detail: str, source: str, error: str, content: str
) -> None:
    # `normalize` skips its field-by-field walk when the draft's texts are plain ASCII without NUL: that
    # shortcut must never keep a NUL or a lone surrogate (nested in a stage included), nor touch plain text
    # that only looks like an escape ("\\u0000"), nor the content (stored exactly).
    def storable(text: str) -> str:
        return "".join("\ufffd" if c == "\x00" or "\ud800" <= c <= "\udfff" else c for c in text)

    runs = (AuditedStage(stage="rules", kind="rules", error=error or None), *RUNS[1:])
    clean = normalize(draft(detail=detail, source=source, stages=runs, content=content, content_hash=""))
    assert clean.detail == storable(detail)
    assert clean.source == storable(source)
    assert clean.stages[0].error == (storable(error) if error else None)
    assert clean.stages[1:] == RUNS[1:]
    assert clean.content == content
    assert clean.content_hash == content_sha256(content)
    assert normalize(clean) == clean


@settings(max_examples=60, deadline=None)
@given(
    tenants=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=30),
    purge=st.sets(st.integers(min_value=0, max_value=29)),
    data=st.data(),
)
def test_any_sequence_of_appends_verifies(tenants: list[str], purge: set[int], data: st.DataObject) -> None:
    chains: dict[str, list[AuditRecord]] = {}
    for n, tenant in enumerate(tenants):
        own = chains.setdefault(tenant, [])
        own.append(chain(draft(tenant, n), len(own) + 1, own[-1].hash if own else GENESIS_HASH))
    for tenant, records in chains.items():
        kept = [msgspec.structs.replace(r, content=None) if i in purge else r for i, r in enumerate(records)]
        assert verify_chain(kept, tenant=tenant).ok
        # Any one field changed in any one record is found, at that record.
        victim = data.draw(st.integers(min_value=0, max_value=len(records) - 1))
        field = data.draw(st.sampled_from(["key_id", "request_id", "source", "detail", "actor", "policy"]))
        bad = [*kept]
        bad[victim] = msgspec.structs.replace(bad[victim], **{field: "tampered"})
        report = verify_chain(bad, tenant=tenant)
        assert (report.ok, report.first_bad_seq) == (False, victim + 1)


# --- the store, on both databases --------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """A SQLite file in tmp_path, or a fresh PostgreSQL schema dropped afterwards. No PostgreSQL = failure."""

    async def postgres(schema: str) -> AuditStore:
        return await PostgresAuditStore.open(PG_DSN, schema=schema, mac_key=KEY)

    async def sqlite(path: Path) -> AuditStore:
        return await SqliteAuditStore.open(path, KEY)

    async with sql_backend(request.param, tmp_path, sqlite, postgres) as opened:
        yield opened


@pytest.fixture
async def store(backend: Backend) -> AuditStore:
    """A migrated, empty audit store on each backend."""
    return await backend.open()


async def bypass_triggers(backend: Backend) -> None:
    """Let raw SQL change and delete audit records (what an attacker with database access could do)."""
    if backend.name == "sqlite":
        await backend.raw("DROP TRIGGER audit_records_only_purge")
        await backend.raw("DROP TRIGGER audit_records_no_delete")
    else:
        await backend.raw("ALTER TABLE {schema}.audit_records DISABLE TRIGGER USER")


async def test_append_assigns_seq_per_tenant(store: AuditStore) -> None:
    first = await store.append([draft("acme", 0), draft("beta", 1), draft("acme", 2)])
    assert [(r.tenant, r.seq) for r in first] == [("acme", 1), ("beta", 1), ("acme", 2)]
    assert first[0].prev_hash == first[1].prev_hash == GENESIS_HASH
    assert first[2].prev_hash == first[0].hash
    second = await store.append([draft("beta", 3), draft("acme", 4)])
    assert [(r.tenant, r.seq) for r in second] == [("beta", 2), ("acme", 3)]
    assert second[0].prev_hash == first[1].hash
    assert await store.append([]) == []

    # What append returns is what is stored, field for field (floats and stage runs included).
    for record in first + second:
        assert await store.get(record.tenant, record.seq) == record
    assert (await store.get("acme", 1)).stages == RUNS
    with pytest.raises(NotFoundError):
        await store.get("acme", 4)
    with pytest.raises(NotFoundError):
        await store.get("nobody", 1)
    assert issubclass(NotFoundError, AuditStoreError)

    for tenant, count in (("acme", 3), ("beta", 2)):
        report = await store.verify(tenant)
        assert (report.ok, report.checked, report.last_seq) == (True, count, count)
    assert (await store.verify("nobody")) == ChainReport(ok=True, checked=0)


async def test_a_draft_appended_again_is_recorded_once(store: AuditStore) -> None:
    a, b, c = (draft(n=i, draft_id=f"w-{i}") for i in range(3))
    first = await store.append([a, b])
    # Appended again (a replayed batch, a retry after a lost reply) beside a new draft: the records
    # already made come back, and only the new draft extends the chain.
    again = await store.append([b, c, a, draft("beta", 0, draft_id="w-0")])
    assert (again[0], again[2]) == (first[1], first[0])
    assert (again[1].seq, again[1].prev_hash, again[1].draft_id) == (3, first[1].hash, "w-2")
    assert (again[3].tenant, again[3].seq) == ("beta", 1)  # the id is the tenant's: another chain's is new
    # A batch of nothing new moves no head; the same draft twice in one batch is one record.
    assert await store.append([a, c]) == [first[0], again[1]]
    d = draft(n=3, draft_id="w-3")
    twice = await store.append([d, d])
    assert twice[0] == twice[1]
    assert twice[0].seq == 4
    # Drafts without an id are never taken for one another.
    assert [r.seq for r in await store.append([draft(n=9), draft(n=9)])] == [5, 6]
    for record in [*first, *again, twice[0]]:
        assert await store.get(record.tenant, record.seq) == record
    report = await store.verify("acme")
    assert (report.ok, report.checked, report.last_seq) == (True, 6, 6)
    assert (await store.verify("beta")).ok


async def test_draft_ids_are_looked_up_through_their_index(backend: Backend, store: AuditStore) -> None:
    """An append checks its draft ids through the partial unique index: a lookup that cannot use it reads
    the tenant's whole chain, so every append grew slower as the trail grew (issue 44)."""
    await store.append([draft(n=i, draft_id=f"d-{i}") for i in range(20)])
    if backend.name == "sqlite":
        sql = policy.audit.sqlite._BY_DRAFT.replace("?", "'acme'", 1).replace("?", "'d-3'", 1)
        plan = " ".join(str(row[-1]) for row in await backend.raw(f"EXPLAIN QUERY PLAN {sql}"))
    else:
        # A generic plan (any tenant, any ids), as a prepared statement gets, with a scan priced out.
        await backend.raw(f"SET search_path TO {backend.location}")
        await backend.raw("SET enable_seqscan = off")
        await backend.raw("SET plan_cache_mode = force_generic_plan")
        await backend.raw(f"PREPARE by_drafts(text, text[]) AS {policy.audit.postgres._BY_DRAFTS}")
        plan = " ".join(row[0] for row in await backend.raw("EXPLAIN EXECUTE by_drafts('acme', '{d-3}')"))
        await backend.raw("DEALLOCATE by_drafts")
    assert "audit_records_by_draft" in plan, plan


# The columns of audit_records after each released migration that changed them.
COLUMNS_AT = {2: len(RECORD_FIELDS) - 4, 3: len(RECORD_FIELDS) - 3, 4: len(RECORD_FIELDS) - 1}


@pytest.mark.parametrize("version", sorted(COLUMNS_AT))
async def test_records_from_before_draft_ids_and_counts_verify_after_the_upgrade(
    backend: Backend, version: int
) -> None:
    """A database at migration 2 (no draft_id column), 3 (no count, last_at) or 4 (no mac) with records in
    it: opening the store migrates it, the old records read back and verify (unkeyed), and new ones chain
    after them."""
    old = chained([draft(n=i) for i in range(3)], key=None)
    width = COLUMNS_AT[version]
    columns = ", ".join(RECORD_FIELDS[:width])
    rows = [record_row(record)[:width] for record in old]
    head = (old[-1].tenant, old[-1].seq, old[-1].hash)
    inserts = [(f"audit_records ({columns})", row) for row in rows]
    await write_at_migration(backend, version, [*inserts, ("audit_heads (tenant, seq, hash)", head)])
    store = await backend.open()
    versions = await backend.raw("SELECT version FROM {schema}.audit_schema_migrations ORDER BY version")
    assert [row[0] for row in versions] == list(range(1, len(MIGRATIONS) + 1))
    assert [await store.get("acme", seq) for seq in (1, 2, 3)] == old
    [new] = await store.append([draft(n=5, draft_id="w-5")])
    assert (new.seq, new.prev_hash) == (4, old[-1].hash)
    assert await store.append([draft(n=5, draft_id="w-5")]) == [new]
    report = await store.verify("acme")
    assert (report.ok, report.checked) == (True, 4)
    [counted] = await store.append([draft(n=6, count=40, last_at=1007.5)])
    assert await store.get("acme", counted.seq) == counted
    assert (counted.count, counted.last_at) == (40, 1007.5)
    report = await store.verify("acme")
    assert (report.ok, report.checked, report.unkeyed) == (True, 5, 3)
    # The upgraded triggers cover the new columns too.
    for column, value in (("draft_id", "'forged'"), ("count", "1"), ("last_at", "0"), ("mac", "NULL")):
        with pytest.raises(APPEND_ONLY, match="append-only"):
            await backend.raw(f"UPDATE {{schema}}.audit_records SET {column} = {value} WHERE seq = 5")


async def test_a_writer_whose_appends_lost_their_replies_records_each_draft_once(
    backend: Backend, tmp_path: Path
) -> None:
    """Every other append commits and then reports a failure (its reply lost): the writer spools that batch
    and replays it, and the store records each draft once, in order."""
    real = await backend.open()

    class LostReplies:
        def __init__(self) -> None:
            self.calls = 0

        async def append(self, drafts: Sequence[AuditDraft]) -> list[AuditRecord]:
            self.calls += 1
            records = await real.append(drafts)
            if self.calls % 2:
                raise AuditUnavailableError("the reply was lost")
            return records

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    async def no_wait(_: float) -> None:
        await asyncio.sleep(0)

    writer = AuditWriter(LostReplies(), tmp_path / "spool", clock=lambda: 0.0, batch_size=10, sleep=no_wait)
    await writer.start()
    drafts = [draft(n=i) for i in range(45)]
    for d in drafts:
        writer.submit(d)
    await writer.record(draft(n=45))  # durable: in the store, or in the spool (then replayed)
    async with asyncio.timeout(120):
        while writer.state().spooled_bytes or writer.state().buffered:  # noqa: ASYNC110 - the spool's threads
            await asyncio.sleep(0.001)
    await writer.close()
    records = await real.query(AuditQuery(tenant="acme", limit=1000))
    assert [r.request_id for r in records] == [d.request_id for d in drafts] + ["req-acme-45"]
    assert len({r.draft_id for r in records}) == 46
    assert (await real.verify("acme")).ok


async def test_an_invalid_draft_writes_nothing(store: AuditStore) -> None:
    with pytest.raises(InvalidDraftError):
        await store.append([draft(n=0), draft(n=1, content_hash="0" * 64)])
    assert await store.find(None, "req-acme-0") == []
    assert (await store.append([draft(n=2)]))[0].seq == 1


async def test_find_by_request_id(store: AuditStore) -> None:
    await store.append([draft("beta", 0, request_id="r1"), draft("acme", 0, request_id="r1")])
    await store.append([draft("acme", 1, request_id="r2"), draft("acme", 2, request_id="r1", stage="output")])
    assert [(r.tenant, r.seq) for r in await store.find(None, "r1")] == [
        ("acme", 1),
        ("acme", 3),
        ("beta", 1),
    ]
    assert [(r.tenant, r.seq) for r in await store.find("acme", "r1")] == [("acme", 1), ("acme", 3)]
    assert [r.seq for r in await store.find("beta", "r2")] == []
    assert await store.find(None, "missing") == []


async def test_tampering_is_detected_at_the_first_bad_seq(backend: Backend, store: AuditStore) -> None:
    await store.append([draft(n=i) for i in range(6)])
    await store.append([draft("beta", 0)])
    await bypass_triggers(backend)
    await backend.raw(
        "UPDATE {schema}.audit_records SET decision = 'block' WHERE tenant = 'acme' AND seq = 4"
    )
    report = await store.verify("acme")
    assert (report.ok, report.first_bad_seq, report.reason, report.last_seq) == (False, 4, "hash", 3)
    assert (await store.verify("beta")).ok
    # A value no record can hold (not even decodable) is a broken record too, not a crash.
    await backend.raw("UPDATE {schema}.audit_records SET stage = 'nowhere' WHERE tenant = 'acme' AND seq = 2")
    report = await store.verify("acme")
    assert (report.first_bad_seq, report.reason) == (2, "hash")
    # Content that is not what was checked.
    await backend.raw("UPDATE {schema}.audit_records SET content = 'forged' WHERE tenant = 'beta'")
    assert ((await store.verify("beta")).first_bad_seq, (await store.verify("beta")).reason) == (1, "content")


async def test_deleting_records_is_detected(backend: Backend, store: AuditStore) -> None:
    await store.append([draft(n=i) for i in range(5)])
    await bypass_triggers(backend)
    await backend.raw("DELETE FROM {schema}.audit_records WHERE tenant = 'acme' AND seq = 3")
    report = await store.verify("acme")
    assert (report.ok, report.first_bad_seq, report.reason, report.checked) == (False, 3, "seq_gap", 3)
    # Cutting records off the end leaves a chain that is consistent in itself: the head shows it.
    await backend.raw("DELETE FROM {schema}.audit_records WHERE tenant = 'acme' AND seq >= 3")
    report = await store.verify("acme")
    assert (report.ok, report.first_bad_seq, report.reason, report.last_seq) == (False, 3, "head", 2)


async def test_triggers_refuse_updates_and_deletes(backend: Backend, store: AuditStore) -> None:
    await store.append([draft(n=0), draft(n=1)])
    refused = [
        "UPDATE {schema}.audit_records SET decision = 'block'",
        "UPDATE {schema}.audit_records SET content = 'other'",
        "UPDATE {schema}.audit_records SET content = NULL, detail = 'x'",
        "UPDATE {schema}.audit_records SET seq = seq + 10",
        "UPDATE {schema}.audit_records SET draft_id = 'forged'",
        "DELETE FROM {schema}.audit_records WHERE seq = 2",
        "DELETE FROM {schema}.audit_heads",
        "UPDATE {schema}.audit_heads SET seq = 1",
        "UPDATE {schema}.audit_heads SET hash = 'x'",
    ]
    if backend.name == "postgres":
        refused += ["TRUNCATE {schema}.audit_records", "TRUNCATE {schema}.audit_heads"]
    for sql in refused:
        with pytest.raises(APPEND_ONLY, match=r"append-only|only move forward"):
            await backend.raw(sql)
    assert (await store.verify("acme")).ok
    # Nulling content, and nothing else, is allowed: that is a purge.
    await backend.raw("UPDATE {schema}.audit_records SET content = NULL WHERE seq = 1")
    assert (await store.get("acme", 1)).content is None
    assert (await store.verify("acme")).ok


async def test_purge_content_keeps_the_chain(store: AuditStore) -> None:
    await store.append([draft(n=i) for i in range(6)] + [draft("beta", i) for i in range(6)])
    assert await store.purge_content("acme", before=1003.0) == 3
    records = await store.query(AuditQuery(tenant="acme"))
    assert [r.content is None for r in records] == [True, True, True, False, False, False]
    assert all(r.content_hash == content_sha256(f"prompt {r.seq - 1} of acme") for r in records)
    assert await store.purge_content("acme", before=1003.0) == 0
    assert all(r.content is not None for r in await store.query(AuditQuery(tenant="beta")))
    assert (await store.verify("acme")).ok
    assert await store.purge_content("acme", before=2000.0) == 3
    assert (await store.verify("acme")).ok
    assert await store.purge_content("nobody", before=2000.0) == 0


async def test_query_filters(store: AuditStore) -> None:
    await store.append(
        [
            draft("acme", 0),
            draft("acme", 1, decision="block", category="violence", severity="high", source="rules"),
            draft("acme", 2, stage="output", source="fail_open", policy="strict@3"),
            draft("acme", 3, flagged=True, decision="flag", policy="strict_x@1"),
            draft(
                "acme", 4, stage="review", decision="reversal", reverses=2, actor="k-rev", source="reviewer"
            ),
            draft("beta", 5, decision="block", category="violence", source="fail_open", flagged=True),
        ]
    )

    async def seqs(**filters: Any) -> list[tuple[str, int]]:
        return [(r.tenant, r.seq) for r in await store.query(AuditQuery(**filters))]

    assert await seqs(tenant="acme") == [("acme", i) for i in range(1, 6)]
    assert await seqs() == [*(("acme", i) for i in range(1, 6)), ("beta", 1)]
    assert await seqs(tenant="acme", since=1001.0, until=1003.0) == [("acme", 2), ("acme", 3)]
    assert await seqs(decision="block") == [("acme", 2), ("beta", 1)]
    # Tenant isolation: a tenant's query never returns another tenant's records.
    assert await seqs(tenant="acme", decision="block") == [("acme", 2)]
    assert await seqs(tenant="beta", decision="allow") == []
    assert await seqs(stage="output") == [("acme", 3)]
    assert await seqs(stage="review") == [("acme", 5)]
    assert await seqs(category="violence", tenant="beta") == [("beta", 1)]
    assert await seqs(fail_open_only=True) == [("acme", 3), ("beta", 1)]
    assert await seqs(fail_open_only=True, tenant="acme") == [("acme", 3)]
    assert await seqs(flagged_only=True) == [("acme", 4), ("beta", 1)]
    # A bare name matches its every version (not other names it prefixes); name@version matches exactly.
    assert await seqs(tenant="acme", policy="strict") == [("acme", i) for i in (1, 2, 3, 5)]
    assert await seqs(tenant="acme", policy="strict@3") == [("acme", 3)]
    assert await seqs(tenant="acme", policy="strict_") == []
    assert await seqs(policy="strict_x") == [("acme", 4)]
    assert await seqs(tenant="nobody") == []


async def test_pagination_is_stable(store: AuditStore) -> None:
    for tenant in ("b", "A", "a"):
        await store.append([draft(tenant, i) for i in range(7)])
    expected = [(t, s) for t in ("A", "a", "b") for s in range(1, 8)]

    async def pages(q: AuditQuery) -> list[tuple[str, int]]:
        seen: list[tuple[str, int]] = []
        while page := await store.query(q):
            seen += [(r.tenant, r.seq) for r in page]
            assert len(page) <= q.page_size()
            q = q.after(page[-1])
            # Records appended meanwhile come after what was read (per tenant), never inside it.
            await store.append([draft("a", 100 + len(seen))])
        return seen

    seen = await pages(AuditQuery(limit=4))
    # Every record once, in (tenant by code point, seq) order, none skipped (appended ones included).
    assert seen == sorted(set(seen), key=lambda key: (key[0].encode(), key[1]))
    assert [key for key in seen if key[0] != "a"] == [key for key in expected if key[0] != "a"]
    a_seqs = [s for t, s in seen if t == "a"]
    assert a_seqs == list(range(1, len(a_seqs) + 1))
    assert len(a_seqs) > 7
    assert await pages(AuditQuery(tenant="b", limit=3)) == [("b", s) for s in range(1, 8)]
    assert AuditQuery(limit=10**6).page_size() == MAX_QUERY_LIMIT
    assert AuditQuery(limit=0).page_size() == 1


async def test_concurrent_appends_keep_one_chain(store: AuditStore) -> None:
    batches = await asyncio.gather(*(store.append([draft(n=i), draft("beta", i)]) for i in range(50)))
    acme = sorted(r.seq for batch in batches for r in batch if r.tenant == "acme")
    assert acme == list(range(1, 51))
    report = await store.verify("acme")
    assert (report.ok, report.checked) == (True, 50)
    assert (await store.verify("beta")).ok
    # Each batch's two records went in together: equal seqs, as every batch appended to both tenants.
    assert all(batch[0].seq == batch[1].seq for batch in batches)


async def test_two_stores_appending_at_once_keep_one_chain(backend: Backend) -> None:
    """Two store instances (two gateway processes' worth of connections) on one database."""
    first, second = await backend.open(), await backend.open()
    await asyncio.gather(
        *(s.append([draft(n=i)]) for i in range(40) for s in (first, second)),
    )
    rows = await backend.raw("SELECT seq FROM {schema}.audit_records WHERE tenant = 'acme' ORDER BY seq")
    assert [row[0] for row in rows] == list(range(1, 81))
    for s in (first, second):
        report = await s.verify("acme")
        assert (report.ok, report.checked) == (True, 80)


async def test_migrations_are_idempotent_and_share_the_tenant_database(backend: Backend) -> None:
    first = await backend.open()
    await first.append([draft()])
    second = await backend.open()
    assert await second.get("acme", 1) == await first.get("acme", 1)
    rows = await backend.raw("SELECT version FROM {schema}.audit_schema_migrations ORDER BY version")
    assert [row[0] for row in rows] == [m.version for m in policy.audit.MIGRATIONS] == list(range(1, 11))
    # The tenant store lives beside it, in the same file or schema, with its own migrations.
    if backend.name == "sqlite":
        tenants: Any = await SqliteTenantStore.open(backend.location)
    else:
        tenants = await PostgresTenantStore.open(PG_DSN, schema=backend.location)
    try:
        await tenants.create_tenant(Tenant(tenant_id="acme", display_name="Acme"), actor="a", now=1.0)
        assert (await tenants.get_tenant("acme")).display_name == "Acme"
    finally:
        await tenants.close()
    assert (await second.verify("acme")).ok


async def test_a_locked_database_is_unavailable(tmp_path: Path) -> None:
    """A write that cannot get its lock in time is AuditUnavailableError; the store works once it can."""
    path = tmp_path / "locked.sqlite3"
    store = await SqliteAuditStore.open(path)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        await asyncio.to_thread(other.execute, "BEGIN EXCLUSIVE")
        with pytest.raises(AuditUnavailableError):
            await store.append([draft()])
        await asyncio.to_thread(other.execute, "ROLLBACK")
        assert (await store.append([draft()]))[0].seq == 1
    finally:
        other.close()
        await store.close()

    async with postgres_schema() as (schema, admin):
        pg = await PostgresAuditStore.open(PG_DSN, schema=schema, command_timeout=0.5)
        try:
            async with admin.transaction():
                await admin.execute(f"LOCK TABLE {schema}.audit_heads IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(AuditUnavailableError):
                    await pg.append([draft()])
            assert (await pg.append([draft()]))[0].seq == 1
            assert (await pg.verify("acme")).ok
        finally:
            await pg.close()


async def test_sqlite_closed_and_in_memory(tmp_path: Path) -> None:
    store = await SqliteAuditStore.open(":memory:")
    await store.append([draft()])
    assert (await store.verify("acme")).ok
    await store.close()
    with pytest.raises(AuditStoreError, match="closed"):
        await store.get("acme", 1)
    await store.close()


async def test_postgres_refuses_unsafe_schema_names() -> None:
    with pytest.raises(ValueError, match="schema"):
        await PostgresAuditStore.open(PG_DSN, schema='x"; DROP TABLE audit_records; --')


def test_public_names() -> None:
    assert set(policy.audit.__all__) >= {
        *("AuditStore", "AuditStoreError", "AuditUnavailableError", "NotFoundError", "InvalidDraftError"),
        *("AuditDraft", "AuditRecord", "AuditedStage", "Stage", "Decision", "AuditQuery", "MAX_QUERY_LIMIT"),
        *("ChainReport", "ChainFault", "ChainVerifier", "GENESIS_HASH", "MIGRATIONS"),
        *("SqliteAuditStore", "PostgresAuditStore", "record_hash", "verify_chain", "content_sha256"),
    }


@pytest.mark.parametrize(
    "content",
    [
        "a prompt with a NUL \x00 in it",
        "a lone surrogate \ud800 and a NUL \x00",
        "\x01lockgate-escaped\x01 looks like the store's own mark",
        "x" * (1 << 20),  # 1 MB
    ],
    ids=["nul", "surrogate", "mark", "1mb"],
)
async def test_content_no_store_holds_as_text_is_stored_exactly_and_the_trail_goes_on(
    store: AuditStore, content: str
) -> None:
    # PostgreSQL's text refuses NUL, UTF-8 cannot encode a lone surrogate: such content once stopped the
    # whole trail (every batch after it retried forever). It is stored escaped and read back as it was.
    odd = draft(n=1, content=content, content_hash="", detail="who\x00ever")
    records = await store.append([draft(n=0), odd, draft("beta", 2)])
    assert [r.seq for r in records] == [1, 2, 1]
    stored = await store.get("acme", 2)
    assert stored.content == content
    assert stored.content_hash == content_sha256(content)
    # Other text fields are hashed into the chain: they are made storable before (U+FFFD for a NUL).
    assert stored.detail == "who\ufffdever"
    assert stored == records[1]
    # The next records chain on, and the chain verifies.
    more = await store.append([draft(n=3)])
    assert (more[0].seq, more[0].prev_hash) == (3, stored.hash)
    assert (await store.verify("acme")).ok
    assert (await store.verify("beta")).ok
    # A purge still only nulls it.
    assert await store.purge_content("acme", 10_000.0) == 3
    assert (await store.get("acme", 2)).content is None
    assert (await store.verify("acme")).ok
