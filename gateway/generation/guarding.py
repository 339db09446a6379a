"""The safety stages of a request at the HTTP edge: the input check before admission, the output guard built
for the generation stage (`policy.safety.output`), and their refusals as HTTP errors.

A request the input guard blocks or cannot check costs no engine time and gets its quota reservation back
(`settlement`). `x-lockgate-guard` says which path decided (`input=rules`, `input=model`, `input=fail_open`,
...).
"""

from __future__ import annotations

from gateway.errors import APIError, EngineUnavailableError, InvalidRequestError, retry_after_headers
from gateway.generation.context import Generation
from gateway.generation.planning import Plan
from gateway.generation.tracking import RequestTracker
from gateway.observe.timeline import RequestTimeline
from guard.base import GuardInput
from policy.safety.decision import GuardDecision
from policy.safety.gate import AUDIT_FULL, RecordContext, SafetyGate
from policy.safety.output import OutputGuard, categories_of
from registry.view import ResolvedPolicy

# Which path of the safety policy decided: `input=<source>` and, for whole responses, `output=<source>`.
GUARD_HEADER = "x-lockgate-guard"


def check_alternatives(gate: SafetyGate, plan: Plan, policy: ResolvedPolicy) -> None:
    """400 for a request asking for alternatives to the chosen tokens (chat `top_logprobs`, completions
    `logprobs: N`) under an output guard, unless its policy allows them: the guard reads the chosen tokens
    only, so the alternatives would reach the client unchecked. Chosen-token logprobs stay allowed."""
    if (plan.engine_request.sampling.logprobs or 0) <= 0 or policy.spec.allows_top_logprobs:
        return
    if not gate.guards(policy, "output"):
        return
    field = "top_logprobs" if plan.kind == "chat" else "logprobs"
    raise InvalidRequestError(
        f"{field} above 0 is not allowed under this tenant's safety policy ({policy.ref}): the output guard "
        "checks the chosen tokens, never their alternatives; ask for logprobs of the chosen tokens only",
        param=field,
        code="unsupported_value",
    )


async def check_input(
    gate: SafetyGate,
    plan: Plan,
    policy: ResolvedPolicy,
    context: RecordContext,
    timeline: RequestTimeline,
    cache_salt: str,
) -> GuardDecision | None:
    """The input guard's decision on the plan's spans (None: the policy guards no input)."""
    if not gate.guards(policy, "input"):
        return None
    item = GuardInput(
        direction="input",
        spans=plan.spans,
        categories=categories_of(policy),
        policy=policy.ref,
        cache_salt=cache_salt,
    )
    start = timeline.now()
    decision = await gate.check(policy, item, context)
    timeline.guard_check("input", start, decision)
    timeline.phase("input_guard", start)
    return decision


def output_guard(
    gen: Generation,
    policy: ResolvedPolicy,
    context: RecordContext,
    tracker: RequestTracker,
    timeline: RequestTimeline,
    cache_salt: str,
) -> OutputGuard | None:
    """The request's output guard (None: the policy guards no output)."""
    if not gen.gate.guards(policy, "output"):
        return None
    window = gen.config.guard.output_window_tokens
    return OutputGuard(
        gen.gate, policy, context, tracker, timeline, cache_salt=cache_salt, window_tokens=window
    )


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


def output_error(decision: GuardDecision) -> APIError:
    """The HTTP error (or the stream's error event) for output the policy blocked, or could not check."""
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
