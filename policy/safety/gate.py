"""The safety gate: a tenant's policy version turned into a cascade, run on input and output, decided,
recorded and counted.

Cascades are built once per policy version (by content hash) and guards once per guard version, each with its
own circuit breaker, so a failing guard is skipped quickly by every policy that uses it. Model stages come
from a factory the gateway injects (policy/ never talks to engines); a rules stage runs the policy rules.
Every decision goes to the record sink (the audit trail) before the caller acts on it; a refusal (a block, or
a guard's fail-closed refusal) is durable (fsync'd in the spool, or stored) before it is answered, so a crash
after the answer cannot lose it. When the trail cannot take a record: a refusal that its reserve cannot hold
either turns into a 503 refusal (never a block left unrecorded); an allow follows the policy's fail mode
(refused under fail-closed, else served unaudited), and that refusal, caused by the full trail itself, draws
on no reserve: it is logged and counted (`counts[(direction, "audit_backpressure", action)]`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor

import msgspec

from engines.breaker import BreakerPolicy, CircuitBreaker
from guard.base import Classifier, Direction, GuardInput
from guard.cascade import Cascade, CombineStage, Stage
from guard.rules import RulesClassifier
from policy.audit.writer import AuditBackpressureError
from policy.safety.decision import (
    AnsweredFrom,
    DurableSink,
    GuardDecision,
    GuardRecord,
    Purpose,
    RecordSink,
    content_digest,
    decide,
)
from registry.view import ResolvedGuard, ResolvedPolicy

log = logging.getLogger("lockgate.guard")

ClassifierFactory = Callable[[ResolvedGuard], Classifier]
# The category of a refusal made because the audit trail could not take the decision's record.
AUDIT_FULL = "audit"


def build_cascade(
    policy: ResolvedPolicy,
    classifier_for: ClassifierFactory,
    *,
    executor: Executor | None = None,
    breaker: Callable[[str], CircuitBreaker] | None = None,
) -> Cascade:
    """The cascade of a policy version: a rules stage runs the policy's rules (off the event loop on
    `executor` for long items), a model stage the classifier `classifier_for` gives for its guard, behind
    the breaker `breaker` gives for the guard's ref (none without it: an evaluation must not trip the
    breakers serving requests)."""
    spec = policy.spec
    categories = tuple(c.name for c in spec.categories)
    guards = iter(policy.guards)
    stages: list[Stage | CombineStage] = []
    for stage in spec.stages:
        classifier: Classifier
        guard_breaker = None  # rules are deterministic and local: nothing to break
        if not isinstance(stage.combine, msgspec.UnsetType):  # a combine stage (validated on publish)
            stages.append(
                CombineStage(
                    stage.combine,
                    allow_below=stage.allow_below,
                    block_above=stage.block_above,
                    categories=stage.categories,
                    output_thresholds=stage.thresholds("output"),
                )
            )
            continue
        if stage.kind == "rules":
            classifier = RulesClassifier(spec.rules, stage.categories or categories, executor=executor)
        else:
            guard = next(guards)
            classifier = classifier_for(guard)
            guard_breaker = breaker(guard.ref) if breaker is not None else None
        stages.append(
            Stage(
                classifier,
                allow_below=stage.allow_below,
                block_above=stage.block_above,
                categories=stage.categories,
                timeout_s=stage.timeout_s,
                output_thresholds=stage.thresholds("output"),
                breaker=guard_breaker,
            )
        )
    return Cascade(stages, spec.past_last_stage, categories)


class RecordContext(msgspec.Struct, frozen=True, kw_only=True):
    """Who and what a decision is about, for its record."""

    tenant: str
    key_id: str
    request_id: str
    # A moderation check's record says so (`policy.safety.records.audit_draft`).
    purpose: Purpose = "request"
    # Where the answer the output guard checks came from: the engine, or the result cache (its record says).
    answered_from: AnsweredFrom = "engine"
    # The tenant's `retain_prompts`: the checked text goes in the record only when both this and the
    # policy (retention `full`) allow it. Off unless the caller says so: nothing is kept by default.
    retain_prompts: bool = False
    # A routed request: the route's decision (`gateway.generation.orchestration.RouteDecision.describe`).
    route: str = ""


class Evaluation(msgspec.Struct, frozen=True, kw_only=True):
    """A decision and the record it would leave, not yet recorded (`SafetyGate.evaluate`)."""

    decision: GuardDecision
    record: GuardRecord


class SafetyGate:
    """Runs policies' cascades and records their decisions."""

    def __init__(
        self,
        classifier_for: ClassifierFactory,
        sink: RecordSink,
        clock: Callable[[], float],
        breaker: BreakerPolicy,
        executor: Executor | None = None,
        durable: DurableSink | None = None,
    ) -> None:
        self._classifier_for = classifier_for
        # Where a rules stage matches a long item (off the event loop); None: always in place.
        self._executor = executor
        self._sink = sink
        # Where refusals go, returning once durable; None: to `sink` like the rest.
        self._durable = durable
        self._clock = clock
        self._breaker = breaker
        self._cascades: dict[str, Cascade] = {}
        self._guards: dict[str, Stage] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        # (direction, source, action) -> decisions; fail_open ones are what operators watch.
        self.counts: Counter[tuple[str, str, str]] = Counter()
        # (direction, guard, failure) -> stage runs that failed (timeout, overloaded, unavailable, error).
        self.stage_failures: Counter[tuple[str, str, str]] = Counter()

    def breaker(self, guard: str) -> CircuitBreaker:
        """The circuit breaker of guard `guard` (name@version, or "rules@<policy>")."""
        if guard not in self._breakers:
            self._breakers[guard] = CircuitBreaker(f"guard {guard}", self._breaker, self._clock)
        return self._breakers[guard]

    def cascade(self, policy: ResolvedPolicy) -> Cascade:
        """The cascade of a policy version, built on first use."""
        key = policy.policy.content_hash
        cascade = self._cascades.get(key)
        if cascade is None:
            cascade = self._build(policy)
            self._cascades[key] = cascade
        return cascade

    def _build(self, policy: ResolvedPolicy) -> Cascade:
        return build_cascade(policy, self._classifier_for, executor=self._executor, breaker=self.breaker)

    def guards(self, policy: ResolvedPolicy, direction: Direction) -> bool:
        """Whether `policy` checks this direction at all."""
        spec = policy.spec
        on = spec.guard_input if direction == "input" else spec.guard_output
        return on and bool(spec.stages)

    async def check(self, policy: ResolvedPolicy, item: GuardInput, context: RecordContext) -> GuardDecision:
        """Run the policy's cascade on `item`, decide, record and count the decision."""
        return await self.commit(policy, await self.evaluate(policy, item, context))

    async def evaluate(self, policy: ResolvedPolicy, item: GuardInput, context: RecordContext) -> Evaluation:
        """Run the policy's cascade on `item` and decide, without recording: a caller that checks one
        output many times (`guard.moderator`) records one of the checks (`commit`), not each. Failed stage
        runs are counted here, every time."""
        result = await self.cascade(policy).run(item)
        decision = decide(result, policy.spec, item.direction)
        text = item.text()
        severities = {c.name: c.severity for c in policy.spec.categories}
        record = GuardRecord(
            tenant=context.tenant,
            key_id=context.key_id,
            request_id=context.request_id,
            direction=item.direction,
            policy=policy.ref,
            policy_hash=policy.policy.content_hash,
            action=decision.action,
            source=decision.source,
            category=decision.category,
            flagged=decision.flagged,
            runs=result.runs,
            content_sha256=content_digest(text),
            content=text if policy.spec.retention == "full" and context.retain_prompts else None,
            at=self._clock(),
            severity=severities.get(decision.category),
            purpose=context.purpose,
            answered_from=context.answered_from,
            route=context.route,
        )
        for run in result.runs:
            if run.failure is not None:
                self.stage_failures[(item.direction, run.guard, run.failure)] += 1
        return Evaluation(decision=decision, record=record)

    async def commit(
        self, policy: ResolvedPolicy, evaluation: Evaluation, *, checks: int = 1, guard_tokens: int = 0
    ) -> GuardDecision:
        """Record and count an evaluated decision (made of `checks` checks that scored `guard_tokens`
        generated tokens, for output); the decision to act on, which a full audit trail may turn into a
        refusal (module docstring). A refusal is durable when this returns."""
        decision, record = evaluation.decision, _counted(evaluation.record, checks, guard_tokens)
        if decision.action == "allow":
            return self._settle_allow(policy, decision, record)
        try:
            if self._durable is None:
                self._sink(record)
            else:
                await self._durable(record)
        except AuditBackpressureError:
            log.error("audit trail full: %s decision on %s not recorded", record.action, record.request_id)
            self.counts[(record.direction, "audit_backpressure", decision.action)] += 1
            decision = _unrecorded(record.direction)
        self.counts[(record.direction, decision.source, decision.action)] += 1
        return decision

    def commit_allow(
        self, policy: ResolvedPolicy, evaluation: Evaluation, *, checks: int = 1, guard_tokens: int = 0
    ) -> GuardDecision:
        """`commit` for an evaluated allow, without waiting (a moderation that ended: nothing is answered
        on it any more); ValueError for a refusal, which must be recorded durably."""
        if evaluation.decision.action != "allow":
            raise ValueError("a refusal is committed with `commit`, durably")
        record = _counted(evaluation.record, checks, guard_tokens)
        return self._settle_allow(policy, evaluation.decision, record)

    def _settle_allow(
        self, policy: ResolvedPolicy, decision: GuardDecision, record: GuardRecord
    ) -> GuardDecision:
        direction = record.direction
        try:
            self._sink(record)
        except AuditBackpressureError:
            log.error("audit trail full: allow decision on %s not recorded", record.request_id)
            self.counts[(direction, "audit_backpressure", decision.action)] += 1
            if "closed" in policy.spec.fail_modes.values():
                decision = _unrecorded(direction)
        self.counts[(direction, decision.source, decision.action)] += 1
        return decision


def _counted(record: GuardRecord, checks: int, guard_tokens: int) -> GuardRecord:
    """`record` standing for `checks` checks that scored `guard_tokens` tokens."""
    if checks == 1 and not guard_tokens:
        return record
    return msgspec.structs.replace(record, checks=checks, guard_tokens=guard_tokens)


def _unrecorded(direction: Direction) -> GuardDecision:
    """The refusal of a decision the audit trail could not take (503: the request is neither served nor
    blocked unrecorded)."""
    return GuardDecision(direction=direction, action="refuse", source="fail_closed", category=AUDIT_FULL)
