"""`POST /v1/moderations`: text checked by the tenant's own safety policy, answered in OpenAI's shape.

    decode -> texts -> count tokens -> reserve quota -> one input check per text -> settle -> results

Nothing is generated. Each input is one untrusted span, checked with direction `input` by the policy cascade
`resolution.policy_for` resolves, exactly as a chat request's input is checked; the gate records each decision
(marked `purpose=moderation` in the audit trail). Inputs are checked one after another, in order: one call
never puts more than one check at a time on a guard's engine.

Metering is a request's: the tokens of the inputs (the served model's tokenizer) and one request are
reserved, and charged once every input was checked. A call the policy cannot check (a category failing
closed) is 503 `guard_unavailable` and gets its reservation back, as a refused chat request does.

`flagged` is true when the policy would block the text, and when a model stage scored it in its band (an
escalation for review: the model is unsure). An escalation by the rules stage alone is not flagged: its 0.5
says only that no rule matched. A fail-open (a guard down, its categories failing open) is not flagged: the
policy would let the text through; `lockgate.review` says it was escalated.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, Final

from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.status_codes import HTTP_200_OK

from gateway.api.checked_inputs import check_text, input_context, reserve_inputs
from gateway.api.openapi import errors, request_body, secured
from gateway.edge.decoding import Decoder, read_body
from gateway.edge.security import allow
from gateway.errors import InvalidRequestError
from gateway.generation.guarding import GUARD_HEADER
from gateway.generation.metering import charge_headers
from gateway.generation.resolution import policy_for
from gateway.observe.timeline import timeline_in
from gateway.requestid import request_id_of
from gateway.schemas import (
    ModerationInputPart,
    ModerationRequest,
    ModerationResponse,
    ModerationResult,
    ModerationVerdict,
)
from gateway.services import Services
from policy.auth import Principal
from policy.safety.decision import GuardDecision

# The request body, decoded with errors that name the field (immutable: shared by every request).
_REQUEST = Decoder(ModerationRequest)
# Every category key of OpenAI's `Moderation` (openai/types/moderation.py), in its order: always present.
OPENAI_CATEGORIES: Final = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/instructions",
    "self-harm/intent",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)
# A policy category -> OpenAI's name for it. Names OpenAI uses map to themselves; categories not here keep
# their own names (extra keys, which the SDKs keep).
OPENAI_NAMES: Final = MappingProxyType(
    {
        **{name: name for name in OPENAI_CATEGORIES},
        "harassment_threatening": "harassment/threatening",
        "hate_threatening": "hate/threatening",
        "illicit_violent": "illicit/violent",
        "self_harm": "self-harm",
        "self_harm_instructions": "self-harm/instructions",
        "self_harm_intent": "self-harm/intent",
        "sexual_content": "sexual",
        "sex_crimes": "sexual",
        "sexual_minors": "sexual/minors",
        "child_exploitation": "sexual/minors",
        "violence_graphic": "violence/graphic",
        "violent_crimes": "violence",
        "weapons": "illicit/violent",
        "indiscriminate_weapons": "illicit/violent",
        "malware": "illicit",
        "nonviolent_crimes": "illicit",
    }
)
# Prefix of the response's `model`: the policy version that answered.
MODEL_PREFIX: Final = "lockgate-policy:"


def openai_name(category: str) -> str:
    """The key a policy category has in a moderation result."""
    return OPENAI_NAMES.get(category, category)


async def run_moderation(
    services: Services, req: ModerationRequest, request: Request[Any, Any, Any], principal: Principal
) -> Response[ModerationResponse]:
    """Check each input under the caller's tenant policy and answer OpenAI's `ModerationCreateResponse`."""
    request_id = request_id_of(request.scope)
    timeline = timeline_in(request.scope, services.clock)
    texts = input_texts(req.input, services.config.server.max_moderation_inputs)
    policy = policy_for(services.generation, principal)
    timeline.policy = policy.ref
    start = timeline.now()
    tokens = sum([len(await services.renderer.text(text)) for text in texts])
    timeline.phase("render", start)
    charge = await reserve_inputs(services, principal, request_id, len(texts), tokens, timeline)
    headers = charge_headers(charge)
    context = input_context(principal, request_id, "moderation")
    salt = services.secret.cache_salt(principal.tenant.tenant_id)
    start = timeline.now()
    try:
        decisions = [
            await check_text(services, policy, text, context, salt, timeline, param="input", blocking=False)
            for text in texts
        ]
    except BaseException:
        # Not answered (a check refused, or the client left): the whole reservation goes back.
        services.meter.settle_later(charge, 0)
        raise
    finally:
        timeline.phase("input_guard", start)
    services.meter.settle_later(charge, tokens)
    categories = tuple(c.name for c in policy.spec.categories)
    results = [moderation_result(decision, categories) for decision in decisions]
    headers[GUARD_HEADER] = "; ".join(d.label if d else "input=off" for d in decisions)
    body = ModerationResponse(id=f"modr-{request_id}", model=MODEL_PREFIX + policy.ref, results=results)
    return Response(content=body, headers=headers)


def input_texts(value: str | Sequence[str | ModerationInputPart], limit: int) -> list[str]:
    """The texts to check: `input` as a string, a list of strings, or a list of text parts; a 400 naming the
    field otherwise (an empty list, more than `limit` items, image or unknown parts, a part without text)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequestError(
            f"`input` is an empty list; send a string or a list of 1 to {limit} strings (or text parts)",
            param="input",
            code="invalid_value",
        )
    if len(value) > limit:
        raise InvalidRequestError(
            f"`input` holds {len(value)} items; at most {limit} per request (`server.max_moderation_inputs`)",
            param="input",
            code="invalid_value",
        )
    texts = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            texts.append(item)
        elif item.type == "image_url":
            raise InvalidRequestError(
                f"`input[{i}]` is an image; the tenant's safety policy reads text only",
                param=f"input[{i}]",
                code="unsupported_content",
            )
        elif item.type != "text":
            raise InvalidRequestError(
                f"`input[{i}].type` is {item.type!r}; expected 'text'",
                param=f"input[{i}].type",
                code="invalid_value",
            )
        elif item.text is None:
            raise InvalidRequestError(
                f"`input[{i}]` is a text part without `text`", param=f"input[{i}].text", code="invalid_value"
            )
        else:
            texts.append(item.text)
    return texts


def moderation_result(decision: GuardDecision | None, policy_categories: Sequence[str]) -> ModerationResult:
    """OpenAI's `Moderation` for one decision: every OpenAI category key, then the policy's other categories
    under their own names; a category is true when the result is flagged for it (an escalation: for the
    category of its most unsafe model score, else every category that stage judges), and scores are each
    category's highest stage score (0.0 where no stage pointed at it)."""
    scores = dict.fromkeys(OPENAI_CATEGORIES, 0.0)
    scores.update((openai_name(c), 0.0) for c in policy_categories if openai_name(c) not in scores)
    runs = decision.result.runs if decision is not None and decision.result is not None else ()
    for run in runs:
        if run.p_unsafe is not None and run.category:
            name = openai_name(run.category)
            scores[name] = max(scores.get(name, 0.0), run.p_unsafe)
    if decision is not None and decision.category:
        scores.setdefault(openai_name(decision.category), 0.0)
    flagged = decision is not None and _flagged(decision)
    categories = dict.fromkeys(scores, False)
    if flagged and decision is not None:
        # As OpenAI's: flagged means some category is true. An escalation names no category of its own:
        # the category its most unsafe model score was for, else the categories that stage judges.
        named: Sequence[str] = (decision.category,) if decision.category else ()
        scored = [r for r in runs if r.p_unsafe is not None and r.guard != "rules"]
        if not named and scored:
            top = max(scored, key=lambda r: r.p_unsafe or 0.0)
            named = (top.category,) if top.category else top.categories or tuple(policy_categories)
        for name in named:
            categories[openai_name(name)] = True
    verdict = (
        ModerationVerdict(action="allow", source="off")
        if decision is None
        else ModerationVerdict(
            action="block" if decision.action == "block" else "allow",
            source=decision.source,
            category=decision.category or None,
            review=decision.flagged,
        )
    )
    return ModerationResult(
        flagged=flagged,
        categories=categories,
        category_scores=scores,
        category_applied_input_types={name: ["text"] for name in scores},
        lockgate=verdict,
    )


def _flagged(decision: GuardDecision) -> bool:
    """Blocked, or escalated by a model stage (module docstring)."""
    if decision.action == "block":
        return True
    if decision.source != "band" or decision.result is None:
        return False
    # Past the last stage with no failure: every stage scored the text in its band.
    return any(run.guard != "rules" for run in decision.result.runs)


@post(
    "/v1/moderations",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        ModerationRequest,
        {"input": "I want to hurt them."},
        {"model": "omni-moderation-latest", "input": ["first text", "second text"]},
    ),
    responses={
        HTTP_200_OK: ResponseSpec(
            ModerationResponse,
            generate_examples=False,
            description=(
                "One result per input, in order, in OpenAI's `ModerationCreateResponse` shape: every OpenAI "
                "category key (false and 0.0 where the policy has no such category), the policy's other "
                "categories under their own names, and `lockgate` (what the policy decided, and how)."
            ),
        ),
        # Invalid input, a quota that can never fit, body over the limit, quota short.
        **errors(400, 413, 429),
    },
)
async def moderations(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[ModerationResponse]:
    """OpenAI moderations, answered by the tenant's own safety policy: each input is checked as a request's
    input is (recorded in the audit trail, metered), and nothing is generated."""
    allow(principal, "consumer")
    body = await read_body(request)
    return await run_moderation(services, _REQUEST.decode(body), request, principal)


ROUTES = [secured("openai", [moderations])]
