"""The reviewer console: server-rendered pages over the audit trail and appeals, for people with a
`reviewer` key (scoped like the reviewer API: their own tenant, or every tenant for the operator's keys).

    GET  /console?after=                        sign-in form, or (signed in) a page of the review queue
    POST /console/login                         {csrf, key}: a reviewer key starts a session (cookie)
    POST /console/logout                        {csrf}: ends it
    GET  /console/decisions/{tenant}/{seq}      one decision: fields, stages, content, appeal and events
    POST /console/decisions/{tenant}/{seq}/decide   {csrf, outcome=uphold|overturn, note}
    GET  /console/policies                      per policy version: decisions per hour, score histograms,
                                                and (operator reviewers) the publish check's figures

Sessions (`gateway.console.plumbing`, stored by `gateway.console.sessions`): the cookie holds a random session
id only; the key is authenticated again on every request; every POST after sign-in carries the session's CSRF
token; an unreachable session store is a 503 page. Sign-in itself (`gateway.console.login`) carries a CSRF
token bound to a login cookie and is rate limited per client address and key id; each key holds at most
`[console] sessions_per_key` sessions, its own oldest ending first. Another tenant's decision is 404, like a
missing one.

Deciding through the console is the API's review: a decision without an appeal gets one filed on the
reviewer's behalf, the appeal steps open -> in_review -> upheld | overturned in the AppealStore, and
`record_review` appends the same `uphold` / `reversal` record the API does. With `[appeals]
operator_reviewers_only`, a tenant's reviewer sees no decision form and a decision it posts is a 403 page.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, Router, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Redirect

from gateway.console import views
from gateway.console.figures import figures_body
from gateway.console.login import LOGIN_COOKIE, attempt_wait, login_page, token_ok
from gateway.console.plumbing import (
    COOKIE,
    HEADERS,
    PageError,
    Reviewer,
    call,
    cookie,
    cookie_name,
    error_response,
    form,
    html,
    posted,
    session_call,
    sessions_of,
    signed_in,
)
from gateway.console.queue_filters import QUEUE_PARAMS, queue_query
from gateway.console.review_queue import (
    REVIEW_DECISION,
    appeal_of,
    check_not_own,
    may_decide,
    record_review,
    review_queue,
    reviewable,
    take_up,
)
from gateway.console.stats import collect, stats_body
from gateway.errors import APIError
from gateway.services import Services
from policy.appeals.base import UNDECIDED, Appeal, AppealState, OwnAppealError
from policy.appeals.reasons import ReasonError, reason_for
from policy.audit.records import AuditRecord
from policy.auth import AuthError, ForbiddenError, ThrottledError, require_role
from policy.auth import StoreUnavailableError as KeyStoreUnavailableError
from policy.auth_limit import source_of

_OUTCOMES: dict[str, AppealState] = {"uphold": "upheld", "overturn": "overturned"}


@get("/", dependencies=QUEUE_PARAMS)
async def queue(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    queue_params: NamedDependency[dict[str, str]],
) -> Response[str]:
    """The sign-in form, or the queue: a filter form with the counts of what each filter leaves, a page of
    open and in-review appeals (after the appeal `after`), then unreviewed flagged decisions; the filters
    and sort of `GET /audit/queue` (gateway.console.queue_filters)."""
    reviewer = await signed_in(request, services)
    if reviewer is None:
        return login_page(request, services)
    params = {name: value for name, value in queue_params.items() if value and name != "limit"}
    try:
        q = queue_query(params, reviewer.scope, services.clock())
    except APIError as exc:
        raise PageError(exc.status_code, str(exc), reviewer.session, reviewer.who) from exc
    size = services.config.console.queue_page_size
    waiting = await call(reviewer, review_queue(services, q.tenant, size, q.after, q.filters))
    counts = await call(reviewer, services.appeals.counts(q.tenant, UNDECIDED, q.filters))
    body = views.queue_page(
        waiting.appeals,
        waiting.flagged,
        truncated=waiting.truncated,
        next_after=waiting.last_id if waiting.has_more else None,
        claims=waiting.claims,
        filters={name: value for name, value in params.items() if name != "after"},
        counts=counts,
        csrf=reviewer.session.csrf,
        who=reviewer.who,
    )
    return html(body)


@post("/login", status_code=303)
async def login(request: Request[Any, Any, Any], services: NamedDependency[Services]) -> Response[Any]:
    """Start a session for a reviewer key: 403 without the form's CSRF token, 429 past the attempt limit,
    401 for a bad key, 403 for a key without the reviewer role."""
    fields = await form(request)
    if not token_ok(request, services, fields.get("csrf", "")):
        message = "Sign-in refused: the form is stale or forged (CSRF token missing or wrong); try again"
        return login_page(request, services, message, 403)
    key = fields.get("key", "").strip()
    wait = await attempt_wait(request, services, key)
    if wait is not None:
        limited = login_page(request, services, f"Too many sign-in attempts; try again in {wait} s", 429)
        limited.headers["retry-after"] = str(wait)
        return limited
    authorization = f"Bearer {key}"
    try:
        client = request.client
        principal = await services.auth.authenticate(
            authorization, source_of(client.host if client else None)
        )
        require_role(principal, "reviewer")
    except AuthError as exc:
        return login_page(request, services, f"Sign-in refused: {exc}", 401)
    except ForbiddenError:
        return login_page(request, services, "Sign-in refused: this key lacks the reviewer role", 403)
    except ThrottledError as exc:
        raise PageError(429, str(exc)) from exc
    except KeyStoreUnavailableError as exc:
        raise PageError(503, f"{exc}; try again shortly") from exc
    console, sessions = services.config.console, sessions_of(request)
    await session_call(sessions.close(request.cookies.get(cookie_name(COOKIE, console))))
    sid, _session = await session_call(sessions.open(authorization, principal.key.key_id))
    cookies = [
        cookie(COOKIE, sid, console, int(console.session_ttl)),
        cookie(LOGIN_COOKIE, "", console, 0),
    ]
    return Redirect("/console", status_code=303, cookies=cookies, headers=HEADERS)


@post("/logout", status_code=303)
async def logout(request: Request[Any, Any, Any], services: NamedDependency[Services]) -> Response[Any]:
    """End the session."""
    reviewer, _fields = await posted(request, services)
    await session_call(sessions_of(request).close(reviewer.sid))
    ended = cookie(COOKIE, "", services.config.console, 0)
    return Redirect("/console", status_code=303, cookies=[ended], headers=HEADERS)


def decidable(record: AuditRecord, appeal: Appeal | None) -> bool:
    """Whether this decision can still be upheld or overturned."""
    return reviewable(record) and (appeal is None or appeal.state in UNDECIDED)


async def _show(
    services: Services, reviewer: Reviewer, tenant: str, seq: int, outcome: str = ""
) -> tuple[AuditRecord, Appeal | None, str]:
    """The decision (404 outside the reviewer's scope), its appeal, and the page."""
    if reviewer.scope is not None and tenant != reviewer.scope:
        raise PageError(404, "no such decision", reviewer.session, reviewer.who)
    record = await call(reviewer, services.audit.get(tenant, seq))
    appeal = await call(reviewer, appeal_of(services, record))
    events, evidence, claim = [], None, None
    if appeal is not None:
        events = await call(reviewer, services.appeals.events(tenant, appeal.appeal_id))
        evidence = await call(reviewer, services.appeals.evidence(tenant, appeal.appeal_id))
        claims = await call(reviewer, services.appeals.claims([appeal.appeal_id], services.clock()))
        claim = claims.get(appeal.appeal_id)
    body = views.decision_page(
        record,
        appeal,
        events,
        evidence=evidence,
        claim=claim,
        decidable=decidable(record, appeal) and may_decide(services, reviewer.scope),
        reasons=services.config.appeals.reasons,
        outcome=outcome,
        csrf=reviewer.session.csrf,
        who=reviewer.who,
    )
    return record, appeal, body


@get("/decisions/{tenant:str}/{seq:int}")
async def decision(
    tenant: FromPath[str],
    seq: FromPath[int],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
) -> Response[Any]:
    """One decision with everything recorded about it and its appeal."""
    reviewer = await signed_in(request, services)
    if reviewer is None:
        return Redirect("/console", status_code=303)
    _record, _appeal, body = await _show(services, reviewer, tenant, seq)
    return html(body)


@post("/decisions/{tenant:str}/{seq:int}/claim", status_code=200)
async def claim(
    tenant: FromPath[str],
    seq: FromPath[int],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
) -> Response[str]:
    """Claim a decision for review (taking it up first if nobody has appealed it): while the claim lasts,
    other reviewers see who has it and cannot decide it."""
    reviewer, _fields = await posted(request, services)
    record, appeal, _body = await _show(services, reviewer, tenant, seq)
    if not decidable(record, appeal):
        raise PageError(409, "this decision cannot be reviewed (again)", reviewer.session, reviewer.who)
    actor, now = reviewer.principal.key.key_id, services.clock()
    if appeal is None:
        appeal = await call(reviewer, take_up(services, record, actor, now))
    lease = services.config.appeals.claim_lease
    taking = services.appeals.claim(reviewer.scope, appeal.appeal_id, actor, now=now, lease=lease)
    held = await call(reviewer, taking)
    outcome = f"Claimed until {views.when(held.expires_at)}."
    _record, _appeal, body = await _show(services, reviewer, tenant, seq, outcome)
    return html(body)


@post("/decisions/{tenant:str}/{seq:int}/decide", status_code=200)
async def decide(
    tenant: FromPath[str],
    seq: FromPath[int],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
) -> Response[str]:
    """Uphold or overturn a decision, through its appeal (filed on the reviewer's behalf if it has none)."""
    reviewer, fields = await posted(request, services)
    choice = fields.get("outcome", "")
    to = _OUTCOMES.get(choice)
    note, facts = fields.get("note", ""), fields.get("facts", "")
    if to is None or len(note) > 4000 or len(facts) > 4000:
        raise PageError(
            400,
            "choose Uphold or Overturn (a note and facts of at most 4000 characters each)",
            reviewer.session,
            reviewer.who,
        )
    if not may_decide(services, reviewer.scope):
        raise PageError(
            403,
            "only reviewers of the operating organisation may uphold or overturn decisions here",
            reviewer.session,
            reviewer.who,
        )
    record, appeal, _body = await _show(services, reviewer, tenant, seq)
    if not decidable(record, appeal):
        raise PageError(409, "this decision cannot be decided (again)", reviewer.session, reviewer.who)
    actor, now = reviewer.principal.key.key_id, services.clock()
    try:
        check_not_own(record, appeal, actor)
    except OwnAppealError as exc:
        raise PageError(403, str(exc), reviewer.session, reviewer.who) from exc
    try:
        reason = reason_for(services.config.appeals.reasons, to, fields.get(f"reason_{choice}"))
    except ReasonError as exc:
        raise PageError(400, str(exc), reviewer.session, reviewer.who) from exc
    if appeal is None:
        appeal = await call(reviewer, take_up(services, record, actor, now))
    step = services.appeals.transition
    if appeal.state == "open":
        appeal = await call(
            reviewer, step(reviewer.scope, appeal.appeal_id, "in_review", actor=actor, note="", now=now)
        )
    decided = step(
        reviewer.scope, appeal.appeal_id, to, actor=actor, note=note, now=now, reason=reason, facts=facts
    )
    appeal = await call(reviewer, decided)
    review = REVIEW_DECISION[appeal.state]
    review_seq = await call(reviewer, record_review(services, record, review, actor, note, now, reason))
    recorded = f"seq {review_seq}" if review_seq is not None else "queued for the audit store"
    outcome = f"Appeal {appeal.appeal_id} {appeal.state}: {review} record {recorded}."
    _record, _appeal, body = await _show(services, reviewer, tenant, seq, outcome)
    return html(body)


@get("/policies")
async def policies(request: Request[Any, Any, Any], services: NamedDependency[Services]) -> Response[Any]:
    """Per policy version: decisions per hour and score histograms per guard stage."""
    reviewer = await signed_in(request, services)
    if reviewer is None:
        return Redirect("/console", status_code=303)
    now = services.clock()
    stats, truncated = await call(reviewer, collect(services.audit, reviewer.scope, now))
    content = stats_body(stats, now, truncated)
    if reviewer.scope is None:
        store = services.registry.store
        records = [r for kind in ("policy", "guard_model") for r in await call(reviewer, store.figures(kind))]
        content = figures_body(records) + content
    body = views.page("Policies", content, csrf=reviewer.session.csrf, who=reviewer.who)
    return html(body)


ROUTES = [
    Router(
        path="/console",
        route_handlers=[queue, login, logout, decision, claim, decide, policies],
        exception_handlers={PageError: error_response},
        # HTML pages for a browser (session cookie, CSRF forms), not an API: left out of the OpenAPI document.
        include_in_schema=False,
    )
]
