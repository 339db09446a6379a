"""What the routes that check texts one by one share (`moderations`, `embeddings`): the texts' tokens and one
request reserved before any check (a refusal tallied in the audit trail), the record context of their
checks, and one text checked by the tenant's input guard as one untrusted span."""

from __future__ import annotations

from gateway.errors import APIError
from gateway.generation.audit import record_refusal
from gateway.generation.guarding import guard_api_error
from gateway.generation.metering import reserve_tokens
from gateway.observe.timeline import RequestTimeline
from gateway.services import Services
from guard.base import GuardInput, Span
from policy.auth import Principal
from policy.quota.meter import Charge
from policy.safety.decision import GuardDecision, Purpose
from policy.safety.gate import RecordContext
from registry.view import ResolvedPolicy


async def reserve_inputs(
    services: Services,
    principal: Principal,
    request_id: str,
    count: int,
    tokens: int,
    timeline: RequestTimeline,
) -> Charge:
    """Reserve `tokens` tokens of `count` inputs and one request, or raise the HTTP error (tallied)."""
    start = timeline.now()
    try:
        return await reserve_tokens(
            services.meter,
            principal,
            tokens,
            need=f"{count} inputs of {tokens} tokens",
            param="input",
            advice="send fewer or shorter inputs, or ask for a larger quota",
        )
    except APIError as exc:
        record_refusal(services.generation, principal, request_id, "quota", exc)
        raise
    finally:
        timeline.phase("quota", start)


def input_context(principal: Principal, request_id: str, purpose: Purpose) -> RecordContext:
    """How the checks of one call are recorded."""
    return RecordContext(
        tenant=principal.tenant.tenant_id,
        key_id=principal.key.key_id,
        request_id=request_id,
        purpose=purpose,
        retain_prompts=principal.tenant.retain_prompts,
    )


async def check_text(
    services: Services,
    policy: ResolvedPolicy,
    text: str,
    context: RecordContext,
    salt: str,
    timeline: RequestTimeline,
    *,
    param: str,
    blocking: bool,
) -> GuardDecision | None:
    """One text's decision (recorded by the gate), None when the policy does not check inputs. A refusal (the
    policy cannot check it now, or cannot read it, and fails closed) raises the chat input's error naming
    `param`; so does a block when `blocking` (a moderation reports blocks, an embedding is refused)."""
    if not services.gate.guards(policy, "input"):
        return None
    item = GuardInput(
        direction="input",
        spans=(Span(text=text, source="user"),),
        categories=tuple(c.name for c in policy.spec.categories),
        policy=policy.ref,
        cache_salt=salt,
    )
    start = timeline.now()
    decision = await services.gate.check(policy, item, context)
    timeline.guard_check("input", start, decision)
    if decision.action == "refuse" or (blocking and decision.action != "allow"):
        raise guard_api_error(decision, {}, param=param)
    return decision
