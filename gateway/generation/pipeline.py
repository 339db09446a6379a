"""One generation request from top to bottom: read this module first.

    decode -> resolve -> render (plan) -> reserve quota -> compile schema -> input guard
           -> admit (fair queue, replica) -> generate -> output guard -> respond

Before the reservation a request costs only work linear in it (`bounds`: field and schema size limits)
and its rendering and tokenization (bounded by the body limit); a JSON schema is compiled after it.

The route handlers decode the body and call `run_chat` / `run_completion`; every later stage is one call into
the package that owns it: `planning` (validate, render, count tokens), `metering` (quota), the safety gate
(`policy.safety`, over `guard/`), the engine, `guard.moderator` (held-back output), `responses` (OpenAI
shapes). The stream's plumbing (bounded buffer, disconnect races, outcome tracking) is behind `flow`. Each
stage is timed on the request's `RequestTimeline` (`gateway.observe`), which metrics, logs and traces read.

A request the input guard blocks or cannot check costs no engine time and gets its quota reservation back.
Output is released to the client only after the output guard checked it, as generated and with its JSON
escapes resolved (as the client's decoder reads tool-call arguments and structured output); a block ends the
stream with `finish_reason: content_filter` and an error event, and aborts the engine request.
`x-lockgate-guard` says which path decided (`input=rules`, `input=model`, `input=fail_open`, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from litestar import MediaType, Response
from msgspec.structs import replace

from engines.base import (
    EngineDeadError,
    EngineDelta,
    EngineError,
    EngineOverloadedError,
    EngineRequestError,
    Usage,
)
from engines.choices import split_choices
from gateway.edge.inbound import Inbound
from gateway.edge.requestid import request_id_of
from gateway.errors import (
    APIError,
    EngineFailedError,
    EngineUnavailableError,
    InvalidRequestError,
    retry_after_headers,
)
from gateway.generation.admission import (
    QUEUE_WAIT_HEADER,
    admit,
    for_engine,
    priority_class,
    queue_deadline,
    routed,
    session_of,
)
from gateway.generation.audit import record_refusal
from gateway.generation.constraints import compile_pending
from gateway.generation.flow import ClientDisconnectedError, Transform, client_watch, collect, pump
from gateway.generation.metering import charge_headers, reserve
from gateway.generation.planning import Plan, plan_chat, plan_completion
from gateway.generation.prompts import PromptRenderer
from gateway.generation.responses import Formatter, sse
from gateway.generation.streaming import SSEResponse
from gateway.generation.tracking import Outcome, RequestTracker, Status
from gateway.observe.timeline import RequestTimeline, timeline_in
from gateway.observe.trace import traceparent_of
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.service import Services
from guard.base import GuardInput, Span
from guard.moderator import OutputBlocked, moderate
from policy.auth import Principal
from policy.quota.meter import Charge
from policy.safety.decision import GuardDecision
from policy.safety.gate import AUDIT_FULL, Evaluation, RecordContext
from registry.view import ResolvedPolicy

# Names the exact model version (name@version) that served a response.
MODEL_HEADER = "x-lockgate-model"
# Which path of the safety policy decided: `input=<source>` and, for whole responses, `output=<source>`.
GUARD_HEADER = "x-lockgate-guard"
# nginx's code for "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED = 499
# Non-streaming output is checked once, at the end (in bounded windows: `guard.moderator`).
_WHOLE = 1 << 30


async def run_chat(
    services: Services, req: ChatCompletionRequest, request: Inbound, principal: Principal
) -> Response[Any]:
    """A chat completion, from decoded request to response."""
    request_id = request_id_of(request.scope)
    timeline = timeline_in(request.scope, services.clock)
    start = timeline.now()
    model, limits = services.target(req.model, principal)
    renderer = await services.renderer_for(model)
    plan = await plan_chat(
        req,
        request_id,
        model,
        renderer,
        limits,
        instructions=services.prompt_for(principal),
        trusted_instructions=principal.key.trusted_instructions,
    )
    timeline.phase("render", start)
    return await _run(services, plan, request, principal, renderer, timeline)


async def run_completion(
    services: Services, req: CompletionRequest, request: Inbound, principal: Principal
) -> Response[Any]:
    """A legacy completion, from decoded request to response."""
    request_id = request_id_of(request.scope)
    timeline = timeline_in(request.scope, services.clock)
    start = timeline.now()
    model, limits = services.target(req.model, principal)
    renderer = await services.renderer_for(model)
    plan = await plan_completion(req, request_id, model, renderer, limits)
    timeline.phase("render", start)
    return await _run(services, plan, request, principal, renderer, timeline)


def engine_api_error(exc: EngineError) -> APIError:
    """The HTTP error for an engine failure: capacity and death are 503 (retry later), the rest 502."""
    if isinstance(exc, EngineOverloadedError):
        return EngineUnavailableError(
            f"the engine is at capacity: {exc}",
            code="engine_overloaded",
            headers=retry_after_headers(exc.retry_after or 1),
        )
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError(
            f"the engine is not available: {exc}",
            code="engine_unavailable",
            headers=retry_after_headers(exc.retry_after or 1),
        )
    if isinstance(exc, EngineRequestError):
        return EngineFailedError(f"the engine failed this request: {exc}", code="engine_error")
    return EngineFailedError(f"engine error: {exc}", code="engine_error")


def guard_api_error(decision: GuardDecision, headers: dict[str, str], param: str = "messages") -> APIError:
    """The HTTP error for an input (in the request field `param`) that the policy blocked (400
    content_policy_violation), that its guard could not read (400 content_unverifiable: the same input fails
    the same way), or that it could not check now (503 guard_unavailable, with Retry-After)."""
    headers = {**headers, GUARD_HEADER: decision.label}
    if decision.action == "refuse" and _input_caused(decision):
        # The guard could not read this input (too long to check, the model talked out of answering): the
        # same input fails the same way, so this is the client's 400, not a 503 its SDK would retry.
        return InvalidRequestError(
            f"the safety guard could not check this input and the policy fails closed for "
            f"{decision.category or 'its categories'}; sending it again will not help: shorten or change it",
            param=param,
            code="content_unverifiable",
            headers=headers,
        )
    if decision.action == "refuse":
        return EngineUnavailableError(
            _unavailable(decision, f"the safety guard for {decision.category or 'this policy'}"),
            code="guard_unavailable",
            headers={**headers, **_retry_after(decision)},
        )
    category = f" (category {decision.category})" if decision.category else ""
    return InvalidRequestError(
        f"the input was blocked by the tenant's safety policy{category}",
        param=param,
        code="content_policy_violation",
        headers=headers,
    )


def _input_caused(decision: GuardDecision) -> bool:
    """Whether every stage that failed failed on the item itself (`GuardInputError`), none on the guard."""
    runs = decision.result.runs if decision.result is not None else ()
    failures = [run.failure for run in runs if run.verdict == "error"]
    return bool(failures) and all(f == "input" for f in failures)


def _retry_after(decision: GuardDecision) -> dict[str, str]:
    """Retry-After of a refusal: until its failed stages may go ahead again (`StageRun.retry_after`: an
    overloaded guard's queued work short enough, an open breaker's next probe)."""
    runs = decision.result.runs if decision.result is not None else ()
    return retry_after_headers(max((run.retry_after for run in runs), default=0.0))


def _unavailable(decision: GuardDecision, guard: str) -> str:
    """Why a refusal's check could not be made or kept: `guard` unavailable, or the audit trail full."""
    if decision.category == AUDIT_FULL:
        return "the audit trail cannot record this decision now, and none is acted on unrecorded; retry later"
    return f"{guard} is unavailable and the policy fails closed; retry later"


def _output_error(decision: GuardDecision) -> APIError:
    if decision.action == "refuse":
        return EngineUnavailableError(
            _unavailable(decision, "the output guard"),
            code="guard_unavailable",
            headers=_retry_after(decision),
        )
    category = f" (category {decision.category})" if decision.category else ""
    return InvalidRequestError(
        f"the output was blocked by the tenant's safety policy{category}", code="content_filter"
    )


class _OutputGuard:
    """The output side of one request: a check session per choice for the moderator, and what was decided."""

    def __init__(
        self,
        services: Services,
        policy: ResolvedPolicy,
        context: RecordContext,
        tracker: RequestTracker,
        timeline: RequestTimeline,
        cache_salt: str,
    ) -> None:
        self.services = services
        self.cache_salt = cache_salt
        self.policy = policy
        self.context = context
        self.tracker = tracker
        self.categories = _categories(policy)
        self.timeline = timeline
        # The latest decision acted on (any choice's), for the `x-lockgate-guard` header.
        self.decision: GuardDecision | None = None

    def transform(self, *, whole: bool) -> Transform:
        spec = self.policy.spec
        hold_back, every = spec.hold_back_tokens, spec.check_every_tokens
        # A streaming check scores about every + hold_back tokens; what is longer (a whole answer, checked
        # once at the end) is scored in windows of the configured size overlapping by hold_back.
        window = max(self.services.config.guard.output_window_tokens, every + hold_back)

        def apply(deltas: AsyncGenerator[EngineDelta, None]) -> AsyncGenerator[EngineDelta, None]:
            checks = _OutputChecks(self)
            return moderate(
                deltas,
                checks.check,
                hold_back=hold_back,
                check_every=_WHOLE if whole else every,
                window=window,
                scored=checks.scored,
                done=checks.done,
            )

        return apply


def _rank(decision: GuardDecision) -> int:
    """How much a decision matters to the audit trail: a block or refusal, then a flagged allow, then an
    allow."""
    return 2 if decision.action != "allow" else 1 if decision.flagged else 0


class _OutputChecks:
    """The output checks of one choice, which leave one audit record between them.

    Each check is evaluated by the gate without being recorded; the one that matters is kept: a block or
    refusal (it ends the output, and is recorded before it is acted on), else the first flagged allow (an
    escalation or a fail-open, which a reviewer must see even when later windows were clean), else the last
    allow. It is recorded once, with the number of checks and the tokens they scored: at a block, at the
    final check (before the last held text is released, so a full audit trail can still refuse it), or
    when the moderation ends otherwise (client gone, engine error)."""

    def __init__(self, guard: _OutputGuard) -> None:
        self._guard = guard
        self._checks = 0
        self._tokens = 0
        self._kept: Evaluation | None = None
        self._recorded = False

    def scored(self, tokens: int) -> None:
        """A window of `tokens` generated tokens is about to be checked: charged with the request's usage
        (before the check: a block finishes the request in it)."""
        self._tokens += tokens
        self._guard.tracker.guard_scored(tokens)

    async def check(self, text: str, decoded: str, final: bool) -> GuardDecision | None:
        """The moderator's check of one window: None to go on, else the decision that stops the output."""
        guard = self._guard
        # What the client reads once it decodes JSON (tool-call arguments, structured output): "\u0062omb"
        # is "bomb". A second span, so no rule matches across the joint of the two readings.
        spans: tuple[Span, ...] = (Span(text=text, source="output"),)
        if decoded:
            spans += (Span(text=decoded, source="output"),)
        item = GuardInput(
            direction="output",
            spans=spans,
            categories=guard.categories,
            policy=guard.policy.ref,
            cache_salt=guard.cache_salt,
        )
        start = guard.timeline.now()
        evaluation = await guard.services.gate.evaluate(guard.policy, item, guard.context)
        self._checks += 1
        decision = evaluation.decision
        guard.timeline.guard_check("output", start, decision)
        kept = self._kept
        if (
            kept is None
            or _rank(decision) > _rank(kept.decision)
            or _rank(decision) == _rank(kept.decision) == 0
        ):
            self._kept = kept = evaluation
        if decision.action != "allow" or final:
            decision = await self._record(kept)
        guard.decision = decision
        if decision.action == "allow":
            return None
        # Charged as far as it got; the engine request is aborted when the moderator closes its stream.
        guard.tracker.finish("blocked")
        return decision

    def done(self) -> None:
        """The moderation ended: record the kept check (an allow) if no block or final check did."""
        if self._kept is not None and not self._recorded:
            self._recorded = True
            guard = self._guard
            guard.services.gate.commit_allow(
                guard.policy, self._kept, checks=self._checks, guard_tokens=self._tokens
            )

    async def _record(self, evaluation: Evaluation) -> GuardDecision:
        self._recorded = True
        guard = self._guard
        return await guard.services.gate.commit(
            guard.policy, evaluation, checks=self._checks, guard_tokens=self._tokens
        )


def _categories(policy: ResolvedPolicy) -> tuple[str, ...]:
    return tuple(c.name for c in policy.spec.categories)


async def _input_guard(
    services: Services,
    plan: Plan,
    policy: ResolvedPolicy,
    context: RecordContext,
    timeline: RequestTimeline,
    cache_salt: str,
) -> GuardDecision | None:
    if not services.gate.guards(policy, "input"):
        return None
    item = GuardInput(
        direction="input",
        spans=plan.spans,
        categories=_categories(policy),
        policy=policy.ref,
        cache_salt=cache_salt,
    )
    start = timeline.now()
    decision = await services.gate.check(policy, item, context)
    timeline.guard_check("input", start, decision)
    timeline.phase("input_guard", start)
    return decision


def _check_alternatives(services: Services, plan: Plan, policy: ResolvedPolicy) -> None:
    """400 for a request asking for alternatives to the chosen tokens (chat `top_logprobs`, completions
    `logprobs: N`) under an output guard, unless its policy allows them: the guard reads the chosen tokens
    only, so the alternatives would reach the client unchecked. Chosen-token logprobs stay allowed."""
    if (plan.engine_request.sampling.logprobs or 0) <= 0 or policy.spec.allows_top_logprobs:
        return
    if not services.gate.guards(policy, "output"):
        return
    field = "top_logprobs" if plan.kind == "chat" else "logprobs"
    raise InvalidRequestError(
        f"{field} above 0 is not allowed under this tenant's safety policy ({policy.ref}): the output guard "
        "checks the chosen tokens, never their alternatives; ask for logprobs of the chosen tokens only",
        param=field,
        code="unsupported_value",
    )


def _unserved(services: Services, plan: Plan, status: Status, timeline: RequestTimeline) -> None:
    """The outcome of a request that never reached an engine (refunded whole: no usage)."""
    services.report(
        Outcome(
            request_id=plan.request_id,
            model=plan.model.ref,
            status=status,
            finish_reason=None,
            usage=Usage(prompt_tokens=0, completion_tokens=0),
            stream=plan.stream,
            tokenizer=plan.model.tokenizer.ref,
            chat_template=plan.model.chat_template.ref,
            metadata=plan.metadata,
        ),
        timeline,
    )


def _refund(services: Services, charge: Charge) -> None:
    # Nothing reached an engine: the whole reservation goes back.
    services.meter.settle_later(charge, 0)


async def _run(
    services: Services,
    plan: Plan,
    request: Inbound,
    principal: Principal,
    renderer: PromptRenderer,
    timeline: RequestTimeline,
) -> Response[Any]:
    timeline.model = plan.model.ref
    timeline.stream = plan.stream
    timeline.choices = plan.choices
    # Headers are checked before anything is reserved: a bad one costs nothing.
    klass = priority_class(request, principal)
    timeline.klass = klass
    wait = queue_deadline(request, services, klass)
    salt = services.secret.cache_salt(principal.tenant.tenant_id)
    policy = services.policy_for(principal)
    timeline.policy = policy.ref
    _check_alternatives(services, plan, policy)
    start = timeline.now()
    try:
        charge = await reserve(services.meter, principal, plan)
    except APIError as exc:
        record_refusal(services, principal, plan.request_id, "quota", exc)
        raise
    finally:
        timeline.phase("quota", start)
    try:
        # Compiling a schema is the costliest CPU work a request can ask for: only once it is paid for.
        plan = await compile_pending(plan, renderer.executor)
    except BaseException:
        _refund(services, charge)
        raise
    req = for_engine(plan, klass, salt)
    if services.observer.tracer is not None:
        req = replace(req, traceparent=traceparent_of(timeline))
    headers = charge_headers(charge)
    headers[MODEL_HEADER] = plan.model.ref
    context = RecordContext(
        tenant=principal.tenant.tenant_id,
        key_id=principal.key.key_id,
        request_id=plan.request_id,
        retain_prompts=principal.tenant.retain_prompts,
    )
    try:
        decision = await _input_guard(services, plan, policy, context, timeline, salt)
    except BaseException:
        _refund(services, charge)
        raise
    labels = [decision.label if decision else "input=off"]
    if decision is not None and decision.action != "allow":
        _refund(services, charge)
        raise guard_api_error(decision, headers)
    # The client may leave while the request waits (admission, the engine, the first delta, the stream).
    watch = client_watch(request.scope, request.receive)
    # Admission: wait (bounded by the queue deadline) for a replica with room.
    start = timeline.now()
    try:
        session = session_of(request, plan.user, principal)
        lease = await admit(services, plan, req, principal, klass, wait, session, watch)
    except ClientDisconnectedError:
        timeline.phase("queue", start)
        _refund(services, charge)
        _unserved(services, plan, "cancelled", timeline)
        return Response(content=b"", status_code=CLIENT_CLOSED)
    except BaseException as exc:
        timeline.phase("queue", start)
        _refund(services, charge)
        _unserved(services, plan, "refused", timeline)
        if isinstance(exc, APIError):
            record_refusal(services, principal, plan.request_id, "admission", exc)
        raise
    timeline.phase("queue", start)
    headers[QUEUE_WAIT_HEADER] = f"{lease.queue_wait:.3f}"
    tracker = RequestTracker(
        plan.request_id,
        plan.model.ref,
        len(req.prompt_token_ids),
        plan.stream,
        services.settle_on_outcome(charge, lease.release),
        tokenizer=plan.model.tokenizer.ref,
        chat_template=plan.model.chat_template.ref,
        choices=plan.choices,
        metadata=plan.metadata,
        on_output=lease.observe,
        timeline=timeline,
    )
    output = (
        _OutputGuard(services, policy, context, tracker, timeline, salt)
        if services.gate.guards(policy, "output")
        else None
    )
    prefix = "chatcmpl-" if plan.kind == "chat" else "cmpl-"
    formatter = Formatter(
        plan, prefix + plan.request_id, plan.model_name, int(time.time()), renderer.tokenizer
    )
    # One engine request per choice (engines generate one sequence each), all on the lease's replica; the
    # flow merges them by index. A single choice fails over to another replica before its first token.
    choices = split_choices(req)
    sources = [routed(services.scheduler, lease, c, fail_over=len(choices) == 1) for c in choices]
    source = sources[0] if len(sources) == 1 else sources
    try:
        if not plan.stream:
            transform = output.transform(whole=True) if output else None
            try:
                deltas = await watch.race(collect(source, tracker, transform))
                filtered = False
            except OutputBlocked as blocked:
                deltas, filtered = [], True
                if blocked.decision.action == "refuse":
                    raise _output_error(blocked.decision) from None
            if output is not None and output.decision is not None:
                labels.append(output.decision.label)
            headers[GUARD_HEADER] = "; ".join(labels)
            body = formatter.whole(deltas, tracker.usage(), filtered=filtered)
            return Response(content=body, media_type=MediaType.JSON, headers=headers)
        headers[GUARD_HEADER] = "; ".join([*labels, "output=stream" if output else "output=off"])
        stream = pump(
            source,
            tracker,
            services.tasks,
            services.config.server.stream_buffer,
            output.transform(whole=False) if output else None,
        )
        # Wait for the first released delta before answering: an engine refusal is still an HTTP error.
        first: EngineDelta | OutputBlocked[GuardDecision]
        try:
            first = await watch.race(anext(stream))
            timeline.released()
        except OutputBlocked as blocked:
            first = blocked
        except BaseException:
            await stream.aclose()
            raise
    except ClientDisconnectedError:
        # Idempotent: the tracked stream has normally recorded it already.
        tracker.finish("cancelled")
        return Response(content=b"", status_code=CLIENT_CLOSED)
    except asyncio.CancelledError:
        tracker.finish("cancelled")
        raise
    except BaseException as exc:
        # However it failed, the outcome is recorded and the reservation settled (first call wins).
        tracker.finish("error")
        if isinstance(exc, EngineError):
            raise engine_api_error(exc) from exc
        if isinstance(exc, StopAsyncIteration):
            raise EngineFailedError(
                "the engine ended the request without output", code="engine_error"
            ) from exc
        raise
    return SSEResponse(
        _events(formatter, first, stream, tracker),
        watch=watch,
        stall_timeout=services.config.server.stream_stall_timeout,
        on_stall=tracker.mark_stalled,
        headers=headers,
    )


async def _events(
    formatter: Formatter,
    first: EngineDelta | OutputBlocked[GuardDecision],
    rest: AsyncGenerator[EngineDelta, None],
    tracker: RequestTracker,
) -> AsyncIterator[bytes]:
    """The stream's SSE events. Those ready at one moment leave in one write: the opening with the first
    delta's, each delta's (a last token and its finish), the closing ones (usage and `[DONE]`)."""
    async with contextlib.aclosing(rest):
        pending = formatter.opening()  # ready, not yet sent
        try:
            if isinstance(first, OutputBlocked):
                raise first
            if ready := b"".join([*pending, *formatter.chunk(first)]):
                yield ready
            pending = []
            async for delta in rest:
                if events := formatter.chunk(delta):
                    yield b"".join(events)
            pending += formatter.closing(tracker.usage())
        except OutputBlocked as blocked:
            # Nothing of the blocked text was released; say why the stream ends, as OpenAI's filters do.
            pending += [*formatter.filtered(), sse(_output_error(blocked.decision).body())]
        except EngineError as exc:
            # The status line is long gone: report the error in the stream, as OpenAI does, and stop.
            pending.append(sse(engine_api_error(exc).body()))
        yield b"".join(pending)
