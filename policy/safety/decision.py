"""From a cascade result to a decision under the policy: allow, block, or refuse (guard unavailable).

The guard cascade reports what it found; this module decides what that means, including when a guard failed.
A failure never counts as "safe": the fail modes of the categories the failed stage was responsible for
decide. Any `closed` category refuses the request (503 `guard_unavailable`, source `fail_closed`); when all
are `open`, the request goes on (source `fail_open`), flagged and counted.

`GuardRecord` is what each decision leaves for the audit trail: the policy version and hash, every stage run,
the decision and its source, and the content's sha256 (the content itself only under `retention = "full"`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec

from guard.base import Direction
from guard.cascade import CascadeResult, StageRun
from registry.models import PolicySpec

Action = Literal["allow", "block", "refuse"]
# What a check was for: a generation request's input or output, a `POST /v1/moderations` input (checked and
# answered, never generated from), or a `POST /v1/embeddings` input (checked before it is embedded).
Purpose = Literal["request", "moderation", "embedding"]
AnsweredFrom = Literal["engine", "cache"]
Source = Literal["none", "rules", "model", "band", "fail_open", "fail_closed"]


class GuardDecision(msgspec.Struct, frozen=True, kw_only=True):
    """What the policy makes of one cascade result."""

    direction: Direction
    action: Action
    source: Source
    category: str = ""
    # Allowed but to be reviewed: an escalation past the last stage, or a fail-open.
    flagged: bool = False
    result: CascadeResult | None = None

    @property
    def label(self) -> str:
        """`direction=source` for the `x-lockgate-guard` header, e.g. `input=rules` or `output=fail_open`."""
        return f"{self.direction}={self.source}"


def decide(result: CascadeResult, spec: PolicySpec, direction: Direction) -> GuardDecision:
    """The policy's decision on `result`."""
    if result.verdict == "error":
        closed = [c for c in result.failed_categories if spec.fail_modes.get(c, "closed") == "closed"]
        if closed or not result.failed_categories:
            return GuardDecision(
                direction=direction,
                action="refuse",
                source="fail_closed",
                category=",".join(closed),
                result=result,
            )
        return GuardDecision(
            direction=direction, action="allow", source="fail_open", flagged=True, result=result
        )
    if result.decided_by is None:
        if not result.runs:
            return GuardDecision(direction=direction, action="allow", source="none", result=result)
        action: Action = "block" if result.verdict == "block" else "allow"
        return GuardDecision(
            direction=direction,
            action=action,
            source="band",
            category=result.category,
            flagged=result.verdict == "escalate",
            result=result,
        )
    run = result.runs[result.decided_by]
    source: Source = "rules" if run.guard == "rules" else "model"
    return GuardDecision(
        direction=direction,
        action="block" if result.verdict == "block" else "allow",
        source=source,
        category=result.category,
        result=result,
    )


class GuardRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One gate decision, as the audit trail will store it."""

    tenant: str
    key_id: str
    request_id: str
    direction: Direction
    policy: str  # name@version
    policy_hash: str
    action: Action
    source: Source
    category: str
    flagged: bool
    runs: tuple[StageRun, ...]
    content_sha256: str
    content: str | None = None  # only under retention = "full"
    at: float
    severity: str | None = None  # the decided category's severity in the policy
    # Output: the checks of the request's output this one record stands for (the decisive one or the last,
    # `policy.safety.output`), and the generated tokens they scored together.
    checks: int = 1
    guard_tokens: int = 0
    purpose: Purpose = "request"
    # Output: the answer checked was generated (`engine`) or served again from the result cache (`cache`).
    answered_from: AnsweredFrom = "engine"
    # A routed request: which route chose the model, by which rule, and any fallback.
    route: str = ""


RecordSink = Callable[[GuardRecord], None]
# A sink that returns once the record is durable (fsync'd or stored): for refusals, before they are answered.
DurableSink = Callable[[GuardRecord], Awaitable[None]]


def content_digest(text: str) -> str:
    """sha256 of the checked text (what the audit trail keeps under retention `hash`)."""
    return hashlib.sha256(text.encode()).hexdigest()
