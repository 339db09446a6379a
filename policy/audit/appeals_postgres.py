"""`PostgresAppealStore`: appeals in the audit store's PostgreSQL schema (asyncpg pool).

A transition locks the appeal's row (`SELECT ... FOR UPDATE`) before reading its state, so two reviewers
deciding one appeal at once take turns: the second sees the first's state and gets InvalidTransitionError.
Losing the database (down, restarting, out of connections, a statement over `command_timeout`) raises
`AuditUnavailableError`.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

import asyncpg  # type: ignore[import-untyped]
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
from policy.audit.base import AuditUnavailableError
from policy.audit.migrations import MIGRATIONS, MIGRATIONS_TABLE
from registry.db.postgres import UNREACHABLE, open_pool

# The audit store's lock: both stores apply the same migrations to the same table.
_MIGRATION_LOCK = 0x4C6B6774_61756469


def _placeholders(count: int, start: int = 1) -> str:
    return ", ".join(f"${i}" for i in range(start, start + count))


_INSERT = f"INSERT INTO appeals ({APPEAL_COLUMNS}) VALUES ({_placeholders(len(APPEAL_FIELDS))})"
_INSERT_EVENT = f"INSERT INTO appeal_events ({EVENT_COLUMNS}) VALUES ({_placeholders(len(EVENT_FIELDS))})"
_SET_STATE = "UPDATE appeals SET state = $2, updated_at = $3 WHERE appeal_id = $1"
_NEXT_EVENT = "SELECT COALESCE(MAX(n), 0) + 1 FROM appeal_events WHERE appeal_id = $1"
_EVENTS = f"SELECT {EVENT_COLUMNS} FROM appeal_events WHERE appeal_id = $1 ORDER BY n"
# Code-point order on ids on every server, whatever its default collation.
_ORDER = 'filed_at, appeal_id COLLATE "C"'


def _scoped(tenant: str | None, appeal_id: str, start: int = 1) -> tuple[str, list[Any]]:
    """The WHERE clause (placeholders from `start`) selecting one appeal the caller may see."""
    if tenant is None:
        return f"appeal_id = ${start}", [appeal_id]
    return f"appeal_id = ${start} AND tenant = ${start + 1}", [appeal_id, tenant]


async def _find(conn: Any, tenant: str | None, appeal_id: str, *, lock: bool = False) -> Appeal:
    where, args = _scoped(tenant, appeal_id)
    sql = f"SELECT {APPEAL_COLUMNS} FROM appeals WHERE {where}{' FOR UPDATE' if lock else ''}"
    row = await conn.fetchrow(sql, *args)
    if row is None:
        raise AppealNotFoundError(f"no appeal {appeal_id!r}")
    return appeal_from_row(row)


class PostgresAppealStore:
    """An `AppealStore` in one PostgreSQL schema (the audit store's)."""

    def __init__(self, pool: Any) -> None:
        """Use `open`; this takes an asyncpg pool whose schema is already migrated."""
        self._pool = pool

    @classmethod
    async def open(
        cls,
        dsn: str,
        *,
        schema: str = "public",
        min_size: int = 1,
        max_size: int = 5,
        connect_timeout: float = 5.0,
        command_timeout: float = 10.0,
    ) -> PostgresAppealStore:
        """Connect to `dsn`, create `schema` if missing, and migrate it (time limits: `open_pool`)."""
        pool = await open_pool(
            dsn,
            schema=schema,
            migrations=MIGRATIONS,
            table=MIGRATIONS_TABLE,
            lock_key=_MIGRATION_LOCK,
            min_size=min_size,
            max_size=max_size,
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
        )
        return cls(pool)

    @asynccontextmanager
    async def _conn(self, *, write: bool = False) -> AsyncIterator[Any]:
        """A pooled connection, in a transaction if `write`; losing the database is AuditUnavailableError."""
        try:
            async with self._pool.acquire() as conn:
                if write:
                    async with conn.transaction():
                        yield conn
                else:
                    yield conn
        except UNREACHABLE as exc:
            raise AuditUnavailableError(f"the appeal database is unreachable: {exc!r}") from exc

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
        try:
            async with self._conn(write=True) as conn:
                await conn.execute(_INSERT, *(getattr(appeal, name) for name in APPEAL_FIELDS))
                await conn.execute(_INSERT_EVENT, *(getattr(filed, name) for name in EVENT_FIELDS))
        except asyncpg.UniqueViolationError as exc:
            raise AppealConflictError(
                f"decision {decision_seq} of tenant {tenant!r} has already been appealed"
            ) from exc
        return appeal

    async def get(self, tenant: str | None, appeal_id: str) -> Appeal:
        """One appeal, or AppealNotFoundError."""
        async with self._conn() as conn:
            return await _find(conn, tenant, appeal_id)

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
            args.append(tenant)
            where.append(f"tenant = ${len(args)}")
        states = states_of(state)
        if states is not None:
            args.append(list(states))
            where.append(f"state = ANY(${len(args)}::text[])")
        if after is not None:
            # The keyset row is looked up in the caller's view too: an unseen id matches nothing.
            key_where, key_args = _scoped(tenant, after, start=len(args) + 1)
            args.extend(key_args)
            where.append(
                '(filed_at, appeal_id COLLATE "C") >'
                f' (SELECT filed_at, appeal_id COLLATE "C" FROM appeals WHERE {key_where})'
            )
        args.append(page_size(limit))
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        sql = f"SELECT {APPEAL_COLUMNS} FROM appeals {clause} ORDER BY {_ORDER} LIMIT ${len(args)}"
        async with self._conn() as conn:
            rows = await conn.fetch(sql, *args)
        return [appeal_from_row(row) for row in rows]

    async def for_decisions(self, tenant: str, seqs: Collection[int]) -> builtins.list[Appeal]:
        """The appeals of the tenant's decisions `seqs` (by the one-appeal-per-decision index)."""
        sql = f"SELECT {APPEAL_COLUMNS} FROM appeals WHERE tenant = $1 AND decision_seq = ANY($2::bigint[])"
        async with self._conn() as conn:
            rows = await conn.fetch(sql, tenant, sorted({int(seq) for seq in seqs}))
        return [appeal_from_row(row) for row in rows]

    async def transition(
        self, tenant: str | None, appeal_id: str, to_state: str, *, actor: str, note: str, now: float
    ) -> Appeal:
        """Move the appeal to `to_state` and append the event, in one transaction."""
        async with self._conn(write=True) as conn:
            appeal = await _find(conn, tenant, appeal_id, lock=True)
            target = check_transition(appeal, to_state)
            await conn.execute(_SET_STATE, appeal_id, target, float(now))
            n = await conn.fetchval(_NEXT_EVENT, appeal_id)
            await conn.execute(
                _INSERT_EVENT, appeal_id, int(n), float(now), actor, appeal.state, target, note
            )
        return msgspec.structs.replace(appeal, state=target, updated_at=float(now))

    async def events(self, tenant: str | None, appeal_id: str) -> builtins.list[AppealEvent]:
        """The appeal's events in order, or AppealNotFoundError."""
        async with self._conn(write=True) as conn:
            await _find(conn, tenant, appeal_id)
            rows = await conn.fetch(_EVENTS, appeal_id)
        return [event_from_row(row) for row in rows]

    async def close(self) -> None:
        """Close the pool (waiting for connections in use to be released)."""
        await self._pool.close()
