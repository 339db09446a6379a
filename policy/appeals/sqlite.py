"""`SqliteAppealStore`: appeals in the audit store's SQLite file, on one worker thread.

Each write is one `BEGIN IMMEDIATE` transaction, so reading an appeal's state, changing it and appending its
event cannot interleave with another writer (another task, a replica, the CLI). An operational error (the
file locked past `busy_timeout`, a disk error) is `AuditUnavailableError`.
"""

from __future__ import annotations

import builtins
import sqlite3
from collections.abc import Collection

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
from policy.audit.base import AuditStoreError, AuditUnavailableError
from policy.audit.migrations import MIGRATIONS, MIGRATIONS_TABLE
from registry.db.sqlite import Conn, SqliteStore, transaction

# Decision seqs asked in one statement (well under SQLite's bound on parameters).
_SEQS_PER_QUERY = 500


def _find(conn: Conn, tenant: str | None, appeal_id: str) -> Appeal:
    row = conn.execute(*sql.find(tenant, appeal_id)).fetchone()
    if row is None:
        raise AppealNotFoundError(f"no appeal {appeal_id!r}")
    return sql.appeal_from_row(row)


class SqliteAppealStore(SqliteStore):
    """An `AppealStore` in one SQLite file (the audit store's), or in memory for ":memory:"."""

    what = "appeal"
    unavailable = AuditUnavailableError
    closed_error = AuditStoreError
    migrations = MIGRATIONS
    migrations_table = MIGRATIONS_TABLE
    foreign_keys = True

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

        def file(conn: Conn) -> None:
            with transaction(conn):
                conn.execute(sql.INSERT, sql.appeal_row(appeal))
                conn.execute(sql.INSERT_EVENT, sql.event_row(filed))
                if evidence is not None:
                    conn.execute(sql.INSERT_EVIDENCE, sql.evidence_row(evidence))

        try:
            await self._run(file)
        except sqlite3.IntegrityError as exc:
            raise conflict(tenant, decision_seq) from exc
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
        filters: AppealFilter = NO_FILTER,
    ) -> builtins.list[Appeal]:
        """A page of appeals, ordered by (filed_at, appeal_id), after the appeal `after`."""
        statement, args = sql.list_query(tenant, state, limit, after, filters)
        rows = await self._run(lambda conn: conn.execute(statement, args).fetchall())
        return [sql.appeal_from_row(row) for row in rows]

    async def counts(
        self,
        tenant: str | None,
        state: AppealState | tuple[AppealState, ...] | None = None,
        filters: AppealFilter = NO_FILTER,
    ) -> dict[str, dict[str, int]]:
        """The selected appeals counted by each facet's value."""

        def read(conn: Conn) -> dict[str, dict[str, int]]:
            return {
                facet: {value: count for value, count in conn.execute(statement, args)}
                for facet, statement, args in sql.count_queries(tenant, state, filters)
            }

        return await self._run(read)

    async def for_decisions(self, tenant: str, seqs: Collection[int]) -> builtins.list[Appeal]:
        """The appeals of the tenant's decisions `seqs` (by the one-appeal-per-decision index)."""
        wanted = sorted({int(seq) for seq in seqs})

        def read(conn: Conn) -> builtins.list[Appeal]:
            found: builtins.list[Appeal] = []
            for start in range(0, len(wanted), _SEQS_PER_QUERY):
                chunk = wanted[start : start + _SEQS_PER_QUERY]
                statement = (
                    f"SELECT {sql.APPEAL_COLUMNS} FROM appeals WHERE tenant = ? "
                    f"AND decision_seq IN ({', '.join('?' for _ in chunk)})"
                )
                found.extend(sql.appeal_from_row(row) for row in conn.execute(statement, (tenant, *chunk)))
            return found

        return await self._run(read)

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

        def move(conn: Conn) -> Appeal:
            with transaction(conn):
                appeal = _find(conn, tenant, appeal_id)
                check_claim(sql.claim_from_row(conn.execute(sql.HOLDER, (appeal_id,)).fetchone()), actor, now)
                (n,) = conn.execute(sql.NEXT_EVENT, (appeal_id,)).fetchone()
                after, event = step(
                    appeal, to_state, n=n, actor=actor, note=note, now=now, reason=reason, facts=facts
                )
                conn.execute(sql.SET_STATE, (after.state, after.updated_at, appeal_id))
                conn.execute(sql.INSERT_EVENT, sql.event_row(event))
            return after

        return await self._run(move)

    async def events(self, tenant: str | None, appeal_id: str) -> builtins.list[AppealEvent]:
        """The appeal's events in order, or AppealNotFoundError."""

        def read(conn: Conn) -> builtins.list[AppealEvent]:
            conn.execute("BEGIN")
            try:
                _find(conn, tenant, appeal_id)
                return [sql.event_from_row(row) for row in conn.execute(sql.EVENTS, (appeal_id,))]
            finally:
                conn.execute("COMMIT")

        return await self._run(read)

    async def evidence(self, tenant: str | None, appeal_id: str) -> AppealEvidence | None:
        """The content shared with the appeal, or None; AppealNotFoundError outside the caller's view."""

        def read(conn: Conn) -> AppealEvidence | None:
            conn.execute("BEGIN")
            try:
                _find(conn, tenant, appeal_id)
                row = conn.execute(sql.EVIDENCE, (appeal_id,)).fetchone()
            finally:
                conn.execute("COMMIT")
            return None if row is None else sql.evidence_from_row(row)

        return await self._run(read)

    async def purge_evidence(self, now: float) -> int:
        """Delete the shared content past its `expires_at`."""

        def purge(conn: Conn) -> int:
            with transaction(conn):
                return conn.execute(sql.PURGE_EVIDENCE, (now,)).rowcount

        return await self._run(purge)

    async def claim(
        self, tenant: str | None, appeal_id: str, reviewer: str, *, now: float, lease: float
    ) -> AppealClaim:
        """Claim (or renew the claim on) an undecided appeal, unless another reviewer's claim is live."""

        def take(conn: Conn) -> AppealClaim:
            with transaction(conn):
                check_claimable(_find(conn, tenant, appeal_id))
                row = conn.execute(sql.CLAIM, (appeal_id, reviewer, now + lease, now)).fetchone()
                held = sql.claim_from_row(row or conn.execute(sql.HOLDER, (appeal_id,)).fetchone())
            assert held is not None  # the insert landed, or a live claim stopped it
            check_claim(held, reviewer, now)
            return held

        return await self._run(take)

    async def release(self, tenant: str | None, appeal_id: str, reviewer: str) -> bool:
        """Drop the reviewer's claim on the appeal."""

        def drop(conn: Conn) -> bool:
            with transaction(conn):
                _find(conn, tenant, appeal_id)
                return conn.execute(sql.RELEASE, (appeal_id, reviewer)).rowcount > 0

        return await self._run(drop)

    async def claims(self, appeal_ids: Collection[str], now: float) -> dict[str, AppealClaim]:
        """The live claims on these appeals."""
        wanted = sorted(set(appeal_ids))

        def read(conn: Conn) -> dict[str, AppealClaim]:
            found: dict[str, AppealClaim] = {}
            for start in range(0, len(wanted), _SEQS_PER_QUERY):
                chunk = wanted[start : start + _SEQS_PER_QUERY]
                for row in conn.execute(sql.live_claims(len(chunk)), (*chunk, now)):
                    claim = sql.claim_from_row(row)
                    assert claim is not None
                    found[claim.appeal_id] = claim
            return found

        return await self._run(read) if wanted else {}
