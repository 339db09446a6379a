"""The guard cascade: stages in order, each settling clear cases and passing uncertain ones on.

A stage with score p allows when p < allow_below, blocks when p > block_above, and passes the item to the next
stage in between; a stage may judge outputs at a pair of its own (`Stage.thresholds`), chosen by the item's
direction, which the gateway sets (a request's messages, whatever their role, are input). Past the last stage
the policy's band action applies (`escalate`: allow and flag for review; `block`). A stage that fails (guard
error, timeout, open breaker, an engine too busy to answer in time) settles nothing: later stages still run,
and a later block still blocks, but without a block the result is `error` with the categories the failed stage
was responsible for. Only the guard's own failures count on its breaker, never an item's (`Stage.score`). What
an error means (fail open or closed) is the policy's decision, not the cascade's (see `policy/safety.py`).
Every stage run is recorded, with its score, thresholds, latency and the versions it ran, for the audit trail.

A `CombineStage` calls no model: it scores what earlier stages scored the item (`guard.combination`).

`route` is the pure decision over stored scores, so evaluation can replay new thresholds without models.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Literal

import msgspec

from engines.breaker import CircuitBreaker, CircuitOpenError
from guard.base import (
    Classifier,
    Direction,
    GuardError,
    GuardInput,
    GuardInputError,
    GuardOverloadedError,
    GuardScore,
    GuardTimeoutError,
    GuardUnavailableError,
    ItemSized,
    Queued,
)
from guard.combination import combined
from registry.models import StageCombination

StageVerdict = Literal["allow", "block", "next", "error"]
Verdict = Literal["allow", "block", "escalate", "error"]
# `input`: the item could not be scored for what it holds (`GuardInputError`): never counted on the breaker.
StageFailure = Literal["input", "timeout", "overloaded", "unavailable", "error"]
# Share of a stage's timeout that an input check may wait behind the work queued on its guard's engine (an
# output check may wait all of it): under overload new requests are refused before running streams are cut.
INPUT_SHARE = 0.5
BandAction = Literal["escalate", "block"]


class StageRun(msgspec.Struct, frozen=True, kw_only=True):
    """One stage's run on one item: what it scored, against which thresholds, and what that meant."""

    index: int
    guard: str  # "rules" or the guard model's name@version
    model: str = ""
    template_sha256: str = ""
    allow_below: float
    block_above: float
    # The categories the stage is responsible for: left unjudged when it fails.
    categories: tuple[str, ...] = ()
    p_unsafe: float | None  # None when the stage failed
    category: str = ""
    verdict: StageVerdict
    latency_s: float
    error: str = ""
    # Why it failed: input (the item's own: not counted on the breaker), timeout, overloaded (not called:
    # `Stage.score`), unavailable (breaker open), error.
    failure: StageFailure | None = None
    # Seconds until a call may go ahead (0: unknown): overloaded, until the work queued on the guard's engine
    # is short enough for this check; unavailable, until its breaker lets a probe through.
    retry_after: float = 0.0


class CascadeResult(msgspec.Struct, frozen=True, kw_only=True):
    """The cascade's answer for one item.

    `decided_by` is the index of the stage that allowed or blocked (None for the band action, an error, or a
    cascade without stages). `failed_categories` are the categories left unjudged by failed stages.
    """

    verdict: Verdict
    decided_by: int | None
    category: str
    runs: tuple[StageRun, ...]
    failed_categories: tuple[str, ...] = ()


class _Judged:
    """A stage's thresholds: a pair for inputs, and one for outputs (None: the input pair judges both)."""

    def __init__(
        self,
        *,
        allow_below: float,
        block_above: float,
        categories: tuple[str, ...],
        output_thresholds: tuple[float, float] | None,
    ) -> None:
        self.allow_below = allow_below
        self.block_above = block_above
        self.output_thresholds = output_thresholds
        self.categories = categories

    def thresholds(self, direction: Direction) -> tuple[float, float]:
        """(allow_below, block_above) for items of `direction`."""
        if direction == "output" and self.output_thresholds is not None:
            return self.output_thresholds
        return self.allow_below, self.block_above

    def verdict(self, p_unsafe: float, direction: Direction = "input") -> StageVerdict:
        """What a score means at this stage's thresholds for items of `direction`."""
        return stage_verdict(p_unsafe, *self.thresholds(direction))


class Stage(_Judged):
    """A classifier in the cascade with its thresholds, categories, timeout and breaker.

    `output_thresholds`: (allow_below, block_above) for output items; None: the input pair judges both.
    """

    def __init__(
        self,
        classifier: Classifier,
        *,
        allow_below: float,
        block_above: float,
        categories: tuple[str, ...],
        timeout_s: float,
        breaker: CircuitBreaker | None = None,
        output_thresholds: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(
            allow_below=allow_below,
            block_above=block_above,
            categories=categories,
            output_thresholds=output_thresholds,
        )
        self.classifier = classifier
        # Checked once: isinstance against a runtime-checkable protocol costs tens of microseconds a call.
        self._queued = classifier if isinstance(classifier, Queued) else None
        self.timeout_s = timeout_s
        self.breaker = breaker

    async def score(self, item: GuardInput) -> GuardScore:
        """The classifier's score within the timeout, through the breaker; GuardError on any failure.

        A call that the work queued on the classifier's engine would keep too long is not made
        (GuardOverloadedError, `guard.backlog`); that is not the guard's failure: the breaker is left alone.
        Too long is past the timeout for an output check, past `INPUT_SHARE` of it for an input check: new
        requests are refused first, so the checks of streams already served still find room.

        The breaker counts the guard's own failures only (engine errors, malformed answers, timeouts on items
        of at most one call's work), never an item's (`GuardInputError`, `guard.base`): the breaker is shared
        by every tenant of the guard, and any caller can craft items that fail.
        """
        if self._queued is not None:
            wait = self._queued.expected_wait()
            limit = self.timeout_s * (INPUT_SHARE if item.direction == "input" else 1.0)
            if wait > limit:
                raise GuardOverloadedError(
                    f"guard {self.classifier.name} is overloaded: a call now would take about {wait:.1f} s "
                    f"behind the work queued on its engine, more than the {limit:g} s an {item.direction} "
                    f"check may wait (stage timeout {self.timeout_s:g} s)",
                    retry_after=wait - limit,
                )
        try:
            probe = self.breaker.before_call() if self.breaker is not None else False
        except CircuitOpenError as exc:
            raise GuardUnavailableError(str(exc), retry_after=exc.retry_after) from exc
        try:
            score = await self._classify(item)
        except GuardInputError:
            # The item's own failure says nothing of the guard, which every tenant of it shares: counting it
            # would let one caller's crafted inputs open the breaker for all (`guard.base`).
            self._released(probe)
            raise
        except GuardError:
            if self.breaker is not None:
                self.breaker.failure()
            raise
        except asyncio.CancelledError:
            # The caller went away mid-call: no verdict on the guard, but a probe's slot must come back.
            self._released(probe)
            raise
        if self.breaker is not None:
            self.breaker.success()
        return score

    async def _classify(self, item: GuardInput) -> GuardScore:
        """The classifier's score within the timeout; any failure as a GuardError."""
        try:
            async with asyncio.timeout(self.timeout_s):
                score = await self.classifier.classify(item)
        except TimeoutError as exc:
            if isinstance(self.classifier, ItemSized) and self.classifier.oversized(item):
                # More than one call's work: the item's size may be what took the time, and anyone can send
                # large items. A guard that hangs still times out on ordinary items, and those count.
                raise GuardInputError(
                    f"guard {self.classifier.name} timed out after {self.timeout_s:g} s on an item larger "
                    "than one call of it (not counted on its breaker)"
                ) from exc
            raise GuardTimeoutError(
                f"guard {self.classifier.name} timed out after {self.timeout_s:g} s"
            ) from exc
        except GuardError:
            raise
        except Exception as exc:
            # A guard that breaks in an unforeseen way is still a failed guard: the policy's fail mode
            # decides, and the record names the exception.
            raise GuardError(f"guard {self.classifier.name} failed: {type(exc).__name__}: {exc}") from exc
        if not 0.0 <= score.p_unsafe <= 1.0:  # also catches NaN
            raise GuardError(f"guard {self.classifier.name} returned p_unsafe={score.p_unsafe!r}")
        return score

    def _released(self, probe: bool) -> None:
        if probe and self.breaker is not None:
            self.breaker.release()


class CombineStage(_Judged):
    """A stage that scores what earlier stages scored the item (`guard.combination`), at its thresholds;
    it calls no model, so it has no timeout, breaker or queue."""

    name = "combine"

    def __init__(
        self,
        combination: StageCombination,
        *,
        allow_below: float,
        block_above: float,
        categories: tuple[str, ...],
        output_thresholds: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(
            allow_below=allow_below,
            block_above=block_above,
            categories=categories,
            output_thresholds=output_thresholds,
        )
        self.combination = combination

    def score(self, runs: Sequence[StageRun]) -> GuardScore:
        """The combination of the read stages' scores; `runs` are the earlier stages' runs in stage order
        (the cascade reaches this stage only after every earlier one ran). GuardError when a stage it reads
        failed. Its category is that of the most unsafe stage read."""
        read = [runs[index] for index in self.combination.reads]
        failed = next((run for run in read if run.p_unsafe is None), None)
        if failed is not None:
            raise GuardError(
                f"the combine stage cannot score: stage {failed.index}, which it reads, failed: "
                f"{failed.error or failed.failure}"
            )
        p_unsafe = combined(self.combination, [run.p_unsafe or 0.0 for run in read])
        most = max(read, key=lambda r: r.p_unsafe or 0.0)
        return GuardScore(p_unsafe=p_unsafe, category=most.category, guard=self.name)


def failure_of(exc: GuardError) -> StageFailure:
    """What kind of failure a stage's GuardError is."""
    if isinstance(exc, GuardInputError):
        return "input"
    if isinstance(exc, GuardOverloadedError):
        return "overloaded"
    if isinstance(exc, GuardTimeoutError):
        return "timeout"
    if isinstance(exc, GuardUnavailableError):
        return "unavailable"
    return "error"


def stage_verdict(p_unsafe: float, allow_below: float, block_above: float) -> StageVerdict:
    """allow below `allow_below`, block above `block_above`, next stage in between."""
    if p_unsafe < allow_below:
        return "allow"
    if p_unsafe > block_above:
        return "block"
    return "next"


def route(runs: Sequence[StageRun], band: BandAction) -> CascadeResult:
    """The cascade's result from its stage runs, in order: the first block decides; the first allow decides
    unless an earlier stage failed (its categories are then unjudged: `error`); else the band action."""
    failed: list[str] = []
    for run in runs:
        if run.verdict == "error":
            failed.extend(c for c in run.categories if c not in failed)
        elif run.verdict == "block" or (run.verdict == "allow" and not failed):
            return CascadeResult(
                verdict=run.verdict, decided_by=run.index, category=run.category, runs=tuple(runs)
            )
    if failed:
        return CascadeResult(
            verdict="error", decided_by=None, category="", runs=tuple(runs), failed_categories=tuple(failed)
        )
    if not runs:
        return CascadeResult(verdict="allow", decided_by=None, category="", runs=())
    return CascadeResult(verdict=band, decided_by=None, category=runs[-1].category, runs=tuple(runs))


class Cascade:
    """A policy version's stages, run in order on one item at a time."""

    def __init__(
        self, stages: Sequence[Stage | CombineStage], band: BandAction, categories: Sequence[str]
    ) -> None:
        self.stages = tuple(stages)
        self.band = band
        self.categories = tuple(categories)

    async def run(self, item: GuardInput) -> CascadeResult:
        """Run stages until one settles the item (see `route`); record every run."""
        runs: list[StageRun] = []
        for index, stage in enumerate(self.stages):
            runs.append(await self._run_stage(index, stage, item, runs))
            result = route(runs, self.band)
            if result.decided_by == index:
                return result
        return route(runs, self.band)

    async def run_every_stage(self, item: GuardInput) -> tuple[StageRun, ...]:
        """Every stage's run on `item`, none settling it (evaluation: any threshold replay is exact); each
        recorded as `run` records it."""
        runs: list[StageRun] = []
        for index, stage in enumerate(self.stages):
            runs.append(await self._run_stage(index, stage, item, runs))
        return tuple(runs)

    async def _run_stage(
        self, index: int, stage: Stage | CombineStage, item: GuardInput, runs: Sequence[StageRun]
    ) -> StageRun:
        categories = stage.categories or self.categories
        allow_below, block_above = stage.thresholds(item.direction)
        started = time.perf_counter()
        try:
            score = stage.score(runs) if isinstance(stage, CombineStage) else await stage.score(item)
        except GuardError as exc:
            return StageRun(
                index=index,
                guard=stage.name if isinstance(stage, CombineStage) else stage.classifier.name,
                allow_below=allow_below,
                block_above=block_above,
                categories=categories,
                p_unsafe=None,
                verdict="error",
                latency_s=time.perf_counter() - started,
                error=str(exc),
                failure=failure_of(exc),
                retry_after=exc.retry_after,
            )
        return StageRun(
            index=index,
            guard=score.guard,
            model=score.model,
            template_sha256=score.template_sha256,
            allow_below=allow_below,
            block_above=block_above,
            categories=categories,
            p_unsafe=score.p_unsafe,
            category=score.category,
            verdict=stage_verdict(score.p_unsafe, allow_below, block_above),
            latency_s=score.latency_s or time.perf_counter() - started,
        )
