"""The review queue, shared by the reviewer API and the console: appeals waiting for a decision, and flagged
(escalated) decisions that nobody has appealed or reviewed yet.

A flagged decision enters the appeal workflow when a reviewer takes it up (`take_up`): an appeal is filed on
the reviewer's behalf (reason `FLAGGED_REASON`), and from then on it moves open -> in_review -> upheld |
overturned like any appeal. Until then it is listed beside the appeals, newest first, from the last
`QUEUE_WINDOW_S` of the audit trail (at most `QUEUE_MAX_RECORDS` flagged records read; `truncated` says when
more were left unread).

Store errors (AuditUnavailableError, AppealConflictError, ...) pass through: each caller maps them to its
own answer (JSON errors for the API, error pages for the console).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from gateway.service import Services
from policy.audit.appeals import MAX_APPEAL_LIMIT, Appeal, OwnAppealError
from policy.audit.base import MAX_QUERY_LIMIT, AuditQuery
from policy.audit.records import AuditRecord, Decision

QUEUE_WINDOW_S = 30 * 86400.0
QUEUE_MAX_RECORDS = 5000
MAX_APPEAL_PAGES = 20
FLAGGED_REASON = "flagged for review"
# The decisions a tenant may appeal (a flag is appealable too: it is reviewable either way).
APPEALABLE: frozenset[Decision] = frozenset({"block", "refuse", "flag"})


class ReviewQueue(msgspec.Struct, frozen=True, kw_only=True):
    """What waits for a reviewer: undecided appeals (newest filed first) and flagged decisions without an
    appeal (newest first); `truncated` when the flagged ones were read only in part."""

    appeals: list[Appeal]
    flagged: list[AuditRecord]
    truncated: bool


class NotReviewableError(Exception):
    """The decision cannot be taken up for review (a review record itself, or neither appealable nor
    flagged)."""


def reviewable(record: AuditRecord) -> bool:
    """Whether a reviewer may uphold or overturn this decision (given no decided appeal of it)."""
    return record.stage != "review" and (record.decision in APPEALABLE or record.flagged)


async def all_appeals(services: Services, tenant: str | None) -> list[Appeal]:
    """Every appeal of `tenant` (None: every tenant), page by page (at most MAX_APPEAL_PAGES pages)."""
    found: list[Appeal] = []
    after: str | None = None
    for _ in range(MAX_APPEAL_PAGES):
        page = await services.appeals.list(tenant, None, MAX_APPEAL_LIMIT, after)
        found.extend(page)
        if len(page) < MAX_APPEAL_LIMIT:
            break
        after = page[-1].appeal_id
    return found


async def review_queue(services: Services, scope: str | None, shown: int) -> ReviewQueue:
    """The queue of `scope` (a tenant, or None for every tenant), at most `shown` flagged decisions."""
    appeals = await all_appeals(services, scope)
    appealed = {(a.tenant, a.decision_seq) for a in appeals}
    pending = sorted((a for a in appeals if a.state in ("open", "in_review")), key=lambda a: -a.filed_at)
    flagged, truncated = await _flagged(services, scope, lambda r: (r.tenant, r.seq) not in appealed)
    flagged.sort(key=lambda r: -r.at)
    return ReviewQueue(appeals=pending, flagged=flagged[:shown], truncated=truncated or len(flagged) > shown)


async def _flagged(
    services: Services, scope: str | None, keep: Callable[[AuditRecord], bool]
) -> tuple[list[AuditRecord], bool]:
    q = AuditQuery(
        tenant=scope, flagged_only=True, since=services.clock() - QUEUE_WINDOW_S, limit=MAX_QUERY_LIMIT
    )
    found: list[AuditRecord] = []
    read = 0
    while read < QUEUE_MAX_RECORDS:
        page = await services.audit.query(q)
        read += len(page)
        found.extend(r for r in page if r.stage != "review" and keep(r))
        if len(page) < q.page_size():
            return found, False
        q = q.after(page[-1])
    return found, True


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
    )
