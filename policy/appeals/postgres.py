"""`PostgresAppealStore`: appeals in the audit store's PostgreSQL schema (asyncpg pool).

A transition locks the appeal's row (`SELECT ... FOR UPDATE`) before reading its state, so two reviewers
deciding one appeal at once take turns: the second sees the first's state and gets InvalidTransitionError.
Losing the database (down, restarting, out of connections, a statement over `command_timeout`) raises
`AuditUnavailableError`.
"""

from __future__ import annotations

import builtins
from collections.abc import Collection
from typing import Any

import asyncpg  # type: ignore[import-untyped]

from policy.appeals import sql
from policy.appeals.base import (
    NO_FILTER,
    Appeal,
    AppealClaim,
    AppealEvent,
    AppealEvidence,
    AppealFacets,
    AppealFilter,
    AppealNotFoundError,
    AppealState,
    SharedContent,
    check_claim,
    check_claimable,
    conflict,
    filing,
    step,
)
from policy.appeals.reasons import ReasonCode
from policy.audit.base import AuditUnavailableError
from policy.audit.migrations import MIGRATIONS, MIGRATIONS_TABLE
from policy.audit.postgres import PostgresAuditStore
from registry.db.postgres import PostgresStore, numbered

_INSERT = numbered(sql.INSERT)
_INSERT_EVENT = numbered(sql.INSERT_EVENT)
_SET_STATE = numbered(sql.SET_STATE)
_NEXT_EVENT = numbered(sql.NEXT_EVENT)
_EVENTS = numbered(sql.EVENTS)
_INSERT_EVIDENCE = numbered(sql.INSERT_EVIDENCE)
_EVIDENCE = numbered(sql.EVIDENCE)
_PURGE_EVIDENCE = numbered(sql.PURGE_EVIDENCE)
_CLAIM = numbered(sql.CLAIM)
_HOLDER = numbered(sql.HOLDER)
_RELEASE = numbered(sql.RELEASE)
_LIVE_CLAIMS = (
    f"SELECT {sql.CLAIM_COLUMNS} FROM appeal_claims WHERE appeal_id = ANY($1::text[]) AND expires_at >= $2"
)
_FOR_DECISIONS = (
    f"SELECT {sql.APPEAL_COLUMNS} FROM appeals WHERE tenant = $1 AND decision_seq = ANY($2::bigint[])"
)


async def _find(conn: Any, tenant: str | None, appeal_id: str, *, lock: bool = False) -> Appeal:
    statement, args = sql.find(tenant, appeal_id, lock=lock)
    row = await conn.fetchrow(numbered(statement), *args)
    if row is None:
        raise AppealNotFoundError(f"no appeal {appeal_id!r}")
    return sql.appeal_from_row(row)


class PostgresAppealStore(PostgresStore):
    """An `AppealStore` in one PostgreSQL schema (the audit store's)."""

    what = "appeal"
    unavailable = AuditUnavailableError
    migrations = MIGRATIONS
    migrations_table = MIGRATIONS_TABLE
    # The audit store's lock: both stores apply the same migrations to the same table.
    lock_key = PostgresAuditStore.lock_key
    max_connections = 5

    async def file(
        self,
        *,
        tenant: str,
        request_id: str,
        decision_seq: int,
        reason: str,
        filed_by: str,
        now: float,
        shared: SharedContent | None = None,
        facets: AppealFacets | None = None,
    ) -> Appeal:
        """Open an appeal of the decision (its filing event, the content shared with it);
        AppealConflictError if it has one."""
        appeal, filed, evidence = filing(
            tenant=tenant,
            request_id=request_id,
            decision_seq=decision_seq,
            reason=reason,
            filed_by=filed_by,
            now=now,
            shared=shared,
            facets=facets,
        )
        try:
            async with self._conn(write=True) as conn:
                await conn.execute(_INSERT, *sql.appeal_row(appeal))
                await conn.execute(_INSERT_EVENT, *sql.event_row(filed))
                if evidence is not None:
                    await conn.execute(_INSERT_EVIDENCE, *sql.evidence_row(evidence))
        except asyncpg.UniqueViolationError as exc:
            raise conflict(tenant, decision_seq) from exc
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
        filters: AppealFilter = NO_FILTER,
    ) -> builtins.list[Appeal]:
        """A page of appeals, ordered by (filed_at, appeal_id), after the appeal `after`."""
        # Code-point order on ids on every server, whatever its default collation.
        statement, args = sql.list_query(tenant, state, limit, after, filters, collate=' COLLATE "C"')
        async with self._conn() as conn:
            rows = await conn.fetch(numbered(statement), *args)
        return [sql.appeal_from_row(row) for row in rows]

    async def counts(
        self,
        tenant: str | None,
        state: AppealState | tuple[AppealState, ...] | None = None,
        filters: AppealFilter = NO_FILTER,
    ) -> dict[str, dict[str, int]]:
        """The selected appeals counted by each facet's value."""
        found: dict[str, dict[str, int]] = {}
        async with self._conn() as conn:
            for facet, statement, args in sql.count_queries(tenant, state, filters):
                rows = await conn.fetch(numbered(statement), *args)
                found[facet] = {row[0]: row[1] for row in rows}
        return found

    async def for_decisions(self, tenant: str, seqs: Collection[int]) -> builtins.list[Appeal]:
        """The appeals of the tenant's decisions `seqs` (by the one-appeal-per-decision index)."""
        async with self._conn() as conn:
            rows = await conn.fetch(_FOR_DECISIONS, tenant, sorted({int(seq) for seq in seqs}))
        return [sql.appeal_from_row(row) for row in rows]

    async def transition(
        self,
        tenant: str | None,
        appeal_id: str,
        to_state: str,
        *,
        actor: str,
        note: str,
        now: float,
        reason: ReasonCode | None = None,
        facts: str = "",
    ) -> Appeal:
        """Move the appeal to `to_state` and append the event, in one transaction."""
        async with self._conn(write=True) as conn:
            appeal = await _find(conn, tenant, appeal_id, lock=True)
            check_claim(sql.claim_from_row(await conn.fetchrow(_HOLDER, appeal_id)), actor, now)
            n = await conn.fetchval(_NEXT_EVENT, appeal_id)
            after, event = step(
                appeal, to_state, n=n, actor=actor, note=note, now=now, reason=reason, facts=facts
            )
            await conn.execute(_SET_STATE, after.state, after.updated_at, appeal_id)
            await conn.execute(_INSERT_EVENT, *sql.event_row(event))
        return after

    async def events(self, tenant: str | None, appeal_id: str) -> builtins.list[AppealEvent]:
        """The appeal's events in order, or AppealNotFoundError."""
        async with self._conn(write=True) as conn:
            await _find(conn, tenant, appeal_id)
            rows = await conn.fetch(_EVENTS, appeal_id)
        return [sql.event_from_row(row) for row in rows]

    async def evidence(self, tenant: str | None, appeal_id: str) -> AppealEvidence | None:
        """The content shared with the appeal, or None; AppealNotFoundError outside the caller's view."""
        async with self._conn() as conn:
            await _find(conn, tenant, appeal_id)
            row = await conn.fetchrow(_EVIDENCE, appeal_id)
        return None if row is None else sql.evidence_from_row(row)

    async def purge_evidence(self, now: float) -> int:
        """Delete the shared content past its `expires_at`."""
        async with self._conn(write=True) as conn:
            status = await conn.execute(_PURGE_EVIDENCE, now)
        return int(status.split()[-1])

    async def claim(
        self, tenant: str | None, appeal_id: str, reviewer: str, *, now: float, lease: float
    ) -> AppealClaim:
        """Claim (or renew the claim on) an undecided appeal, unless another reviewer's claim is live."""
        async with self._conn(write=True) as conn:
            check_claimable(await _find(conn, tenant, appeal_id, lock=True))
            row = await conn.fetchrow(_CLAIM, appeal_id, reviewer, now + lease, now)
            held = sql.claim_from_row(row or await conn.fetchrow(_HOLDER, appeal_id))
        assert held is not None  # the insert landed, or a live claim stopped it
        check_claim(held, reviewer, now)
        return held

    async def release(self, tenant: str | None, appeal_id: str, reviewer: str) -> bool:
        """Drop the reviewer's claim on the appeal."""
        async with self._conn(write=True) as conn:
            await _find(conn, tenant, appeal_id)
            status = await conn.execute(_RELEASE, appeal_id, reviewer)
        return bool(int(status.split()[-1]))

    async def claims(self, appeal_ids: Collection[str], now: float) -> dict[str, AppealClaim]:
        """The live claims on these appeals."""
        if not appeal_ids:
            return {}
        async with self._conn() as conn:
            rows = await conn.fetch(_LIVE_CLAIMS, sorted(set(appeal_ids)), now)
        claims = [sql.claim_from_row(row) for row in rows]
        return {c.appeal_id: c for c in claims if c is not None}
