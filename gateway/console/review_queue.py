"""The review queue, shared by the reviewer API and the console: appeals waiting for a decision, and flagged
(escalated) decisions that nobody has appealed or reviewed yet; and the review record a decided appeal leaves
in the audit chain (`record_review`), through which both decide.

Undecided appeals are listed a page at a time, oldest filed first, by keyset (`after` = the last appeal id
of the previous page): a page reads only undecided appeals, so neither the number decided nor the number
filed before it keeps a new appeal out of the queue.

A flagged decision enters the appeal workflow when a reviewer takes it up (`take_up`): an appeal is filed on
the reviewer's behalf (reason `FLAGGED_REASON`), and from then on it moves open -> in_review -> upheld |
overturned like any appeal. Until then it is listed beside the appeals, newest first, from the last
`QUEUE_WINDOW_S` of the audit trail (at most `QUEUE_MAX_RECORDS` flagged records read; `truncated` says when
more were left unread).

Store errors (AuditUnavailableError, AppealConflictError, ...) pass through: each caller maps them to its
own answer (JSON errors for the API, error pages for the console).
"""

from __future__ import annotations

import logging
from typing import get_args

import msgspec

from gateway.errors import StoreUnavailableError
from gateway.services import Services
from policy.appeals.base import (
    FACETS,
    NO_FILTER,
    UNDECIDED,
    Appeal,
    AppealClaim,
    AppealFacets,
    AppealFilter,
    AppealState,
    OwnAppealError,
)
from policy.appeals.reasons import ReasonCode
from policy.audit.base import MAX_QUERY_LIMIT, AuditQuery, AuditUnavailableError
from policy.audit.records import AuditDraft, AuditRecord, Decision, Stage
from policy.audit.writer import AuditWriterError

log = logging.getLogger("lockgate.appeals")

# The review record each decided state leaves in the audit chain.
REVIEW_DECISION: dict[str, Decision] = {"overturned": "reversal", "upheld": "uphold"}

QUEUE_WINDOW_S = 30 * 86400.0
QUEUE_MAX_RECORDS = 5000
FLAGGED_REASON = "flagged for review"
# The decisions a tenant may appeal (a flag is appealable too: it is reviewable either way).
APPEALABLE: frozenset[Decision] = frozenset({"block", "refuse", "flag"})


class AppealPage(msgspec.Struct, frozen=True, kw_only=True):
    """A page of appeals, oldest filed first: pass `last_id` as `after` for the next one while `has_more`."""

    object: str = "list"
    data: list[Appeal]
    has_more: bool
    last_id: str | None
    # The live claims on the page's appeals, by appeal id: who reviews it, until when.
    claims: dict[str, AppealClaim] = {}


class ReviewQueue(msgspec.Struct, frozen=True, kw_only=True):
    """What waits for a reviewer: a page of undecided appeals (oldest filed first; pass `last_id` as `after`
    for the next page while `has_more`) and flagged decisions without an appeal (newest first); `truncated`
    when the flagged ones were read only in part."""

    appeals: list[Appeal]
    has_more: bool
    last_id: str | None
    flagged: list[AuditRecord]
    truncated: bool
    # The live claims on the page's appeals, by appeal id.
    claims: dict[str, AppealClaim] = {}


class NotReviewableError(Exception):
    """The decision cannot be taken up for review (a review record itself, or neither appealable nor
    flagged)."""


def reviewable(record: AuditRecord) -> bool:
    """Whether a reviewer may uphold or overturn this decision (given no decided appeal of it)."""
    return record.stage != "review" and (record.decision in APPEALABLE or record.flagged)


async def appeal_page(
    services: Services,
    scope: str | None,
    state: AppealState | tuple[AppealState, ...] | None,
    limit: int,
    after: str | None,
    filters: AppealFilter = NO_FILTER,
) -> AppealPage:
    """At most `limit` appeals of `scope` (a tenant, or None for every tenant) in `state` matching
    `filters`, after `after`."""
    page = await services.appeals.list(scope, state, limit, after, filters)
    # A full page asks for one more row, so that the last page never claims a next one.
    more = len(page) >= limit and bool(
        await services.appeals.list(scope, state, 1, page[-1].appeal_id, filters)
    )
    undecided = [a.appeal_id for a in page if a.state in UNDECIDED]
    claims = await services.appeals.claims(undecided, services.clock())
    return AppealPage(data=page, has_more=more, last_id=page[-1].appeal_id if page else None, claims=claims)


async def review_queue(
    services: Services,
    scope: str | None,
    limit: int,
    after: str | None = None,
    filters: AppealFilter = NO_FILTER,
) -> ReviewQueue:
    """The queue of `scope` (a tenant, or None for every tenant): a page of at most `limit` undecided
    appeals matching `filters` after `after`, and at most `limit` flagged decisions nobody has appealed
    (matching `filters` too), newest first."""
    appeals = await appeal_page(services, scope, UNDECIDED, limit, after, filters)
    flagged, truncated = await unappealed_flags(services, scope, filters)
    return ReviewQueue(
        appeals=appeals.data,
        has_more=appeals.has_more,
        last_id=appeals.last_id,
        flagged=flagged[:limit],
        truncated=truncated or len(flagged) > limit,
        claims=appeals.claims,
    )


async def unappealed_flags(
    services: Services, scope: str | None, filters: AppealFilter
) -> tuple[list[AuditRecord], bool]:
    """The flagged decisions of `scope` nobody has appealed that match `filters` (their facets, `at` in the
    filing window), newest first; and whether the read was cut short."""
    read, truncated = await _flagged(services, scope, filters)
    appealed = await _appealed(services, read)
    kept = [r for r in read if (r.tenant, r.seq) not in appealed]
    return sorted(kept, key=lambda r: -r.at), truncated


def facet_counts(records: list[AuditRecord]) -> dict[str, dict[str, int]]:
    """`records` counted by each facet's value (as `AppealStore.counts` counts appeals)."""
    counts: dict[str, dict[str, int]] = {facet: {} for facet in FACETS}
    for record in records:
        values = msgspec.structs.asdict(facets_of(record)) | {"tenant": record.tenant}
        for facet in FACETS:
            counts[facet][values[facet]] = counts[facet].get(values[facet], 0) + 1
    return counts


async def appeal_of(services: Services, record: AuditRecord) -> Appeal | None:
    """The appeal of one decision, if it has one."""
    found = await services.appeals.for_decisions(record.tenant, [record.seq])
    return found[0] if found else None


async def _appealed(services: Services, records: list[AuditRecord]) -> set[tuple[str, int]]:
    """(tenant, seq) of those of `records` that have an appeal."""
    by_tenant: dict[str, set[int]] = {}
    for r in records:
        by_tenant.setdefault(r.tenant, set()).add(r.seq)
    found: set[tuple[str, int]] = set()
    for tenant, seqs in by_tenant.items():
        found.update((a.tenant, a.decision_seq) for a in await services.appeals.for_decisions(tenant, seqs))
    return found


async def _flagged(
    services: Services, scope: str | None, filters: AppealFilter
) -> tuple[list[AuditRecord], bool]:
    """The flagged decisions of `scope` in the queue's window matching `filters`: the facets the audit query
    knows (decision, stage, category, policy, time) are the store's filter, so the read bound counts
    matching records only; source and severity are checked here."""
    decision = next((d for d in get_args(Decision) if d == filters.decision), None)
    stage = next((s for s in get_args(Stage) if s == filters.stage), None)
    if (filters.decision, filters.stage) != (decision, stage):
        return [], False  # no record holds such a decision or stage
    since = services.clock() - QUEUE_WINDOW_S
    q = AuditQuery(
        tenant=scope,
        flagged_only=True,
        since=since if filters.filed_from is None else max(since, filters.filed_from),
        until=filters.filed_to,
        decision=decision,
        stage=stage,
        category=filters.category,
        policy=filters.policy,
        limit=MAX_QUERY_LIMIT,
    )
    found: list[AuditRecord] = []
    read = 0
    while read < QUEUE_MAX_RECORDS:
        page = await services.audit.query(q)
        read += len(page)
        found.extend(
            r
            for r in page
            if r.stage != "review"
            and filters.source in (None, r.source)
            and filters.severity in (None, r.severity or "")
        )
        if len(page) < q.page_size():
            return found, False
        q = q.after(page[-1])
    return found, True


def may_decide(services: Services, scope: str | None) -> bool:
    """Whether a reviewer of `scope` (None: the operating organisation's) may uphold or overturn appeals:
    with `[appeals] operator_reviewers_only`, only the operating organisation's reviewers may; the
    tenants' reviewers still read the queue, take decisions up and move appeals into review."""
    return scope is None or not services.config.appeals.operator_reviewers_only


def check_not_own(record: AuditRecord, appeal: Appeal | None, actor: str) -> None:
    """OwnAppealError when the reviewer key `actor` made the decision `record` itself, or filed its appeal
    (an appeal a reviewer filed by taking up a flagged decision is that reviewer's to decide)."""
    if actor == record.key_id:
        raise OwnAppealError(
            f"decision {record.tenant}/{record.seq} was made for this key; another reviewer decides it"
        )
    if appeal is not None and appeal.filed_by == actor and appeal.reason != FLAGGED_REASON:
        raise OwnAppealError(f"appeal {appeal.appeal_id} was filed by this key; another reviewer decides it")


async def take_up(services: Services, record: AuditRecord, actor: str, now: float) -> Appeal:
    """File the appeal through which a reviewer decides `record` (a flagged decision nobody appealed).
    NotReviewableError for a decision that cannot be reviewed; AppealConflictError when it has an appeal."""
    if not reviewable(record):
        raise NotReviewableError(
            f"decision {record.tenant}/{record.seq} ({record.decision}) cannot be reviewed: only blocks, "
            "refusals and flagged decisions can"
        )
    return await services.appeals.file(
        tenant=record.tenant,
        request_id=record.request_id,
        decision_seq=record.seq,
        reason=FLAGGED_REASON,
        filed_by=actor,
        now=now,
        facets=facets_of(record),
    )


def facets_of(record: AuditRecord) -> AppealFacets:
    """The facets an appeal of `record` keeps (the queue filters and counts by them)."""
    return AppealFacets(
        decision=record.decision,
        stage=record.stage,
        source=record.source,
        category=record.category or "",
        severity=record.severity or "",
        policy=record.policy,
    )


async def record_review(
    services: Services,
    original: AuditRecord,
    decision: Decision,
    reviewer: str,
    note: str,
    now: float,
    reason: ReasonCode,
) -> int | None:
    """Append the review record of a decided appeal of `original` (decision `reversal` or `uphold`, `reverses`
    = its seq, `actor` = the reviewer's key id, `detail` = the reason code and the note), durable before the
    answer; its seq once it is in the store
    (None while it waits in the writer's spool). The API and the reviewer console both decide through this.
    The appeal is already decided: a record that cannot be made durable is a 503 (StoreUnavailableError) the
    reviewer sees, and logged, never silently dropped."""
    draft = AuditDraft(
        tenant=original.tenant,
        key_id=original.key_id,
        request_id=original.request_id,
        at=now,
        stage="review",
        decision=decision,
        source="reviewer",
        policy=original.policy,
        policy_hash=original.policy_hash,
        category=original.category,
        severity=original.severity,
        content_hash=original.content_hash,
        detail=f"{reason.code}: {note}" if note else reason.code,
        reverses=original.seq,
        actor=reviewer,
    )
    try:
        await services.audit_writer.record(draft)
    except AuditWriterError as exc:
        log.error("review record of %s seq %d not recorded: %s", original.tenant, original.seq, exc)
        raise StoreUnavailableError(
            f"the appeal is decided but its {decision} record could not be made durable: {exc}",
            retry_after=1,
            code="audit_unavailable",
        ) from exc
    try:
        recorded = await services.audit.find(original.tenant, original.request_id)
    except AuditUnavailableError:
        return None
    reviews = [
        r for r in recorded if r.reverses == original.seq and r.actor == reviewer and r.decision == decision
    ]
    return reviews[-1].seq if reviews else None
