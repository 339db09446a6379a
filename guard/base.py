"""The `Classifier` protocol and the messages that cross it.

A classifier answers one question about one piece of text under one policy: how likely is it unsafe? It
never decides what a failure means; it raises `GuardError` and the policy's fail mode decides.

Exceptions::

    GuardError                   a guard could not score the item (engine error, malformed output, timeout)
    ├── GuardInputError          the item itself cannot be scored (its text, its policy's categories)
    ├── GuardTimeoutError        the guard did not answer within its stage's timeout
    ├── GuardUnavailableError    the guard is not called at all (its circuit breaker is open)
    └── GuardOverloadedError     the guard is not called: its engine is too busy to answer in time

Whose failure it is decides what counts on a guard's circuit breaker, which every tenant of the guard
shares (`guard.cascade.Stage.score`). A `GuardInputError` is the item's own: the guard works, this item
cannot be scored (a text past the windows a guard checks, an answer that is not a label because the text
talks the guard model out of answering). Any caller can produce one at will, so it never counts: it is
answered, for that request only, by the policy's fail mode. Every other GuardError is the guard's (its
engine dead or failing, malformed answers, timeouts) and counts.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import msgspec

# Where a span of text comes from. `system` spans the tenant configured are trusted; everything a caller or a
# tool supplied is not, and generated `output` is what the output guard checks.
Source = Literal["system", "user", "assistant", "tool", "document", "output"]
Direction = Literal["input", "output"]


class GuardError(Exception):
    """A guard could not score an item. Never read as "safe". `retry_after`: seconds until a call may go
    ahead again, where that is known (0: unknown)."""

    retry_after: float = 0.0


class GuardInputError(GuardError):
    """The item cannot be scored because of what it holds, not because the guard is failing: a text longer
    than the guard checks, a label mass too small on this text, a template that leaves this policy's item
    no room. Decided for its request by the policy's fail mode; never counted on the guard's breaker."""


class GuardUnavailableError(GuardError):
    """The guard was not called: its circuit breaker is open after repeated failures. `retry_after`: seconds
    until the breaker lets a probe through (0 while a probe is out)."""

    def __init__(self, message: str, *, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GuardTimeoutError(GuardError):
    """The guard did not answer within its stage's timeout."""


class GuardOverloadedError(GuardError):
    """The guard was not called: the work queued on its engine would keep the call waiting longer than the
    check may wait (`guard.cascade.Stage.score`). `retry_after`: seconds until that work is short enough."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Span(msgspec.Struct, frozen=True, kw_only=True):
    """One piece of the text under check, with where it came from and whether it is trusted."""

    text: str
    source: Source
    trusted: bool = False


class GuardInput(msgspec.Struct, frozen=True, kw_only=True):
    """What a classifier judges: the spans of a request's input, or the output generated so far."""

    direction: Direction
    spans: tuple[Span, ...]
    # The policy's category names the classifier is asked about (a prompt may list them).
    categories: tuple[str, ...] = ()
    policy: str = ""  # name@version of the policy, for prompts that name it
    # The prefix-cache salt of the tenant the item is checked for ("" = none): a guard's engine calls carry
    # it, as the tenant's generation requests do, so no tenant can time a guard check to learn which
    # prefixes another tenant's checks left in the engine's cache.
    cache_salt: str = ""

    def text(self, *, untrusted_only: bool = False) -> str:
        """The spans' text joined by blank lines (only the untrusted ones when asked)."""
        return "\n\n".join(s.text for s in self.spans if not (untrusted_only and s.trusted))

    def readings(self) -> tuple[str, ...]:
        """The texts a model guard scores, the worst deciding: the judged text (an input's untrusted spans,
        an output's text) joined, and, for an input of several untrusted spans, the longest of them alone.

        A model judges a joined text as a whole, so turns around a passage dilute it: a request pasted as a
        tool result, after the assistant's call and before "Do it now.", scores lower than the same request
        as a user message. The longest span alone is read as it would be on its own, at the cost of one more
        reading (not one per span: a long conversation is still two)."""
        judged = [s.text for s in self.spans if not (self.direction == "input" and s.trusted)]
        joined = "\n\n".join(judged)
        if self.direction != "input" or len(judged) < 2:
            return (joined,)
        longest = max(judged, key=len)
        return (joined, longest) if longest.strip() else (joined,)


class GuardScore(msgspec.Struct, frozen=True, kw_only=True):
    """A classifier's answer: P(unsafe) in [0, 1], the category it points at, and how it was obtained."""

    p_unsafe: float
    # The category the evidence points at ("" when the classifier does not know which).
    category: str = ""
    # Which guard produced it: "rules", or the guard model's name@version.
    guard: str
    # The model version it ran on and the sha256 of the rendered prompt template ("" where none).
    model: str = ""
    template_sha256: str = ""
    latency_s: float = 0.0
    # What the classifier saw, for audit and debugging: label masses, the matched rule, and the like.
    raw: dict[str, float | str] = msgspec.field(default_factory=dict)


@runtime_checkable
class Classifier(Protocol):
    """One guard: scores an item, or raises GuardError."""

    name: str

    async def classify(self, item: GuardInput) -> GuardScore:
        """P(unsafe) of `item`; GuardError when it cannot say."""
        ...


@runtime_checkable
class Queued(Protocol):
    """A classifier whose calls queue for an engine shared with others (`guard.backlog`)."""

    def expected_wait(self) -> float:
        """Seconds until a call made now would be answered, from the work queued ahead of it (0: unknown)."""
        ...


@runtime_checkable
class ItemSized(Protocol):
    """A classifier that can tell, cheaply and before scoring, whether an item is more than one unit of its
    work (one engine prompt, one encoder batch): such an item's timeout may be its own size's doing."""

    def oversized(self, item: GuardInput) -> bool:
        """Whether `item` may take more than one unit of this guard's work (an estimate, no tokenizer)."""
        ...
