"""The output side of one request under its safety policy: the moderator's checks of the generated text
(`guard.moderator` holds it back and calls them), evaluated by the gate, and the one audit record they leave.

Beside the gate it drives: the request path (`gateway.generation`) builds an `OutputGuard` per request and
applies its `transform` to each choice's engine stream; what it needs of the request (its usage tracker and
timeline) it reads through the two small protocols below, so policy/ imports nothing of the gateway.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Literal, Protocol

from engines.base import EngineDelta
from guard.base import GuardInput, Span
from guard.moderator import moderate
from policy.safety.decision import GuardDecision
from policy.safety.gate import Evaluation, RecordContext, SafetyGate
from registry.view import ResolvedPolicy

# Non-streaming output is checked once, at the end (in bounded windows: `guard.moderator`).
_WHOLE = 1 << 30

Transform = Callable[[AsyncGenerator[EngineDelta, None]], AsyncGenerator[EngineDelta, None]]


class UsageTracker(Protocol):
    """What the output checks tell the request's usage tracker (`gateway.generation.tracking`)."""

    def guard_scored(self, tokens: int) -> None:
        """A window of `tokens` generated tokens is about to be scored (charged with the usage)."""

    def finish(self, status: Literal["blocked"]) -> object:
        """The output was blocked: the request ends, charged as far as it got."""


class CheckTimeline(Protocol):
    """Where the output checks' times go (`gateway.observe.timeline.RequestTimeline`)."""

    def now(self) -> float:
        """The clock's time now."""

    def guard_check(self, direction: str, start: float, decision: GuardDecision) -> None:
        """One check that started at `start` and ended now."""


def categories_of(policy: ResolvedPolicy) -> tuple[str, ...]:
    """The names of the policy's categories, as a guard input lists them."""
    return tuple(c.name for c in policy.spec.categories)


class OutputGuard:
    """The output side of one request: a check session per choice for the moderator, and what was decided."""

    def __init__(
        self,
        gate: SafetyGate,
        policy: ResolvedPolicy,
        context: RecordContext,
        tracker: UsageTracker,
        timeline: CheckTimeline,
        *,
        cache_salt: str,
        window_tokens: int,
    ) -> None:
        """`window_tokens`: the size of the windows a whole answer is scored in (`[guard]
        output_window_tokens`)."""
        self.gate = gate
        self.cache_salt = cache_salt
        self.policy = policy
        self.context = context
        self.tracker = tracker
        self.categories = categories_of(policy)
        self.timeline = timeline
        self.window_tokens = window_tokens
        # The latest decision acted on (any choice's), for the `x-lockgate-guard` header.
        self.decision: GuardDecision | None = None

    def transform(self, *, whole: bool) -> Transform:
        """The moderation of one choice's engine stream: checked every few tokens, or once at the end."""
        spec = self.policy.spec
        hold_back, every = spec.hold_back_tokens, spec.check_every_tokens
        # A streaming check scores about every + hold_back tokens; what is longer (a whole answer, checked
        # once at the end) is scored in windows of the configured size overlapping by hold_back.
        window = max(self.window_tokens, every + hold_back)

        def apply(deltas: AsyncGenerator[EngineDelta, None]) -> AsyncGenerator[EngineDelta, None]:
            checks = OutputChecks(self)
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


class OutputChecks:
    """The output checks of one choice, which leave one audit record between them.

    Each check is evaluated by the gate without being recorded; the one that matters is kept: a block or
    refusal (it ends the output, and is recorded before it is acted on), else the first flagged allow (an
    escalation or a fail-open, which a reviewer must see even when later windows were clean), else the last
    allow. It is recorded once, with the number of checks and the tokens they scored: at a block, at the
    final check (before the last held text is released, so a full audit trail can still refuse it), or
    when the moderation ends otherwise (client gone, engine error)."""

    def __init__(self, guard: OutputGuard) -> None:
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
        evaluation = await guard.gate.evaluate(guard.policy, item, guard.context)
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
            guard.gate.commit_allow(guard.policy, self._kept, checks=self._checks, guard_tokens=self._tokens)

    async def _record(self, evaluation: Evaluation) -> GuardDecision:
        self._recorded = True
        guard = self._guard
        return await guard.gate.commit(
            guard.policy, evaluation, checks=self._checks, guard_tokens=self._tokens
        )
