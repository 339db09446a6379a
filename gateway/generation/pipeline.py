"""One generation request from top to bottom: read this module first.

    decode -> resolve (a route: choose the model) -> render (plan) -> reserve quota -> compile schema
           -> result cache lookup -> input guard -> cached answer, or admit (fair queue, replica) and generate
           -> output guard -> respond

Before the reservation a request costs only work linear in it (`bounds`: field and schema size limits)
and its rendering and tokenization (bounded by the body limit); a JSON schema is compiled after it.

The route handlers decode the body and call `run_chat` / `run_completion` with the pipeline's dependencies
(`context.Generation`); each stage is one call into the module that owns it:

    resolution  model version and limits, renderer, safety policy, system prompt (registry view)
    orchestration  a route's choice of model by the request's features, and its fallbacks
    planning    validate, render, count tokens
    metering    reserve quota (a denial is tallied in the audit trail)
    settlement  from the reservation on: refund, or the tracker's outcome and settlement (one path)
    planning    compile the JSON schema (`constraints`), once paid for
    guarding    input guard; the output guard (`policy.safety.output`, beside the gate)
    caching     whether the result cache may answer (deterministic requests), under which key
    admission   priority class, queue deadline, fair queue, replica, failover
    answer      engine output through the output guard to a JSON answer or SSE stream (`flow`, `responses`)

Each stage is timed on the request's `RequestTimeline` (`gateway.observe`), which metrics, logs and traces
read.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from litestar import Response
from msgspec.structs import replace

from gateway.generation.admission import (
    QUEUE_WAIT_HEADER,
    admit,
    for_engine,
    priority_class,
    queue_deadline,
    session_of,
    sources,
)
from gateway.generation.answer import answer
from gateway.generation.caching import CACHE_HEADER, cache_use
from gateway.generation.confidence import confidence_gate
from gateway.generation.context import Generation
from gateway.generation.flow import ClientDisconnectedError, Source, client_watch
from gateway.generation.guarding import check_alternatives, check_input, guard_api_error, output_guard
from gateway.generation.metering import charge_headers, reserve, tokens_left
from gateway.generation.orchestration import (
    ROUTE_HEADER,
    Features,
    Planner,
    RouteDecision,
    capabilities,
    reads_budget,
    routed,
)
from gateway.generation.planning import Plan, compile_pending, plan_chat, plan_completion
from gateway.generation.prompts import PromptRenderer
from gateway.generation.resolution import (
    Binding,
    policy_for,
    prompt_for,
    renderer_for,
    route_for,
    target,
)
from gateway.generation.responses import Formatter
from gateway.generation.settlement import Settlement
from gateway.inbound import Inbound
from gateway.observe.timeline import RequestTimeline, timeline_in
from gateway.observe.trace import traceparent_of
from gateway.requestid import request_id_of
from gateway.result_cache.cache import replayed
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from policy.auth import Principal
from policy.safety.gate import RecordContext
from policy.safety.output import OutputGuard, Transform
from registry.models import CascadeSpec

# Names the exact model version (name@version) that served a response.
MODEL_HEADER = "x-lockgate-model"
# nginx's code for "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED = 499


async def run_chat(
    gen: Generation,
    req: ChatCompletionRequest,
    request: Inbound,
    principal: Principal,
    binding: Binding | None = None,
) -> Response[Any]:
    """A chat completion, from decoded request to response; a session's step (or a stored conversation's
    turn) with the versions of its `binding`, whose model may be a route version."""
    request_id = request_id_of(request.scope)
    timeline = timeline_in(request.scope, gen.clock)
    named = binding.model if binding else req.model
    routing = gen.registry.view.is_route(named)

    async def plan_for(name: str) -> tuple[Plan, PromptRenderer]:
        start = timeline.now()
        model, limits = target(gen, name, principal)
        renderer = await renderer_for(gen, model)
        plan = await plan_chat(
            replace(req, model=name) if routing and name != req.model else req,
            request_id,
            model,
            renderer,
            limits,
            instructions=prompt_for(gen, principal, binding),
            trusted_instructions=principal.key.trusted_instructions,
        )
        timeline.phase("render", start)
        return plan, renderer

    if routing:
        return await _routed(gen, named, plan_for, request, principal, timeline, binding)
    plan, renderer = await plan_for(named)
    return await _run(gen, plan, request, principal, renderer, timeline, binding)


async def run_completion(
    gen: Generation, req: CompletionRequest, request: Inbound, principal: Principal
) -> Response[Any]:
    """A legacy completion, from decoded request to response."""
    request_id = request_id_of(request.scope)
    timeline = timeline_in(request.scope, gen.clock)

    async def plan_for(name: str) -> tuple[Plan, PromptRenderer]:
        start = timeline.now()
        model, limits = target(gen, name, principal)
        renderer = await renderer_for(gen, model)
        asked = req if name == req.model else replace(req, model=name)
        plan = await plan_completion(asked, request_id, model, renderer, limits)
        timeline.phase("render", start)
        return plan, renderer

    if gen.registry.view.is_route(req.model):
        return await _routed(gen, req.model, plan_for, request, principal, timeline)
    plan, renderer = await plan_for(req.model)
    return await _run(gen, plan, request, principal, renderer, timeline)


async def _routed(
    gen: Generation,
    name: str,
    plan_for: Planner,
    request: Inbound,
    principal: Principal,
    timeline: RequestTimeline,
    binding: Binding | None = None,
) -> Response[Any]:
    """A request to the route `name`: its model chosen by the route's rules, with its fallbacks (and a
    stored conversation's policy, prompt and affinity, from its `binding`)."""
    route = route_for(gen, name, principal)
    klass = priority_class(request, principal)
    asked = queue_deadline(request)
    spec = route.spec

    async def features_of(plan: Plan) -> Features:
        admission = gen.config.admission
        deadline = admission.default_deadline(klass, 0.0)
        return Features(
            prompt_tokens=len(plan.engine_request.prompt_token_ids),
            capabilities=capabilities(plan),
            tenant=principal.tenant.tenant_id,
            tier=principal.tenant.tier,
            key_id=principal.key.key_id,
            klass=klass,
            deadline_s=deadline if asked is None else min(deadline, asked),
            tokens_left=await tokens_left(gen, principal) if reads_budget(spec) else None,
        )

    async def run(plan: Plan, renderer: PromptRenderer, decision: RouteDecision) -> Response[Any]:
        return await _run(gen, plan, request, principal, renderer, timeline, binding, route=decision)

    return await routed(route, plan_for, features_of, run, gen.route_decisions)


async def _run(
    gen: Generation,
    plan: Plan,
    request: Inbound,
    principal: Principal,
    renderer: PromptRenderer,
    timeline: RequestTimeline,
    binding: Binding | None = None,
    route: RouteDecision | None = None,
) -> Response[Any]:
    timeline.model = plan.model.ref
    timeline.model_route = route.describe() if route else ""
    timeline.stream = plan.stream
    timeline.choices = plan.choices
    # Headers are checked before anything is reserved: a bad one costs nothing.
    klass = priority_class(request, principal)
    timeline.klass = klass
    asked = queue_deadline(request)
    salt = gen.secret.cache_salt(principal.tenant.tenant_id)
    policy = policy_for(gen, principal, binding)
    timeline.policy = policy.ref
    check_alternatives(gen.gate, plan, policy)
    charge = await reserve(gen, principal, plan, timeline)
    try:
        with Settlement(gen, plan, charge, timeline) as settlement:
            # Compiling a schema is the costliest CPU work a request can ask for: only once it is paid for.
            plan = await compile_pending(plan, renderer.executor)
            req = for_engine(plan, klass, salt)
            gated = route.cascade if route is not None and plan.choices == 1 else None
            if gated is not None and req.sampling.logprobs is None:
                # The gate reads each token's log-probability; the client sees them only if it asked.
                req = replace(req, sampling=replace(req.sampling, logprobs=0))
            if gen.traced:
                req = replace(req, traceparent=traceparent_of(timeline))
            headers = charge_headers(charge)
            headers[MODEL_HEADER] = plan.model.ref
            if route is not None:
                headers[ROUTE_HEADER] = timeline.model_route
            context = RecordContext(
                tenant=principal.tenant.tenant_id,
                key_id=principal.key.key_id,
                request_id=plan.request_id,
                retain_prompts=principal.tenant.retain_prompts,
                route=timeline.model_route,
            )
            # Looked up before the input check, so that its audit record says the cache held the answer.
            tenant = principal.tenant.tenant_id
            use = cache_use(gen, plan, req, policy.ref, tenant, request.headers)
            cached = await use.cache.get(use.key) if use is not None and use.lookup == "use" else None
            if cached is not None:
                context = replace(context, answered_from="cache")
            decision = await check_input(gen.gate, plan, policy, context, timeline, salt)
            if decision is not None and decision.action != "allow":
                raise guard_api_error(decision, headers)
            # The client may leave while the request waits (admission, the engine, the first delta, the
            # stream).
            watch = client_watch(request.scope, request.receive)
            source: Source
            if use is not None and cached is not None:
                # A kept answer: no engine; the output guard checks it as if generated (and says so).
                headers[CACHE_HEADER] = timeline.result_cache = "hit"
                tracker = settlement.cached(req, use.cache.hit_prompt_price)
                source = replayed(cached)
            else:
                settlement.queued()
                session = binding.session if binding else session_of(request, plan.user, principal)
                lease = await admit(gen, plan, req, principal, klass, asked, session, watch, timeline)
                headers[QUEUE_WAIT_HEADER] = f"{lease.queue_wait:.3f}"
                tracker = settlement.admitted(lease, req)
                source = sources(gen.scheduler, lease, req)
                if use is not None and isinstance(source, AsyncGenerator):  # one choice: deterministic()
                    headers[CACHE_HEADER] = timeline.result_cache = "miss"
                    source = use.cache.recorded(source, use.key, gen.tasks.spawn)
            output = output_guard(gen, policy, context, tracker, timeline, salt)
            prefix = "chatcmpl-" if plan.kind == "chat" else "cmpl-"
            formatter = Formatter(
                plan, prefix + plan.request_id, plan.model_name, int(time.time()), renderer.tokenizer
            )
            labels = [decision.label if decision else "input=off"]
            gate = None
            if gated is not None and route is not None:
                gate = _gate(gated, route, plan.stream, headers, timeline, output)
            return await answer(
                gen,
                source,
                tracker,
                output,
                watch,
                formatter,
                headers,
                labels,
                timeline,
                stream=plan.stream,
                gate=gate,
            )
    except ClientDisconnectedError:
        # Settled above: refunded and reported cancelled, or the tracker's outcome.
        return Response(content=b"", status_code=CLIENT_CLOSED)


def _gate(
    cascade: CascadeSpec,
    route: RouteDecision,
    stream: bool,
    headers: dict[str, str],
    timeline: RequestTimeline,
    output: OutputGuard | None,
) -> Transform:
    """The cascade's confidence gate of a routed attempt: a stream decided on its first tokens, a whole
    answer on all of them; the confidence measured goes in the route's header, log and trace line and in
    the output guard's audit records (set before any output is released)."""

    def measured(confidence: float, _tokens: int) -> None:
        text = route.describe(confidence)
        headers[ROUTE_HEADER] = timeline.model_route = text
        if output is not None:
            output.context = replace(output.context, route=text)

    within = cascade.within_tokens if stream else None
    return confidence_gate(cascade.min_mean_logprob, within, measured)
