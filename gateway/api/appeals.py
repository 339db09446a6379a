"""Appeals over HTTP: consumers appeal their own tenant's decisions; reviewers decide them.

Consumers (role `consumer`)::

    POST /v1/appeals                            {request_id, reason, share_content?, content?,
                                                request_content?}: appeal
                                                the latest block, refusal or flag recorded for that
                                                request of the caller's tenant
    GET  /v1/appeals/{appeal_id}                the appeal and its events (own tenant only)

Evidence by consent (gateway.api.appeal_evidence): the consumer may share the content the gate checked with
the appeal, so that the reviewer does not decide blind; it is shown to reviewers of the tenant and of the
operating organisation only (`evidence` in the reviewers' views; consumers read `content_shared`), and
deleted by the retention pass once expired.

Reviewers (role `reviewer`; of their own tenant, or of every tenant for keys of the operator tenant)::

    GET  /audit/queue?limit=&after=&<filters>   what waits for review: a page of undecided appeals, oldest
                                                first, and flagged decisions nobody appealed yet
                                                (gateway.console.review_queue; filters and sort:
                                                gateway.console.queue_filters)
    GET  /audit/queue/counts?<filters>          how many match, in all and by each facet's value
    POST /audit/decisions/{tenant}/{seq}/appeal take up a flagged decision: files its appeal on the
                                                reviewer's behalf, to be decided like any other
    GET  /audit/appeals?state=&limit=&after=    the appeals, oldest first
    GET  /audit/appeals/{appeal_id}             the appeal and its events
    POST /audit/appeals/{appeal_id}/claim       take (or renew) the appeal for review: a lease of
                                                `[appeals] claim_lease` s, during which no other reviewer
                                                may step or decide it (409 `claimed`, naming the holder)
    DELETE /audit/appeals/{appeal_id}/claim     give it back (the caller's own claim only)
    POST /audit/appeals/{appeal_id}/transition  {to, note, reason_code, facts}: open -> in_review ->
                                                upheld | overturned; a decision needs a reason_code of
                                                `[appeals] reasons` for its outcome (400 `invalid_reason`)

With `[appeals] operator_reviewers_only`, only reviewers of the operator tenant may step an appeal to upheld
or overturned (403 `operator_only`, whether or not the appeal exists). Deciding an appeal appends a review
record to the decision's tenant's audit chain (decision `uphold` or `reversal`, `reverses` = the appealed
record's seq, `actor` = the reviewer's key id), durable before the answer; the appealed record itself is
never changed. Another tenant's appeal or decision is 404 (never 403, so ids cannot be probed), an invalid
step, a second appeal of a decision or taking up a decision that cannot be reviewed 409.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

import msgspec
from litestar import Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, QueryParameter
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from gateway.api.admin import ConflictAPIError
from gateway.api.appeal_evidence import MAX_SHARED_CONTENT, shared_content
from gateway.api.audit import reviewer_record
from gateway.api.openapi import errors, request_body, secured
from gateway.console.queue_filters import QUEUE_PARAMS, queue_query
from gateway.console.review_queue import (
    APPEALABLE,
    REVIEW_DECISION,
    AppealPage,
    NotReviewableError,
    ReviewQueue,
    appeal_page,
    check_not_own,
    facet_counts,
    facets_of,
    may_decide,
    record_review,
    review_queue,
    take_up,
    unappealed_flags,
)
from gateway.edge.decoding import Decoder, read_body
from gateway.edge.security import allow, reviewer_scope
from gateway.errors import InvalidRequestError, NotFoundError, PermissionDeniedError, StoreUnavailableError
from gateway.services import Services
from policy.appeals.base import (
    APPEAL_STATES,
    UNDECIDED,
    Appeal,
    AppealClaim,
    AppealClaimedError,
    AppealConflictError,
    AppealEvent,
    AppealEvidence,
    AppealNotFoundError,
    AppealState,
    InvalidTransitionError,
    OwnAppealError,
)
from policy.appeals.reasons import ReasonError, reason_for
from policy.appeals.statement import StatementOfReasons, statement
from policy.audit.base import AuditUnavailableError
from policy.auth import Principal

T = TypeVar("T")
log = logging.getLogger("lockgate.appeals")


class AppealCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/appeals`."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=4000)]
    # Evidence by consent (module docstring): share what was retained, or attach the text checked.
    share_content: bool = False
    content: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SHARED_CONTENT)] | None = None
    # With an appeal of an answer: the request's input as checked, shown beside the answer.
    request_content: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SHARED_CONTENT)] | None = None


class AppealTransition(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /audit/appeals/{id}/transition`: to upheld or overturned with a `reason_code` of `[appeals]
    reasons` for that outcome and the `facts` relied on (both public), `note` internal."""

    to: AppealState
    note: Annotated[str, msgspec.Meta(max_length=4000)] = ""
    reason_code: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    facts: Annotated[str, msgspec.Meta(max_length=4000)] = ""


class AppealDetail(Appeal, frozen=True, kw_only=True):
    """An appeal with its events (n = 1 is the filing); after a decision, the review record's seq; whether
    content was shared with it, and in reviewers' views that content."""

    events: tuple[AppealEvent, ...]
    review_seq: int | None = None
    content_shared: bool = False
    evidence: AppealEvidence | None = None
    # Once decided: the outcome and the public part of its reason (the consumer's statement of reasons).
    statement: StatementOfReasons | None = None


_appeal_create = Decoder(AppealCreate)
_appeal_transition = Decoder(AppealTransition)


async def _store(call: Awaitable[T]) -> T:
    """Run an appeal or audit store call, mapping its errors to HTTP ones."""
    try:
        return await call
    except AppealNotFoundError as exc:
        raise NotFoundError(str(exc), code="appeal_not_found") from exc
    except AppealConflictError as exc:
        raise ConflictAPIError(str(exc), code="already_appealed") from exc
    except AppealClaimedError as exc:
        raise ConflictAPIError(str(exc), code="claimed") from exc
    except InvalidTransitionError as exc:
        raise ConflictAPIError(str(exc), param="to", code="invalid_transition") from exc
    except NotReviewableError as exc:
        raise ConflictAPIError(str(exc), code="not_reviewable") from exc
    except AuditUnavailableError as exc:
        raise StoreUnavailableError(
            "the audit database is unavailable; try again shortly", retry_after=1, code="audit_unavailable"
        ) from exc


async def _detail(
    services: Services, appeal: Appeal, review_seq: int | None = None, *, reviewer: bool = True
) -> AppealDetail:
    """The appeal's detail: in a reviewer's view with the content shared with it; in the consumer's without
    the reviewers' internal notes."""
    events = await _store(services.appeals.events(appeal.tenant, appeal.appeal_id))
    evidence = await _store(services.appeals.evidence(appeal.tenant, appeal.appeal_id))
    said = None
    if appeal.state in REVIEW_DECISION:
        decided = await _store(services.audit.get(appeal.tenant, appeal.decision_seq))
        said = statement(appeal, events, automated_detection=decided.source != "reviewer")
    if not reviewer:
        events = [msgspec.structs.replace(e, note="") for e in events]
    fields = msgspec.structs.asdict(appeal)
    return AppealDetail(
        **fields,
        events=tuple(events),
        review_seq=review_seq,
        content_shared=evidence is not None,
        evidence=evidence if reviewer else None,
        statement=said,
    )


@post(
    "/v1/appeals",
    status_code=HTTP_201_CREATED,
    dependencies=request_body(
        AppealCreate, {"request_id": "9c1f3e0a5b7d4e21a8f06c3b", "reason": "a question about a poem"}
    ),
    responses=errors(400, 404, 409, 413),
)
async def file_appeal(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> AppealDetail:
    """Appeal the latest appealable decision recorded for one of the caller's tenant's requests."""
    allow(principal, "consumer")
    body = _appeal_create.decode(await read_body(request))
    tenant = principal.tenant.tenant_id
    records = await _store(services.audit.find(tenant, body.request_id))
    decisions = [r for r in records if r.decision in APPEALABLE]
    if not decisions:
        raise NotFoundError(
            f"no appealable decision is recorded for request {body.request_id!r}",
            param="request_id",
            code="decision_not_found",
        )
    decision = decisions[-1]
    appeal = await _store(
        services.appeals.file(
            tenant=tenant,
            request_id=body.request_id,
            decision_seq=decision.seq,
            reason=body.reason,
            filed_by=principal.key.key_id,
            now=services.clock(),
            shared=shared_content(body, decision, records, services),
            facets=facets_of(decision),
        )
    )
    return await _detail(services, appeal, reviewer=False)


@get("/v1/appeals/{appeal_id:str}", responses=errors(400, 404))
async def get_own_appeal(
    appeal_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> AppealDetail:
    """One of the caller's tenant's appeals, with its events."""
    allow(principal, "consumer")
    appeal = await _store(services.appeals.get(principal.tenant.tenant_id, appeal_id))
    return await _detail(services, appeal, reviewer=False)


@get("/audit/queue", responses=errors(400, 403), dependencies=QUEUE_PARAMS)
async def waiting_for_review(
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
    queue_params: NamedDependency[dict[str, str]],
) -> ReviewQueue:
    """A page of at most `limit` undecided appeals (oldest filed first, or newest with `sort=newest`; after
    the appeal `after`) and at most `limit` flagged decisions nobody has appealed, newest first; both
    matching the filters (gateway.console.queue_filters)."""
    q = queue_query(queue_params, reviewer_scope(principal), services.clock())
    return await _store(review_queue(services, q.tenant, q.limit, q.after, q.filters))


class QueueCounts(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /audit/queue/counts`: the undecided appeals and the unappealed flagged decisions that match the
    filters, in all and by the value of each facet (tenant, decision, stage, source, category, severity,
    policy); `truncated` when the flagged decisions were read only in part."""

    appeals: int
    appeals_by: dict[str, dict[str, int]]
    flagged: int
    flagged_by: dict[str, dict[str, int]]
    truncated: bool


@get("/audit/queue/counts", responses=errors(400, 403), dependencies=QUEUE_PARAMS)
async def queue_counts(
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
    queue_params: NamedDependency[dict[str, str]],
) -> QueueCounts:
    """How much of the queue matches the filters, by facet: what a filter would leave."""
    q = queue_query(queue_params, reviewer_scope(principal), services.clock(), paged=False)
    by = await _store(services.appeals.counts(q.tenant, UNDECIDED, q.filters))
    flagged, truncated = await _store(unappealed_flags(services, q.tenant, q.filters))
    return QueueCounts(
        appeals=sum(by["tenant"].values()),
        appeals_by=by,
        flagged=len(flagged),
        flagged_by=facet_counts(flagged),
        truncated=truncated,
    )


@post(
    "/audit/decisions/{tenant:str}/{seq:int}/appeal",
    status_code=HTTP_201_CREATED,
    responses=errors(400, 404, 409),
)
async def take_up_decision(
    tenant: FromPath[str],
    seq: FromPath[int],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> AppealDetail:
    """Take up a flagged decision for review: its appeal, filed on the reviewer's behalf."""
    record = await reviewer_record(services, principal, tenant, seq)
    appeal = await _store(take_up(services, record, principal.key.key_id, services.clock()))
    return await _detail(services, appeal)


@get("/audit/appeals", responses=errors(400, 403), dependencies=QUEUE_PARAMS)
async def list_appeals(
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
    # `state` is a name Litestar reserves for the app state.
    queue_params: NamedDependency[dict[str, str]],
    state_: Annotated[str | None, QueryParameter(name="state")] = None,
) -> AppealPage:
    """The appeals the reviewer may see (in `state`, or all; matching the queue's filters), oldest filed
    first (newest with `sort=newest`)."""
    if state_ is not None and state_ not in APPEAL_STATES:
        raise InvalidRequestError(
            f"state must be one of {', '.join(APPEAL_STATES)}", param="state", code="invalid_value"
        )
    params = {name: value for name, value in queue_params.items() if name != "state"}
    q = queue_query(params, reviewer_scope(principal), services.clock())
    wanted: AppealState | None = next((s for s in APPEAL_STATES if s == state_), None)
    return await _store(appeal_page(services, q.tenant, wanted, q.limit, q.after, q.filters))


@get("/audit/appeals/{appeal_id:str}", responses=errors(400, 404))
async def review_appeal(
    appeal_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> AppealDetail:
    """One appeal the reviewer may see, with its events."""
    appeal = await _store(services.appeals.get(reviewer_scope(principal), appeal_id))
    return await _detail(services, appeal)


@post(
    "/audit/appeals/{appeal_id:str}/transition",
    status_code=HTTP_200_OK,
    dependencies=request_body(AppealTransition, {"to": "overturned", "note": "not an injection"}),
    responses=errors(400, 404, 409, 413),
)
async def transition_appeal(
    appeal_id: FromPath[str],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> AppealDetail:
    """Move an appeal one step; deciding it records the review in the decision's tenant's audit chain."""
    scope = reviewer_scope(principal)
    body = _appeal_transition.decode(await read_body(request))
    reviewer = principal.key.key_id
    now = services.clock()
    reason = None
    if body.to in REVIEW_DECISION:
        try:
            reason = reason_for(services.config.appeals.reasons, body.to, body.reason_code)
        except ReasonError as exc:
            raise InvalidRequestError(str(exc), param="reason_code", code="invalid_reason") from exc
    elif body.reason_code is not None or body.facts:
        raise InvalidRequestError(
            "a reason_code and facts go with a decision (upheld or overturned) only",
            param="reason_code" if body.reason_code is not None else "facts",
            code="invalid_reason",
        )
    if body.to in REVIEW_DECISION:
        if not may_decide(services, scope):
            raise PermissionDeniedError(
                "only reviewers of the operating organisation may uphold or overturn appeals here",
                param="to",
                code="operator_only",
            )
        # Nobody decides their own case: not the key the decision was made for, not the key that appealed.
        current = await _store(services.appeals.get(scope, appeal_id))
        decided = await _store(services.audit.get(current.tenant, current.decision_seq))
        try:
            check_not_own(decided, current, reviewer)
        except OwnAppealError as exc:
            raise PermissionDeniedError(str(exc), code="own_appeal") from exc
    moved = services.appeals.transition(
        scope,
        appeal_id,
        body.to,
        actor=reviewer,
        note=body.note,
        now=now,
        reason=reason,
        facts=body.facts,
    )
    appeal = await _store(moved)
    review_seq = None
    decision = REVIEW_DECISION.get(appeal.state)
    if decision is not None and reason is not None:
        original = await _store(services.audit.get(appeal.tenant, appeal.decision_seq))
        review_seq = await record_review(services, original, decision, reviewer, body.note, now, reason)
    return await _detail(services, appeal, review_seq)


def _claim(services: Services, scope: str | None, appeal_id: str, reviewer: str) -> Awaitable[AppealClaim]:
    lease = services.config.appeals.claim_lease
    return services.appeals.claim(scope, appeal_id, reviewer, now=services.clock(), lease=lease)


@post("/audit/appeals/{appeal_id:str}/claim", status_code=HTTP_200_OK, responses=errors(400, 404, 409))
async def claim_appeal(
    appeal_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> AppealClaim:
    """Take an undecided appeal for review, or renew the caller's claim on it."""
    return await _store(_claim(services, reviewer_scope(principal), appeal_id, principal.key.key_id))


class ClaimRelease(msgspec.Struct, frozen=True, kw_only=True):
    """`DELETE /audit/appeals/{id}/claim`: whether the caller held a claim that is now given back."""

    appeal_id: str
    released: bool


@delete("/audit/appeals/{appeal_id:str}/claim", status_code=HTTP_200_OK, responses=errors(400, 404))
async def release_appeal(
    appeal_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> ClaimRelease:
    """Give back the caller's claim on an appeal (released false when it held none)."""
    scope, reviewer = reviewer_scope(principal), principal.key.key_id
    released = await _store(services.appeals.release(scope, appeal_id, reviewer))
    return ClaimRelease(appeal_id=appeal_id, released=released)


ROUTES = [
    secured(
        "appeals",
        [
            file_appeal,
            get_own_appeal,
            waiting_for_review,
            queue_counts,
            take_up_decision,
            list_appeals,
            review_appeal,
            claim_appeal,
            release_appeal,
            transition_appeal,
        ],
    )
]
