"""Routes: a public model name that chooses the model of each request (`registry.models.RouteSpec`), and
serves it from a fallback when the chosen model's pool is saturated or unhealthy.

    features (prompt tokens as the route's default model counts them, capabilities asked, tenant, API key,
    priority class, queue deadline, the tenant's tokens left) -> the first rule that holds, else the default
    -> that model; refused by its pool before anything was sent -> the next fallback, planned again with its
    own tokenizer and chat template (never the first model's); with a cascade, an answer whose confidence
    is under the threshold -> the cascade's strong model (`gateway.generation.confidence`)

What falls back (the refusal's code -> the reason): a pool that is saturated (`queue_full` 503, the whole
queue's; `deadline_unmeetable`: its predicted wait is past the request's deadline; `engine_overloaded`) or
unhealthy (`no_healthy_replica`, `engine_unavailable`, `no_engine_for_pool`). These are all raised before the
response starts: a stream that has released tokens never switches models. Anything else (a 400, the
tenant's own quota or backlog, a blocked input) is the answer.

Each attempt runs the whole pipeline (quota, input guard, admission, engine, output guard, audit): a refused
attempt is refunded and its refusal recorded, an escalated one is charged for what it generated (outcome
`escalated`), and the one that answers is recorded with its decision. The
decision is in the response header `x-lockgate-route`, the audit records (`route=`), the request log and the
trace (`model_route`), and `lockgate:route_decisions_total{route,target,reason}`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from litestar import Response

from gateway.errors import APIError
from gateway.generation.confidence import LowConfidence
from gateway.generation.context import RouteCounts
from gateway.generation.planning import Plan
from gateway.generation.prompts import PromptRenderer
from registry.models import CascadeSpec, RouteRule, RouteSpec
from registry.view import ResolvedRoute

log = logging.getLogger("lockgate.routes")
ROUTE_HEADER = "x-lockgate-route"
# A pool's refusals another model may answer for, by code: the fallback reason each is.
FALLBACK_REASONS = {
    "queue_full": "saturated",
    "deadline_unmeetable": "saturated",
    "engine_overloaded": "saturated",
    "no_healthy_replica": "unhealthy",
    "engine_unavailable": "unhealthy",
    "no_engine_for_pool": "unhealthy",
}


class Features(msgspec.Struct, frozen=True, kw_only=True):
    """What a route's rules read of a request."""

    prompt_tokens: int
    capabilities: frozenset[str]
    tenant: str
    tier: str
    key_id: str
    klass: str
    deadline_s: float  # seconds it may wait in the queue
    tokens_left: float | None  # in the tenant's token quota (None: no token quota, or not asked)


class RouteDecision(msgspec.Struct, frozen=True, kw_only=True):
    """Which model one attempt of a routed request runs on, and why."""

    route: str  # name@version
    rule: str  # the rule that held; "" for the default
    target: str  # the model name (or name@version) it runs on
    fallback: str = ""  # saturated | unhealthy: why the model chosen before this one did not serve it
    # The route's cascade, where this attempt's answer is gated on its confidence.
    cascade: CascadeSpec | None = None
    # The confidence of the answer that was escalated to this attempt (None: not an escalation).
    escalated_from: float | None = None

    @property
    def reason(self) -> str:
        """The metric's reason: `rule:<name>`, `default`, `fallback:<why>` or `escalated`."""
        if self.escalated_from is not None:
            return "escalated"
        if self.fallback:
            return f"fallback:{self.fallback}"
        return f"rule:{self.rule}" if self.rule else "default"

    def describe(self, confidence: float | None = None) -> str:
        """One line for the header, the audit record, the log and the trace; `confidence`: the answer's,
        measured by the cascade's gate."""
        parts = [f"{self.route} rule={self.rule or 'default'} target={self.target}"]
        if self.fallback:
            parts.append(f"fallback={self.fallback}")
        if self.escalated_from is not None:
            parts.append(f"escalated confidence={self.escalated_from:.3f}")
        if confidence is not None:
            parts.append(f"confidence={confidence:.3f}")
        return " ".join(parts)


def capabilities(plan: Plan) -> frozenset[str]:
    """What a request asks of its model that a route may route by."""
    asked = set()
    if plan.tools is not None:
        asked.add("tools")
    if plan.pending_schema is not None or plan.engine_request.sampling.constraint is not None:
        asked.add("structured")
    if plan.logprobs:
        asked.add("logprobs")
    return frozenset(asked)


def holds(rule: RouteRule, f: Features) -> bool:
    """Whether every condition `rule` gives holds for a request of features `f`."""
    return (
        (rule.min_prompt_tokens is None or f.prompt_tokens >= rule.min_prompt_tokens)
        and (rule.max_prompt_tokens is None or f.prompt_tokens <= rule.max_prompt_tokens)
        and (not rule.capabilities or not f.capabilities.isdisjoint(rule.capabilities))
        and (not rule.tenants or f.tenant in rule.tenants)
        and (not rule.tiers or f.tier in rule.tiers)
        and (not rule.keys or f.key_id in rule.keys)
        and (not rule.priority or f.klass in rule.priority)
        and (rule.max_deadline_s is None or f.deadline_s <= rule.max_deadline_s)
        and (
            rule.max_budget_tokens is None
            or (f.tokens_left is not None and f.tokens_left <= rule.max_budget_tokens)
        )
    )


def choose(spec: RouteSpec, f: Features) -> tuple[str, str]:
    """(target, rule name) of the first rule that holds; (default, "") when none does."""
    for rule in spec.rules:
        if holds(rule, f):
            return rule.target, rule.name
    return spec.default, ""


def reads_budget(spec: RouteSpec) -> bool:
    """Whether a rule reads the tenant's tokens left (a quota store read, made only then)."""
    return any(rule.max_budget_tokens is not None for rule in spec.rules)


def fallback_reason(exc: APIError) -> str:
    """Why another model may answer a request `exc` refused ("": it may not: the refusal is the answer)."""
    return FALLBACK_REASONS.get(exc.code or "", "") if exc.status_code != 429 else ""


Planner = Callable[[str], Awaitable[tuple[Plan, PromptRenderer]]]
Runner = Callable[[Plan, PromptRenderer, RouteDecision], Awaitable[Response[Any]]]


async def routed(
    route: ResolvedRoute,
    plan_for: Planner,
    features_of: Callable[[Plan], Awaitable[Features]],
    run: Runner,
    counts: RouteCounts,
) -> Response[Any]:
    """A request to `route`: planned on the default model to read its features, then run on the model
    chosen, or on each fallback in turn while the one before is refused for a fallback reason."""
    spec = route.spec
    plans: dict[str, tuple[Plan, PromptRenderer]] = {}

    async def planned(name: str) -> tuple[Plan, PromptRenderer]:
        if name not in plans:
            plans[name] = await plan_for(name)
        return plans[name]

    # The features as the default model reads them (its tokenizer counts the prompt), or as the first other
    # model of the route that can plan the request: while the default's pool is gone, or when the prompt
    # needs more context than the default has (what a rule on prompt tokens routes away from it).
    readers = list(dict.fromkeys([spec.default, *spec.targets]))
    first_error: APIError | None = None
    for name in readers:
        try:
            reader = await planned(name)
            break
        except APIError as exc:
            if not fallback_reason(exc) and exc.code != "context_length_exceeded":
                raise
            first_error = first_error or exc
    else:
        assert first_error is not None  # a route has at least its default
        raise first_error
    chosen, rule = choose(spec, await features_of(reader[0]))
    candidates = [chosen, *(f for f in spec.fallbacks if f != chosen)]
    cascade = spec.cascade
    why = ""
    for i, candidate in enumerate(candidates):
        gated = cascade if cascade is not None and candidate != cascade.strong else None
        decision = RouteDecision(route=route.ref, rule=rule, target=candidate, fallback=why, cascade=gated)
        try:
            answer = await run(*await planned(candidate), decision)
        except LowConfidence as low:
            assert cascade is not None  # only a gated attempt raises it
            counts[(route.ref, candidate, "low_confidence")] += 1
            stronger = RouteDecision(
                route=route.ref, rule=rule, target=cascade.strong, escalated_from=low.confidence
            )
            answer = await run(*await planned(cascade.strong), stronger)
            counts[(route.ref, cascade.strong, stronger.reason)] += 1
            return answer
        except APIError as exc:
            why = fallback_reason(exc)
            if not why or i == len(candidates) - 1:
                raise
            log.info("route %s: %s refused (%s), falling back", route.ref, candidate, exc.code)
            counts[(route.ref, candidate, f"refused:{why}")] += 1
            continue
        counts[(route.ref, candidate, decision.reason)] += 1
        return answer
    raise AssertionError("unreachable: the last candidate returns or raises")
