"""The statement of reasons a consumer reads of a decided appeal (`GET /v1/appeals/{id}`): the outcome and
the public part of the reviewer's reason (`policy.appeals.reasons`): the reason code with its DSA ground,
category and text as the deciding event kept them, the facts relied on, whether the decision reviewed was
detected by automated means (every gate decision is; a reviewer's own is not), and that the review was not
automated. The reviewer's `note` stays internal.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from policy.appeals.base import Appeal, AppealEvent
from policy.appeals.reasons import Ground, Outcome


class StatementOfReasons(msgspec.Struct, frozen=True, kw_only=True):
    """What a consumer reads of a decided appeal: the outcome and the public part of its reason."""

    outcome: Outcome
    reason_code: str
    ground: Ground
    category: str
    text: str  # the reason code's public text
    facts: str  # the facts relied on, as the reviewer wrote them for the consumer
    # The decision reviewed was detected by automated means (the gate), unless a reviewer made it.
    automated_detection: bool
    # The review decision itself was taken by a person.
    automated_decision: bool = False
    decided_at: float


def statement(
    appeal: Appeal, events: Sequence[AppealEvent], *, automated_detection: bool
) -> StatementOfReasons | None:
    """The statement of reasons of a decided appeal; None while undecided, or for an appeal decided before
    reasons were recorded."""
    decided = next((e for e in reversed(events) if e.to_state == appeal.state), None)
    if appeal.state not in ("upheld", "overturned") or decided is None or decided.reason is None:
        return None
    reason = decided.reason
    return StatementOfReasons(
        outcome=reason.outcome,
        reason_code=reason.code,
        ground=reason.ground,
        category=reason.category,
        text=reason.text,
        facts=decided.facts,
        automated_detection=automated_detection,
        decided_at=decided.at,
    )
