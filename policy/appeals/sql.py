"""The statements both appeal stores run, and how appeals and events map to rows.

Statements use SQLite's `?` placeholders; the PostgreSQL store runs them through
`registry.db.postgres.numbered`. Column lists are fixed so rows decode by position on both drivers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from policy.appeals.base import (
    FACETS,
    NO_FILTER,
    Appeal,
    AppealClaim,
    AppealEvent,
    AppealEvidence,
    AppealFilter,
    AppealState,
    page_size,
    states_of,
)
from policy.audit.migrations import read_content, stored_content
from policy.audit.query import policy_condition

# Column order of the appeals and appeal_events tables; rows decode by position on both drivers.
APPEAL_FIELDS: tuple[str, ...] = Appeal.__struct_fields__
APPEAL_COLUMNS = ", ".join(APPEAL_FIELDS)
EVENT_FIELDS: tuple[str, ...] = AppealEvent.__struct_fields__
EVENT_COLUMNS = ", ".join(EVENT_FIELDS)

INSERT = f"INSERT INTO appeals ({APPEAL_COLUMNS}) VALUES ({', '.join('?' for _ in APPEAL_FIELDS)})"
INSERT_EVENT = f"INSERT INTO appeal_events ({EVENT_COLUMNS}) VALUES ({', '.join('?' for _ in EVENT_FIELDS)})"
SET_STATE = "UPDATE appeals SET state = ?, updated_at = ? WHERE appeal_id = ?"
NEXT_EVENT = "SELECT COALESCE(MAX(n), 0) + 1 FROM appeal_events WHERE appeal_id = ?"
EVENTS = f"SELECT {EVENT_COLUMNS} FROM appeal_events WHERE appeal_id = ? ORDER BY n"
EVIDENCE_FIELDS: tuple[str, ...] = AppealEvidence.__struct_fields__
EVIDENCE_COLUMNS = ", ".join(EVIDENCE_FIELDS)
INSERT_EVIDENCE = (
    f"INSERT INTO appeal_evidence ({EVIDENCE_COLUMNS}) VALUES ({', '.join('?' for _ in EVIDENCE_FIELDS)})"
)
EVIDENCE = f"SELECT {EVIDENCE_COLUMNS} FROM appeal_evidence WHERE appeal_id = ?"
PURGE_EVIDENCE = "DELETE FROM appeal_evidence WHERE expires_at < ?"
CLAIM_COLUMNS = "appeal_id, reviewer, expires_at"
# Take or renew a claim in one statement: it lands unless another reviewer's claim is still live.
CLAIM = (
    f"INSERT INTO appeal_claims ({CLAIM_COLUMNS}) VALUES (?, ?, ?) ON CONFLICT (appeal_id) DO UPDATE"
    " SET reviewer = excluded.reviewer, expires_at = excluded.expires_at"
    " WHERE appeal_claims.expires_at < ? OR appeal_claims.reviewer = excluded.reviewer"
    f" RETURNING {CLAIM_COLUMNS}"
)
HOLDER = f"SELECT {CLAIM_COLUMNS} FROM appeal_claims WHERE appeal_id = ?"
RELEASE = "DELETE FROM appeal_claims WHERE appeal_id = ? AND reviewer = ?"


def appeal_row(appeal: Appeal) -> tuple[Any, ...]:
    """An appeal as a row of APPEAL_COLUMNS."""
    return tuple(getattr(appeal, name) for name in APPEAL_FIELDS)


_encode = msgspec.json.Encoder()


def event_row(event: AppealEvent) -> tuple[Any, ...]:
    """An event as a row of EVENT_COLUMNS (its reason as JSON)."""
    row = {name: getattr(event, name) for name in EVENT_FIELDS}
    row["reason"] = None if event.reason is None else _encode.encode(event.reason).decode()
    return tuple(row.values())


def evidence_row(evidence: AppealEvidence) -> tuple[Any, ...]:
    """Shared content as a row of EVIDENCE_COLUMNS (content escaped where a store cannot hold it as is)."""
    row = {name: getattr(evidence, name) for name in EVIDENCE_FIELDS}
    row["content"] = stored_content(evidence.content)
    row["request_content"] = stored_content(evidence.request_content)
    return tuple(row.values())


def evidence_from_row(row: Iterable[Any]) -> AppealEvidence:
    """Shared content from a row selected as EVIDENCE_COLUMNS."""
    fields = dict(zip(EVIDENCE_FIELDS, row, strict=True))
    fields["content"] = read_content(fields["content"])
    fields["request_content"] = read_content(fields["request_content"])
    return msgspec.convert(fields, AppealEvidence)


def claim_from_row(row: Iterable[Any] | None) -> AppealClaim | None:
    """A claim from a row selected as CLAIM_COLUMNS (None for no row)."""
    if row is None:
        return None
    appeal_id, reviewer, expires_at = row
    return AppealClaim(appeal_id=appeal_id, reviewer=reviewer, expires_at=expires_at)


def live_claims(count: int) -> str:
    """The statement selecting the live claims of `count` appeal ids (then the time)."""
    marks = ", ".join("?" for _ in range(count))
    return f"SELECT {CLAIM_COLUMNS} FROM appeal_claims WHERE appeal_id IN ({marks}) AND expires_at >= ?"


def appeal_from_row(row: Iterable[Any]) -> Appeal:
    """An appeal from a row selected as APPEAL_COLUMNS."""
    return msgspec.convert(dict(zip(APPEAL_FIELDS, row, strict=True)), Appeal)


def event_from_row(row: Iterable[Any]) -> AppealEvent:
    """An event from a row selected as EVENT_COLUMNS."""
    fields = dict(zip(EVENT_FIELDS, row, strict=True))
    if fields["reason"] is not None:
        fields["reason"] = msgspec.json.decode(fields["reason"])
    return msgspec.convert(fields, AppealEvent)


def scoped(tenant: str | None, appeal_id: str) -> tuple[str, tuple[Any, ...]]:
    """The WHERE clause (and arguments) selecting one appeal the caller may see."""
    if tenant is None:
        return "appeal_id = ?", (appeal_id,)
    return "appeal_id = ? AND tenant = ?", (appeal_id, tenant)


def find(tenant: str | None, appeal_id: str, *, lock: bool = False) -> tuple[str, tuple[Any, ...]]:
    """The statement selecting one appeal in the caller's view (FOR UPDATE if `lock`: PostgreSQL only)."""
    where, args = scoped(tenant, appeal_id)
    return f"SELECT {APPEAL_COLUMNS} FROM appeals WHERE {where}{' FOR UPDATE' if lock else ''}", args


def _selection(
    tenant: str | None, state: AppealState | tuple[AppealState, ...] | None, filters: AppealFilter
) -> tuple[list[str], list[Any]]:
    """The WHERE conditions (and arguments) of the appeals of `tenant` in `state` matching `filters`."""
    where: list[str] = []
    args: list[Any] = []
    if tenant is not None:
        where.append("tenant = ?")
        args.append(tenant)
    states = states_of(state)
    if states is not None:
        # No states selects nothing (`IN ()` is not PostgreSQL).
        where.append(f"state IN ({', '.join('?' for _ in states)})" if states else "1 = 0")
        args.extend(states)
    for facet in ("decision", "stage", "source", "category", "severity"):
        value = getattr(filters, facet)
        if value is not None:
            where.append(f"{facet} = ?")
            args.append(value)
    if filters.policy is not None:

        def arg(value: Any) -> str:
            args.append(value)
            return "?"

        where.append(policy_condition(filters.policy, arg))
    if filters.filed_from is not None:
        where.append("filed_at >= ?")
        args.append(filters.filed_from)
    if filters.filed_to is not None:
        where.append("filed_at < ?")
        args.append(filters.filed_to)
    return where, args


def list_query(
    tenant: str | None,
    state: AppealState | tuple[AppealState, ...] | None,
    limit: int,
    after: str | None,
    filters: AppealFilter = NO_FILTER,
    *,
    collate: str = "",
) -> tuple[str, list[Any]]:
    """The statement of one `AppealStore.list` page, ordered by (filed_at, appeal_id) (descending for
    `filters.newest_first`): ids compared with `collate` (PostgreSQL's ` COLLATE "C"`: code-point order
    whatever the server's default)."""
    where, args = _selection(tenant, state, filters)
    direction, beyond = ("DESC", "<") if filters.newest_first else ("", ">")
    if after is not None:
        # The keyset row is looked up in the caller's view too: an unseen id matches nothing.
        key_where, key_args = scoped(tenant, after)
        where.append(
            f"(filed_at, appeal_id{collate}) {beyond}"
            f" (SELECT filed_at, appeal_id{collate} FROM appeals WHERE {key_where})"
        )
        args.extend(key_args)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    args.append(page_size(limit))
    order = f"ORDER BY filed_at {direction}, appeal_id{collate} {direction}"
    return f"SELECT {APPEAL_COLUMNS} FROM appeals {clause} {order} LIMIT ?", args


def count_queries(
    tenant: str | None, state: AppealState | tuple[AppealState, ...] | None, filters: AppealFilter
) -> list[tuple[str, str, list[Any]]]:
    """(facet, statement, arguments) counting the selected appeals by each facet's value."""
    where, args = _selection(tenant, state, filters)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    return [
        (facet, f"SELECT {facet}, COUNT(*) FROM appeals {clause} GROUP BY {facet}", list(args))
        for facet in FACETS
    ]
