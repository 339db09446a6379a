"""Structured reasons for review decisions.

A reviewer who upholds or overturns an appeal picks a reason code from a configurable list (`[appeals]
reasons`) and may add free text: `facts`, the facts relied on, which the consumer reads, and `note`, which
stays internal. Each code carries the fields of an EU DSA statement of reasons (Art. 17; the DSA Transparency
Database's `decision_ground` and `category`) and the public text the consumer reads. The reason is kept whole
with the event that decides the appeal, so a statement reads as it was given even after the list changes
(`policy.appeals.statement`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

Outcome = Literal["upheld", "overturned"]
# DSA decision grounds: content illegal, or incompatible with the provider's terms; an overturn restricts
# nothing, so it has none.
Ground = Literal["illegal_content", "incompatible_content", "none"]
CODE_PATTERN = r"^[a-z0-9_]{1,64}$"


class ReasonCode(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One reason a reviewer may give for an outcome."""

    code: Annotated[str, msgspec.Meta(pattern=CODE_PATTERN)]
    outcome: Outcome
    ground: Ground
    # The DSA statement category (e.g. STATEMENT_CATEGORY_ILLEGAL_OR_HARMFUL_SPEECH); "" for an overturn.
    category: str = ""
    # What the consumer reads: the public part of the reason.
    text: Annotated[str, msgspec.Meta(min_length=1, max_length=1000)]


DEFAULT_REASONS: tuple[ReasonCode, ...] = (
    ReasonCode(
        code="harmful_request",
        outcome="upheld",
        ground="incompatible_content",
        category="STATEMENT_CATEGORY_ILLEGAL_OR_HARMFUL_SPEECH",
        text="The content asks for or gives help with serious harm, which the usage policy does not allow.",
    ),
    ReasonCode(
        code="prompt_injection",
        outcome="upheld",
        ground="incompatible_content",
        category="STATEMENT_CATEGORY_SCOPE_OF_PLATFORM_SERVICE",
        text="The content tries to override the service's instructions or safety checks.",
    ),
    ReasonCode(
        code="illegal_content",
        outcome="upheld",
        ground="illegal_content",
        category="STATEMENT_CATEGORY_ILLEGAL_OR_HARMFUL_SPEECH",
        text="The content is illegal where the service is provided.",
    ),
    ReasonCode(
        code="false_positive",
        outcome="overturned",
        ground="none",
        text="The content does not breach the usage policy: the automated check was mistaken.",
    ),
    ReasonCode(
        code="benign_context",
        outcome="overturned",
        ground="none",
        text="The content touches a sensitive topic in an allowed context (teaching, fiction, news).",
    ),
)


class ReasonError(ValueError):
    """No reason code, or one that is not configured for the outcome; `message` says which are."""


def reason_for(reasons: Sequence[ReasonCode], outcome: str, code: str | None) -> ReasonCode:
    """The configured reason `code` for `outcome` (upheld or overturned), or ReasonError."""
    allowed = [r.code for r in reasons if r.outcome == outcome]
    if not code:
        raise ReasonError(f"a decision needs a reason_code: one of {', '.join(allowed)}")
    for reason in reasons:
        if reason.code == code and reason.outcome == outcome:
            return reason
    raise ReasonError(f"reason_code {code!r} is not a reason to {outcome[:-2]}: one of {', '.join(allowed)}")


def check_reasons(reasons: Sequence[ReasonCode]) -> None:
    """ValueError unless the codes are unique and each outcome has at least one."""
    codes = [r.code for r in reasons]
    if len(set(codes)) != len(codes):
        raise ValueError("appeals.reasons: codes must be unique")
    for outcome in ("upheld", "overturned"):
        if not any(r.outcome == outcome for r in reasons):
            raise ValueError(f"appeals.reasons: at least one reason for {outcome} is needed")
    for reason in reasons:
        if (reason.outcome == "overturned") != (reason.ground == "none"):
            raise ValueError(f"appeals.reasons: {reason.code}: an overturn, and only one, has ground none")
