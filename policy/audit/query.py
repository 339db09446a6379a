"""`query_sql`: one `AuditQuery` as a SELECT for either dialect (the filters are the same SQL on both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from policy.audit.base import AuditQuery
from policy.audit.migrations import RECORD_COLUMNS
from registry.db.migrations import Dialect

# Tenants order by code point on both databases, whatever PostgreSQL's default collation.
_TENANT: dict[Dialect, str] = {"sqlite": "tenant", "postgres": 'tenant COLLATE "C"'}


def policy_condition(policy: str, arg: Callable[[Any], str]) -> str:
    """The condition on a `policy` column that a policy filter means: "name@version" exactly, a bare name
    every version of it (substr, not LIKE, so "_" and "%" in a name are literal); `arg` adds a value and
    returns its placeholder."""
    if "@" in policy:
        return f"policy = {arg(policy)}"
    prefix = f"{policy}@"
    return f"substr(policy, 1, {arg(len(prefix))}) = {arg(prefix)}"


def query_sql(q: AuditQuery, dialect: Dialect) -> tuple[str, list[Any]]:
    """The statement and its arguments selecting `q`'s page, ordered by (tenant, seq)."""
    args: list[Any] = []

    def arg(value: Any) -> str:
        args.append(value)
        return "?" if dialect == "sqlite" else f"${len(args)}"

    tenant = _TENANT[dialect]
    where: list[str] = []
    if q.tenant is not None:
        where.append(f"tenant = {arg(q.tenant)}")
    if q.since is not None:
        where.append(f"at >= {arg(float(q.since))}")
    if q.until is not None:
        where.append(f"at < {arg(float(q.until))}")
    if q.decision is not None:
        where.append(f"decision = {arg(q.decision)}")
    if q.stage is not None:
        where.append(f"stage = {arg(q.stage)}")
    if q.category is not None:
        where.append(f"category = {arg(q.category)}")
    if q.policy is not None:
        where.append(policy_condition(q.policy, arg))
    if q.fail_open_only:
        where.append("source = 'fail_open'")
    if q.flagged_only:
        where.append("flagged = 1")
    after_tenant = q.after_tenant if q.after_tenant is not None else q.tenant
    if after_tenant is not None:
        # Keyset: strictly after (after_tenant, after_seq) in (tenant, seq) order.
        t1, t2, s = arg(after_tenant), arg(after_tenant), arg(int(q.after_seq))
        where.append(f"({tenant} > {t1} OR (tenant = {t2} AND seq > {s}))")
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    limit = arg(q.page_size())
    sql = f"SELECT {RECORD_COLUMNS} FROM audit_records{clause} ORDER BY {tenant}, seq LIMIT {limit}"
    return sql, args
