"""`SqliteAppealStore`: appeals in the audit store's SQLite file, on one worker thread.

Each write is one `BEGIN IMMEDIATE` transaction, so reading an appeal's state, changing it and appending its
event cannot interleave with another writer (another task, a replica, the CLI). An operational error (the
file locked past `busy_timeout`, a disk error) is `AuditUnavailableError`.
"""

from __future__ import annotations

import builtins
import sqlite3
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from policy.audit.appeals import (
    APPEAL_COLUMNS,
    APPEAL_FIELDS,
    EVENT_COLUMNS,
    EVENT_FIELDS,
    Appeal,
    AppealConflictError,
    AppealEvent,
    AppealNotFoundError,
    AppealState,
    appeal_from_row,
    check_transition,
    event_from_row,
    new_appeal_id,
    page_size,
    states_of,
)
from policy.audit.base import AuditStoreError, AuditUnavailableError
from policy.audit.migrations import MIGRATIONS, MIGRATIONS_TABLE
from registry.db.sqlite import Conn, SqliteWorker, transaction

T = TypeVar("T")

_INSERT = f"INSERT INTO appeals ({APPEAL_COLUMNS}) VALUES ({', '.join('?' for _ in APPEAL_FIELDS)})"
_INSERT_EVENT = f"INSERT INTO appeal_events ({EVENT_COLUMNS}) VALUES ({', '.join('?' for _ in EVENT_FIELDS)})"
_SET_STATE = "UPDATE appeals SET state = ?, updated_at = ? WHERE appeal_id = ?"
_NEXT_EVENT = "SELECT COALESCE(MAX(n), 0) + 1 FROM appeal_events WHERE appeal_id = ?"
_EVENTS = f"SELECT {EVENT_COLUMNS} FROM appeal_events WHERE appeal_id = ? ORDER BY n"
# Decision seqs asked in one statement (well under SQLite's bound on parameters).
_SEQS_PER_QUERY = 500


def _scoped(tenant: str | None, appeal_id: str) -> tuple[str, tuple[Any, ...]]:
    """The WHERE clause (and arguments) selecting one appeal the caller may see."""
    if tenant is None:
        return "appeal_id = ?", (appeal_id,)
    return "appeal_id = ? AND tenant = ?", (appeal_id, tenant)


def _find(conn: Conn, tenant: str | None, appeal_id: str) -> Appeal:
    where, args = _scoped(tenant, appeal_id)
    row = conn.execute(f"SELECT {APPEAL_COLUMNS} FROM appeals WHERE {where}", args).fetchone()
    if row is None:
        raise AppealNotFoundError(f"no appeal {appeal_id!r}")
    return appeal_from_row(row)


def _event_row(event: AppealEvent) -> tuple[Any, ...]:
    return tuple(getattr(event, name) for name in EVENT_FIELDS)


class SqliteAppealStore:
    """An `AppealStore` in one SQLite file (the audit store's), or in memory for ":memory:"."""

    def __init__(self, db: SqliteWorker) -> None:
        """Use `open`; this takes a worker whose database is already migrated."""
        self._db = db

    @classmethod
    async def open(cls, path: str | Path) -> SqliteAppealStore:
        """Open (creating if needed) and migrate the database at `path` (the audit store's file)."""
        db = await SqliteWorker.open(
            path, migrations=MIGRATIONS, table=MIGRATIONS_TABLE, foreign_keys=True, name="appeals"
        )
        return cls(db)

    async def _run(self, fn: Callable[[Conn], T]) -> T:
        if self._db.closed:
            raise AuditStoreError("the appeal store is closed")
        try:
            return await self._db.run(fn)
        except sqlite3.OperationalError as exc:
            raise AuditUnavailableError(f"the appeal database is unavailable: {exc}") from exc

    async def file(
        self, *, tenant: str, request_id: str, decision_seq: int, reason: str, filed_by: str, now: float
    ) -> Appeal:
        """Open an appeal of the decision (and its filing event); AppealConflictError if it has one."""
        appeal = Appeal(
            appeal_id=new_appeal_id(),
            tenant=tenant,
            request_id=request_id,
            decision_seq=decision_seq,
            reason=reason,
            state="open",
            filed_by=filed_by,
            filed_at=float(now),
            updated_at=float(now),
        )
        filed = AppealEvent(
            appeal_id=appeal.appeal_id,
            n=1,
            at=appeal.filed_at,
            actor=filed_by,
            from_state=None,
            to_state="open",
        )

        def file(conn: Conn) -> None:
            with transaction(conn):
                conn.execute(_INSERT, tuple(getattr(appeal, name) for name in APPEAL_FIELDS))
                conn.execute(_INSERT_EVENT, _event_row(filed))

        try:
            await self._run(file)
        except sqlite3.IntegrityError as exc:
            raise AppealConflictError(
                f"decision {decision_seq} of tenant {tenant!r} has already been appealed"
            ) from exc
        return appeal

    async def get(self, tenant: str | None, appeal_id: str) -> Appeal:
        """One appeal, or AppealNotFoundError."""
        return await self._run(lambda conn: _find(conn, tenant, appeal_id))

    async def list(
        self,
        tenant: str | None,
        state: AppealState | tuple[AppealState, ...] | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> builtins.list[Appeal]:
        """A page of appeals, ordered by (filed_at, appeal_id), after the appeal `after`."""
        where: builtins.list[str] = []
        args: builtins.list[Any] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        states = states_of(state)
        if states is not None:
            where.append(f"state IN ({', '.join('?' for _ in states)})")
            args.extend(states)
        if after is not None:
            # The keyset row is looked up in the caller's view too: an unseen id matches nothing.
            key_where, key_args = _scoped(tenant, after)
            where.append(
                f"(filed_at, appeal_id) > (SELECT filed_at, appeal_id FROM appeals WHERE {key_where})"
            )
            args.extend(key_args)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        sql = f"SELECT {APPEAL_COLUMNS} FROM appeals {clause} ORDER BY filed_at, appeal_id LIMIT ?"
        args.append(page_size(limit))
        rows = await self._run(lambda conn: conn.execute(sql, args).fetchall())
        return [appeal_from_row(row) for row in rows]

    async def for_decisions(self, tenant: str, seqs: Collection[int]) -> builtins.list[Appeal]:
        """The appeals of the tenant's decisions `seqs` (by the one-appeal-per-decision index)."""
        wanted = sorted({int(seq) for seq in seqs})

        def read(conn: Conn) -> builtins.list[Appeal]:
            found: builtins.list[Appeal] = []
            for start in range(0, len(wanted), _SEQS_PER_QUERY):
                chunk = wanted[start : start + _SEQS_PER_QUERY]
                sql = (
                    f"SELECT {APPEAL_COLUMNS} FROM appeals WHERE tenant = ? "
                    f"AND decision_seq IN ({', '.join('?' for _ in chunk)})"
                )
                found.extend(appeal_from_row(row) for row in conn.execute(sql, (tenant, *chunk)))
            return found

        return await self._run(read)

    async def transition(
        self, tenant: str | None, appeal_id: str, to_state: str, *, actor: str, note: str, now: float
    ) -> Appeal:
        """Move the appeal to `to_state` and append the event, in one transaction."""

        def step(conn: Conn) -> Appeal:
            with transaction(conn):
                appeal = _find(conn, tenant, appeal_id)
                target = check_transition(appeal, to_state)
                conn.execute(_SET_STATE, (target, float(now), appeal_id))
                (n,) = conn.execute(_NEXT_EVENT, (appeal_id,)).fetchone()
                event = AppealEvent(
                    appeal_id=appeal_id,
                    n=int(n),
                    at=float(now),
                    actor=actor,
                    from_state=appeal.state,
                    to_state=target,
                    note=note,
                )
                conn.execute(_INSERT_EVENT, _event_row(event))
            return msgspec.structs.replace(appeal, state=target, updated_at=float(now))

        return await self._run(step)

    async def events(self, tenant: str | None, appeal_id: str) -> builtins.list[AppealEvent]:
        """The appeal's events in order, or AppealNotFoundError."""

        def read(conn: Conn) -> builtins.list[AppealEvent]:
            conn.execute("BEGIN")
            try:
                _find(conn, tenant, appeal_id)
                return [event_from_row(row) for row in conn.execute(_EVENTS, (appeal_id,))]
            finally:
                conn.execute("COMMIT")

        return await self._run(read)

    async def close(self) -> None:
        """Close the connection and let the worker thread end. Safe to call twice."""
        await self._db.close()
