"""`PostgresAuditStore`: the audit log in PostgreSQL, shared by gateway replicas (asyncpg pool).

Each store works in one schema (`search_path` is set on every pooled connection), which it creates and
migrates on `open` (`registry.db.postgres.PostgresStore`); it may be the tenant store's schema. An append
locks each of its tenants' `audit_heads` row (`SELECT ... FOR UPDATE`, tenants in a fixed order so two batches
never deadlock) before reading the head and writing after it, so appends from any number of replicas extend
each chain one transaction at a time and never fork it. Losing the database (down, restarting, out of
connections, a statement over `command_timeout`) raises `AuditUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self, Unpack

from policy.audit.base import AuditQuery, AuditRecordError, AuditUnavailableError, BadRow, NotFoundError
from policy.audit.keys import MacKey
from policy.audit.migrations import (
    MIGRATIONS,
    MIGRATIONS_TABLE,
    RECORD_COLUMNS,
    RECORD_FIELDS,
    record_from_row,
    record_or_bad_row,
    record_row,
)
from policy.audit.query import query_sql
from policy.audit.records import (
    GENESIS_HASH,
    AuditDraft,
    AuditRecord,
    ChainReport,
    Checkpoint,
    chain,
    normalize,
)
from policy.audit.verify import verify_tenant
from registry.db.postgres import PoolOptions, PostgresStore

_INSERT = (
    f"INSERT INTO audit_records ({RECORD_COLUMNS})"
    f" VALUES ({', '.join(f'${i}' for i in range(1, len(RECORD_FIELDS) + 1))})"
)
# A new tenant's head starts at seq 0, so there is always a row to lock; rolled back with a failed append.
_ENSURE_HEAD = (
    "INSERT INTO audit_heads (tenant, seq, hash) VALUES ($1, 0, '') ON CONFLICT (tenant) DO NOTHING"
)
_LOCK_HEAD = "SELECT seq, hash FROM audit_heads WHERE tenant = $1 FOR UPDATE"
_HEADS = "SELECT tenant, seq, hash FROM audit_heads WHERE seq > 0"
_SET_HEAD = "UPDATE audit_heads SET seq = $2, hash = $3 WHERE tenant = $1"
_PAGE = (
    f"SELECT {RECORD_COLUMNS} FROM audit_records WHERE tenant = $1 AND seq > $2 AND seq <= $3"
    " ORDER BY seq LIMIT $4"
)
# `draft_id <> ''` repeats the partial unique index's condition, which is what lets the planner use that
# index (audit_records_by_draft) for any parameters: without it a lookup read the tenant's whole chain.
_BY_DRAFTS = (
    f"SELECT {RECORD_COLUMNS} FROM audit_records"
    " WHERE tenant = $1 AND draft_id = ANY($2::text[]) AND draft_id <> ''"
)


class PostgresAuditStore(PostgresStore):
    """An `AuditStore` in one PostgreSQL schema."""

    what = "audit"
    unavailable = AuditUnavailableError
    refused = AuditRecordError
    migrations = MIGRATIONS
    migrations_table = MIGRATIONS_TABLE
    # Arbitrary but fixed ("Lkgtaudi"): replicas migrating the audit tables wait on each other only.
    lock_key = 0x4C6B6774_61756469

    def __init__(self, pool: Any, mac_key: MacKey | None = None) -> None:
        """Use `open`; this takes an asyncpg pool whose schema is already migrated."""
        super().__init__(pool)
        self._key = mac_key

    @classmethod
    async def open(cls, dsn: str, *, mac_key: MacKey | None = None, **options: Unpack[PoolOptions]) -> Self:
        """Connect to `dsn`, create the schema if missing, and migrate it (`PostgresStore.open`); records
        are MACed with `mac_key` (None: not, and verify does not check MACs)."""
        return cls(await cls.open_pool(dsn, **options), mac_key)

    async def append(self, drafts: Sequence[AuditDraft]) -> list[AuditRecord]:
        """Record `drafts` atomically and in order, each as its tenant's next seq, chained (one whose
        `draft_id` is recorded already: that record)."""
        clean = [normalize(draft) for draft in drafts]
        if not clean:
            return []
        records: list[AuditRecord] = []
        async with self._conn(write=True) as conn:
            heads: dict[str, tuple[int, str]] = {}
            # Sorted: two batches naming the same tenants lock them in the same order, so never deadlock.
            for tenant in sorted({draft.tenant for draft in clean}):
                await conn.execute(_ENSURE_HEAD, tenant)
                row = await conn.fetchrow(_LOCK_HEAD, tenant)
                heads[tenant] = (int(row[0]), row[1] if row[0] else GENESIS_HASH)
            # Drafts recorded already (by an append that committed but seemed to fail), under their heads'
            # locks: no other append of these tenants runs meanwhile.
            known = await self._recorded(conn, clean)
            moved: set[str] = set()  # tenants whose head moves (a batch of duplicates moves none)
            rows = []
            for draft in clean:
                if draft.draft_id and (record := known.get((draft.tenant, draft.draft_id))) is not None:
                    records.append(record)
                    continue
                seq, prev_hash = heads[draft.tenant]
                record = chain(draft, seq + 1, prev_hash, self._key, normalized=True)
                rows.append(record_row(record))
                heads[draft.tenant] = (record.seq, record.hash)
                moved.add(draft.tenant)
                records.append(record)
                if draft.draft_id:
                    known[(draft.tenant, draft.draft_id)] = record
            if rows:
                await conn.executemany(_INSERT, rows)
            for tenant in moved:
                await conn.execute(_SET_HEAD, tenant, *heads[tenant])
        return records

    @staticmethod
    async def _recorded(conn: Any, drafts: Sequence[AuditDraft]) -> dict[tuple[str, str], AuditRecord]:
        """The records already holding any of `drafts`' draft ids, by (tenant, draft_id)."""
        ids: dict[str, list[str]] = {}
        for draft in drafts:
            if draft.draft_id:
                ids.setdefault(draft.tenant, []).append(draft.draft_id)
        found: dict[tuple[str, str], AuditRecord] = {}
        for tenant, draft_ids in ids.items():
            for row in await conn.fetch(_BY_DRAFTS, tenant, draft_ids):
                record = record_from_row(row)
                found[(record.tenant, record.draft_id)] = record
        return found

    async def get(self, tenant: str, seq: int) -> AuditRecord:
        """One record, or NotFoundError."""
        sql = f"SELECT {RECORD_COLUMNS} FROM audit_records WHERE tenant = $1 AND seq = $2"
        async with self._conn() as conn:
            row = await conn.fetchrow(sql, tenant, seq)
        if row is None:
            raise NotFoundError(f"no audit record {seq} of tenant {tenant!r}")
        return record_from_row(row)

    async def find(self, tenant: str | None, request_id: str) -> list[AuditRecord]:
        """The records of one request (of one tenant, or of any), ordered by (tenant, seq)."""
        order = 'ORDER BY tenant COLLATE "C", seq'
        async with self._conn() as conn:
            if tenant is None:
                sql = f"SELECT {RECORD_COLUMNS} FROM audit_records WHERE request_id = $1 {order}"
                rows = await conn.fetch(sql, request_id)
            else:
                where = "request_id = $1 AND tenant = $2"
                sql = f"SELECT {RECORD_COLUMNS} FROM audit_records WHERE {where} {order}"
                rows = await conn.fetch(sql, request_id, tenant)
        return [record_from_row(row) for row in rows]

    async def query(self, q: AuditQuery) -> list[AuditRecord]:
        """At most `q.page_size()` records matching `q`, ordered by (tenant, seq), after `q`'s keyset."""
        sql, args = query_sql(q, "postgres")
        async with self._conn() as conn:
            rows = await conn.fetch(sql, *args)
        return [record_from_row(row) for row in rows]

    async def heads(self, tenant: str | None = None) -> dict[str, tuple[int, str]]:
        """Each tenant's head (last seq and hash), or only `tenant`'s (none: an empty chain)."""
        async with self._conn() as conn:
            if tenant is None:
                rows = await conn.fetch(_HEADS)
            else:
                rows = await conn.fetch(f"{_HEADS} AND tenant = $1", tenant)
        return {row[0]: (int(row[1]), row[2]) for row in rows}

    async def chain_page(
        self, tenant: str, after_seq: int, through_seq: int, limit: int
    ) -> list[AuditRecord | BadRow]:
        """At most `limit` of the tenant's records with after_seq < seq <= through_seq, in seq order (a
        pooled connection for the one query: appends take others)."""
        async with self._conn() as conn:
            rows = await conn.fetch(_PAGE, tenant, after_seq, through_seq, limit)
        return [record_or_bad_row(row) for row in rows]

    async def verify(self, tenant: str, checkpoints: Sequence[Checkpoint] = ()) -> ChainReport:
        """Verify the tenant's chain up to its head, in pages (`verify_tenant`)."""
        return await verify_tenant(self, tenant, key=self._key, checkpoints=checkpoints)

    async def purge_content(self, tenant: str, before: float) -> int:
        """Null the content of the tenant's records with `at < before`; the number of records changed."""
        sql = "UPDATE audit_records SET content = NULL WHERE tenant = $1 AND at < $2 AND content IS NOT NULL"
        async with self._conn(write=True) as conn:
            status: str = await conn.execute(sql, tenant, float(before))
        return int(status.rsplit(" ", 1)[-1])
