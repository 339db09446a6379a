"""The admission stage of a request: its priority class and queue deadline, its place in the fair queue, the
replica it runs on, and the failover of a request that fails before its first token.

Request headers:
- `x-lockgate-priority: interactive | batch`: the class; default the tenant's `max_priority`, and never above
  it (a batch tenant asking for interactive is refused, 400).
- `x-lockgate-queue-deadline: <seconds>`: how long the request may wait in the queue; it may only lower the
  class default (`admission.interactive_deadline` / `batch_deadline`).
Response header `x-lockgate-queue-wait`: seconds the request waited for a replica.

Every engine request carries the class's engine priority (vLLM: lower runs earlier) and the tenant's
`cache_salt` (`ServerSecret.cache_salt`: keyed, so no tenant can compute another's), so tenants never share
vLLM's prefix cache (a timing side channel). Guard calls made for the tenant carry the same salt.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator

import msgspec

from engines.base import EngineDelta, EngineRequest
from engines.choices import split_choices
from gateway.errors import APIError, InvalidRequestError, retry_after_headers
from gateway.generation.audit import record_refusal
from gateway.generation.context import Generation
from gateway.generation.flow import ClientWatch, Source
from gateway.generation.planning import Plan
from gateway.inbound import Inbound
from gateway.observe.timeline import RequestTimeline
from policy.auth import Principal
from routing.admission_types import CLASSES, AdmissionError, Klass, Ticket
from routing.replicas import RoutingError
from routing.router import RouteRequest, is_replica_failure, may_fail_over, session_key
from routing.scheduler import ENGINE_PRIORITY, Lease, Scheduler

PRIORITY_HEADER = "x-lockgate-priority"
DEADLINE_HEADER = "x-lockgate-queue-deadline"
SESSION_HEADER = "x-session-id"
QUEUE_WAIT_HEADER = "x-lockgate-queue-wait"


class AdmissionAPIError(APIError):
    """An admission or routing refusal, with the status and code the refusal names."""

    error_type = "service_unavailable"
    default_code = "unavailable"

    def __init__(self, status: int, message: str, *, code: str, retry_after: float | None) -> None:
        headers = {} if retry_after is None else retry_after_headers(retry_after)
        super().__init__(message, code=code, headers=headers)
        self.status_code = status
        if status == 429:
            self.error_type = "rate_limit_exceeded"
        elif status == 400:
            self.error_type = "invalid_request_error"


def admission_api_error(exc: AdmissionError | RoutingError) -> APIError:
    """The HTTP answer to a refusal: queue_full (429 own backlog / 503), deadline_unmeetable (503),
    deadline_expired (504), no_healthy_replica (503), context_length_exceeded (400)."""
    if isinstance(exc, AdmissionError):
        return AdmissionAPIError(exc.status_code, str(exc), code=exc.code, retry_after=exc.retry_after)
    retry = None if exc.status == 400 else (exc.retry_after or 1.0)
    return AdmissionAPIError(exc.status, str(exc), code=exc.code, retry_after=retry)


def priority_class(request: Inbound, principal: Principal) -> Klass:
    """The request's class: the header's, or the tenant's highest; never above the tenant's allowance."""
    allowed = principal.tenant.max_priority
    asked = request.headers.get(PRIORITY_HEADER)
    if asked is None:
        return allowed
    if asked not in CLASSES:
        raise InvalidRequestError(
            f"{PRIORITY_HEADER} must be one of {', '.join(CLASSES)}", param=PRIORITY_HEADER
        )
    klass: Klass = "interactive" if asked == "interactive" else "batch"
    if CLASSES.index(klass) < CLASSES.index(allowed):
        raise InvalidRequestError(
            f"this tenant may use priority class {allowed} at most, not {klass}", param=PRIORITY_HEADER
        )
    return klass


def queue_deadline(request: Inbound) -> float | None:
    """Seconds the request asks to wait in the queue at most (None: its class default, `AdmissionConfig`)."""
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        asked = float(raw)
    except ValueError:
        asked = math.nan
    if not 0 < asked < math.inf:
        raise InvalidRequestError(
            f"{DEADLINE_HEADER} must be a positive number of seconds", param=DEADLINE_HEADER
        )
    return asked


def for_engine(plan: Plan, klass: Klass, cache_salt: str) -> EngineRequest:
    """The plan's engine request with the class's engine priority and the tenant's cache salt."""
    return msgspec.structs.replace(
        plan.engine_request, priority=ENGINE_PRIORITY[klass], cache_salt=cache_salt
    )


async def admit(
    gen: Generation,
    plan: Plan,
    req: EngineRequest,
    principal: Principal,
    klass: Klass,
    asked: float | None,
    session: str | None,
    watch: ClientWatch,
    timeline: RequestTimeline,
) -> Lease:
    """Wait for a replica with room for the request (its whole KV reserve: prompt + n x max_tokens), until
    the class's queue deadline or the `asked` one if sooner; raises ClientDisconnectedError if the client
    leaves (`watch`) meanwhile. A refusal is tallied in the audit trail."""
    start = timeline.now()
    try:
        return await _admit(gen, plan, req, principal, klass, asked, session, watch)
    except APIError as exc:
        record_refusal(gen, principal, plan.request_id, "admission", exc)
        raise
    finally:
        timeline.phase("queue", start)


async def _admit(
    gen: Generation,
    plan: Plan,
    req: EngineRequest,
    principal: Principal,
    klass: Klass,
    asked: float | None,
    session: str | None,
    watch: ClientWatch,
) -> Lease:
    now = gen.clock()
    deadline = gen.config.admission.default_deadline(klass, now)
    if asked is not None:
        deadline = min(deadline, now + asked)
    tenant = principal.tenant
    reserve = req.n * req.sampling.max_tokens
    ticket = Ticket(
        request_id=req.request_id,
        tenant=tenant.tenant_id,
        tenant_weight=tenant.weight,
        klass=klass,
        arrival=now,
        deadline=deadline,
        prompt_tokens=len(req.prompt_token_ids),
        max_tokens=reserve,
    )
    route = RouteRequest(
        request_id=req.request_id,
        weights_sha256=plan.model.spec.weights_sha256,
        prompt_token_ids=req.prompt_token_ids,
        max_tokens=reserve,
        session=session,
        cache_salt=req.cache_salt,
        pool=plan.model.spec.engine_pool,
        sequences=req.n,
    )
    scheduler = gen.scheduler
    try:
        lease = scheduler.admit_now(ticket, route)
        if lease is not None:
            return lease
        # Only a wait races the client leaving (which starts the request's watcher task).
        return await watch.race(scheduler.admit(ticket, route))
    except (AdmissionError, RoutingError) as exc:
        raise admission_api_error(exc) from exc


def session_of(request: Inbound, user: str | None, principal: Principal) -> str | None:
    """The request's session for replica affinity (`x-session-id`, else `user`), scoped to its tenant."""
    return session_key(request.headers.get(SESSION_HEADER), user, tenant=principal.tenant.tenant_id)


def sources(scheduler: Scheduler, lease: Lease, req: EngineRequest) -> Source:
    """The engine streams of `req`, each choice on the replica the lease placed it on (engines generate one
    sequence each), merged by index in the flow. A single choice fails over to another replica before its
    first token."""
    choices = split_choices(req)
    streams = [routed(scheduler, lease, c, i, fail_over=len(choices) == 1) for i, c in enumerate(choices)]
    return streams[0] if len(streams) == 1 else streams


async def routed(
    scheduler: Scheduler, lease: Lease, req: EngineRequest, choice: int = 0, *, fail_over: bool
) -> AsyncGenerator[EngineDelta, None]:
    """The engine stream of `req` (choice `choice` of the request) on the replica the lease placed it on; a
    replica failure before the first token moves the request to another replica once (when `fail_over`),
    after it never. Successes and failures before the first token feed the replica's health and circuit
    breaker (`Replica.judge_failure`)."""
    while True:
        replica = lease.replica_of(choice)
        stream = replica.engine.generate(req)
        started = False
        try:
            async for delta in stream:
                started = True
                yield delta
            replica.record_success()
            return
        except Exception as exc:
            if is_replica_failure(exc) and not started:
                await replica.judge_failure(exc)
            if not (fail_over and may_fail_over(exc, first_token_sent=started, attempt=lease.attempts)):
                raise
            # No other replica with room now: wait for one as a queued request would, until its deadline.
            if await scheduler.fail_over_waiting(lease) is None:
                raise
        finally:
            await stream.aclose()
