"""`SqliteAuditStore`: the embedded audit log, on the stdlib `sqlite3` module and one worker thread.

Every call runs on the single thread of a `registry.db.sqlite.SqliteWorker`, so the event loop never blocks.
An append is one `BEGIN IMMEDIATE` transaction: it holds the database's write lock from reading each
tenant's head to writing the new records and head, so neither another task of this process (serialised on
the worker anyway) nor another process (a replica, the CLI) can fork a chain. An operational error (the file
locked past `busy_timeout`, a disk error) is `AuditUnavailableError`.

Verification reads the chain in pages through a read-only connection of its own (opened per page, in a
thread of the default executor), never on the worker: a long verify does not hold appends up. (An in-memory
database has no second connection: there it reads on the worker.)
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Self, TypeVar
from urllib.parse import quote

from policy.audit.base import (
    AuditQuery,
    AuditRecordError,
    AuditStoreError,
    AuditUnavailableError,
    BadRow,
    NotFoundError,
)
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
from registry.db.sqlite import Conn, SqliteStore, SqliteWorker, transaction

T = TypeVar("T")

_INSERT = f"INSERT INTO audit_records ({RECORD_COLUMNS}) VALUES ({', '.join('?' for _ in RECORD_FIELDS)})"
_HEAD = "SELECT seq, hash FROM audit_heads WHERE tenant = ?"
_SET_HEAD = (
    "INSERT INTO audit_heads (tenant, seq, hash) VALUES (?, ?, ?)"
    " ON CONFLICT (tenant) DO UPDATE SET seq = excluded.seq, hash = excluded.hash"
)
_HEADS = "SELECT tenant, seq, hash FROM audit_heads"
_PAGE = (
    f"SELECT {RECORD_COLUMNS} FROM audit_records WHERE tenant = ? AND seq > ? AND seq <= ?"
    " ORDER BY seq LIMIT ?"
)
# `draft_id <> ''` repeats the partial unique index's condition, which is what lets the planner use that
# index (audit_records_by_draft): without it every lookup scanned the tenant's whole chain.
_BY_DRAFT = f"SELECT {RECORD_COLUMNS} FROM audit_records WHERE tenant = ? AND draft_id = ? AND draft_id <> ''"


class SqliteAuditStore(SqliteStore):
    """An `AuditStore` in one SQLite file (WAL mode), or in memory for ":memory:"."""

    what = "audit"
    unavailable = AuditUnavailableError
    closed_error = AuditStoreError
    refused = AuditRecordError
    migrations = MIGRATIONS
    migrations_table = MIGRATIONS_TABLE

    def __init__(self, db: SqliteWorker, mac_key: MacKey | None = None) -> None:
        """Use `open`; this takes a worker whose database is already migrated."""
        super().__init__(db)
        self._key = mac_key

    @classmethod
    async def open(cls, path: str | Path, mac_key: MacKey | None = None) -> Self:
        """Open (creating if needed) and migrate the database at `path` (may be the tenant store's file);
        records are MACed with `mac_key` (None: not, and verify does not check MACs)."""
        return cls(await cls.open_worker(path), mac_key)

    async def append(self, drafts: Sequence[AuditDraft]) -> list[AuditRecord]:
        """Record `drafts` atomically and in order, each as its tenant's next seq, chained (one whose
        `draft_id` is recorded already: that record)."""
        # Checked on the loop, before the write lock is taken: an invalid draft writes nothing.
        clean = [normalize(draft) for draft in drafts]
        if not clean:
            return []

        def recorded(conn: Conn, draft: AuditDraft) -> AuditRecord | None:
            row = conn.execute(_BY_DRAFT, (draft.tenant, draft.draft_id)).fetchone()
            return None if row is None else record_from_row(row)

        def append(conn: Conn) -> list[AuditRecord]:
            heads: dict[str, tuple[int, str]] = {}
            moved: set[str] = set()  # tenants whose head moves (a batch of duplicates moves none)
            records: list[AuditRecord] = []
            with transaction(conn):
                for draft in clean:
                    if draft.draft_id and (known := recorded(conn, draft)) is not None:
                        records.append(known)
                        continue
                    if draft.tenant not in heads:
                        row = conn.execute(_HEAD, (draft.tenant,)).fetchone()
                        heads[draft.tenant] = (0, GENESIS_HASH) if row is None else (int(row[0]), row[1])
                    seq, prev_hash = heads[draft.tenant]
                    record = chain(draft, seq + 1, prev_hash, self._key, normalized=True)
                    conn.execute(_INSERT, record_row(record))
                    heads[draft.tenant] = (record.seq, record.hash)
                    moved.add(draft.tenant)
                    records.append(record)
                for tenant in moved:
                    conn.execute(_SET_HEAD, (tenant, *heads[tenant]))
            return records

        return await self._run(append)

    async def get(self, tenant: str, seq: int) -> AuditRecord:
        """One record, or NotFoundError."""
        sql = f"SELECT {RECORD_COLUMNS} FROM audit_records WHERE tenant = ? AND seq = ?"
        row = await self._run(lambda conn: conn.execute(sql, (tenant, seq)).fetchone())
        if row is None:
            raise NotFoundError(f"no audit record {seq} of tenant {tenant!r}")
        return record_from_row(row)

    async def find(self, tenant: str | None, request_id: str) -> list[AuditRecord]:
        """The records of one request (of one tenant, or of any), ordered by (tenant, seq)."""
        where, args = (
            ("request_id = ?", (request_id,))
            if tenant is None
            else ("request_id = ? AND tenant = ?", (request_id, tenant))
        )
        sql = f"SELECT {RECORD_COLUMNS} FROM audit_records WHERE {where} ORDER BY tenant, seq"
        rows = await self._run(lambda conn: conn.execute(sql, args).fetchall())
        return [record_from_row(row) for row in rows]

    async def query(self, q: AuditQuery) -> list[AuditRecord]:
        """At most `q.page_size()` records matching `q`, ordered by (tenant, seq), after `q`'s keyset."""
        sql, args = query_sql(q, "sqlite")
        rows = await self._run(lambda conn: conn.execute(sql, args).fetchall())
        return [record_from_row(row) for row in rows]

    async def _read(self, fn: Callable[[Conn], T]) -> T:
        """`fn` on a read-only connection of its own (the worker's for an in-memory database)."""
        path = self._db.path
        if path is None:
            return await self._run(fn)
        self._check_open()

        def read() -> T:
            uri = f"file:{quote(str(path.resolve()))}?mode=ro"
            with closing(sqlite3.connect(uri, uri=True, isolation_level=None)) as conn:
                conn.execute("PRAGMA busy_timeout = 5000")
                return fn(conn)

        try:
            return await asyncio.to_thread(read)
        except sqlite3.OperationalError as exc:
            raise AuditUnavailableError(f"the audit database is unavailable: {exc}") from exc

    async def heads(self, tenant: str | None = None) -> dict[str, tuple[int, str]]:
        """Each tenant's head (last seq and hash), or only `tenant`'s (none: an empty chain)."""
        sql, args = (_HEADS, ()) if tenant is None else (f"{_HEADS} WHERE tenant = ?", (tenant,))
        rows = await self._read(lambda conn: conn.execute(sql, args).fetchall())
        return {row[0]: (int(row[1]), row[2]) for row in rows}

    async def chain_page(
        self, tenant: str, after_seq: int, through_seq: int, limit: int
    ) -> list[AuditRecord | BadRow]:
        """At most `limit` of the tenant's records with after_seq < seq <= through_seq, in seq order."""
        args = (tenant, after_seq, through_seq, limit)
        rows = await self._read(lambda conn: conn.execute(_PAGE, args).fetchall())
        return [record_or_bad_row(row) for row in rows]

    async def verify(self, tenant: str, checkpoints: Sequence[Checkpoint] = ()) -> ChainReport:
        """Verify the tenant's chain up to its head, in pages, off the worker (`verify_tenant`)."""
        return await verify_tenant(self, tenant, key=self._key, checkpoints=checkpoints)

    async def purge_content(self, tenant: str, before: float) -> int:
        """Null the content of the tenant's records with `at < before`; the number of records changed."""
        sql = "UPDATE audit_records SET content = NULL WHERE tenant = ? AND at < ? AND content IS NOT NULL"

        def purge(conn: Conn) -> int:
            with transaction(conn):
                return conn.execute(sql, (tenant, float(before))).rowcount

        return await self._run(purge)
