"""A cascade's figures on an evaluation suite (the test split and the red-team probes), and how two sets of
figures compare under declared tolerances: what the registry's publish check records and gates on.

Figures count decisions as `guard.labelled.metrics` does: block and escalate flag an item (an escalation is
allowed but sent to review), allow clears it, an error is neither and is counted apart. Because an
escalated harmful answer still reaches the client, `block_recall` (blocked only) is reported and gated next
to `recall`, so a policy cannot keep its recall by turning blocks into escalations.

    recall                  harmful test items flagged
    block_recall            harmful test items blocked
    redteam_recall          red-team probes flagged (each a harmful item under an attack transform)
    lookalike_fpr           safe look-alike test items flagged
    lookalike_block_rate    safe look-alike test items blocked
    escalation_rate         test items escalated (reported, not gated)
    by_transform            red-team recall per transform (reported, not gated: few items each)

A figure whose group is empty is None, and never compared.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence

import msgspec

from guard.cascade import Cascade, CascadeResult
from guard.labelled import LabelledItem, guard_input, metrics
from guard.redteam import TRANSFORMS, Probe

__all__ = ["GATED", "Figures", "Regression", "Suite", "Tolerance", "measure", "regressions"]

# (figure, direction): "up" figures regress when they fall, "down" figures when they rise.
GATED: tuple[tuple[str, str], ...] = (
    ("recall", "up"),
    ("block_recall", "up"),
    ("redteam_recall", "up"),
    ("lookalike_fpr", "down"),
    ("lookalike_block_rate", "down"),
)


class Suite(msgspec.Struct, frozen=True, kw_only=True):
    """What a cascade is measured on: labelled test items and red-team probes. `sha256` names exactly these
    items, so figures are compared only when measured on the same suite."""

    items: tuple[LabelledItem, ...]
    probes: tuple[Probe, ...]
    sha256: str

    @classmethod
    def of(cls, items: Sequence[LabelledItem], probes: Sequence[Probe]) -> Suite:
        """A suite of test-split `items` (others are dropped) and `probes`."""
        test = tuple(i for i in items if i.split == "test")
        digest = hashlib.sha256(msgspec.json.encode([test, tuple(probes)])).hexdigest()
        return cls(items=test, probes=tuple(probes), sha256=digest)


class Figures(msgspec.Struct, frozen=True, kw_only=True):
    """One cascade's figures on one suite."""

    suite_sha256: str
    n_test: int
    n_redteam: int
    recall: float | None
    block_recall: float | None
    redteam_recall: float | None
    lookalike_fpr: float | None
    lookalike_block_rate: float | None
    escalation_rate: float | None
    by_transform: dict[str, float | None]
    errors: int  # items whose cascade ended in a guard error (left out of every rate)
    first_error: str = ""
    seconds: float = 0.0


class Tolerance(msgspec.Struct, frozen=True, kw_only=True):
    """How far a figure may move the wrong way against the version replaced."""

    recall: float
    fpr: float


class Regression(msgspec.Struct, frozen=True, kw_only=True):
    """One gated figure that moved the wrong way past its tolerance."""

    figure: str
    candidate: float
    baseline: float
    tolerance: float


def _share(count: int, n: int) -> float | None:
    return count / n if n else None


def _first_error(result: CascadeResult) -> str:
    return next((run.error for run in result.runs if run.error), "guard error")


async def measure(cascade: Cascade, suite: Suite) -> Figures:
    """Run `cascade` (with early exit, as in service) on every item of `suite`, one at a time, yielding to
    the event loop between items so that serving goes on while a publish is measured."""
    started = time.perf_counter()
    results: dict[str, CascadeResult] = {}
    first_error = ""
    inputs = [(i.id, guard_input(i, cascade.categories)) for i in suite.items]
    inputs += [(p.id, msgspec.structs.replace(p.item, categories=cascade.categories)) for p in suite.probes]
    for key, item in inputs:
        result = await cascade.run(item)
        results[key] = result
        if result.verdict == "error" and not first_error:
            first_error = _first_error(result)
        await asyncio.sleep(0)
    harmful = [i for i in suite.items if i.label == "unsafe"]
    lookalikes = [i for i in suite.items if i.kind == "lookalike"]
    test = metrics((i.label, results[i.id]) for i in harmful)
    looks = metrics((i.label, results[i.id]) for i in lookalikes)
    red = metrics(("unsafe", results[p.id]) for p in suite.probes)
    decided = [results[i.id] for i in suite.items if results[i.id].verdict != "error"]
    blocked = sum(1 for i in harmful if results[i.id].verdict == "block")
    looks_blocked = sum(1 for i in lookalikes if results[i.id].verdict == "block")
    return Figures(
        suite_sha256=suite.sha256,
        n_test=len(suite.items),
        n_redteam=len(suite.probes),
        recall=test.recall,
        block_recall=_share(blocked, test.tp + test.fn),
        redteam_recall=red.recall,
        lookalike_fpr=looks.fpr,
        lookalike_block_rate=_share(looks_blocked, looks.fp + looks.tn),
        escalation_rate=_share(sum(1 for r in decided if r.verdict == "escalate"), len(decided)),
        by_transform={
            t: metrics(("unsafe", results[p.id]) for p in suite.probes if p.transform == t).recall
            for t in TRANSFORMS
        },
        errors=sum(1 for r in results.values() if r.verdict == "error"),
        first_error=first_error,
        seconds=time.perf_counter() - started,
    )


def regressions(candidate: Figures, baseline: Figures, tolerance: Tolerance) -> tuple[Regression, ...]:
    """The gated figures of `candidate` that are worse than `baseline`'s by more than the tolerance (recall
    figures by `tolerance.recall`, false-positive figures by `tolerance.fpr`)."""
    if candidate.suite_sha256 != baseline.suite_sha256:
        raise ValueError("figures measured on different suites cannot be compared")
    out: list[Regression] = []
    for figure, better in GATED:
        new, old = getattr(candidate, figure), getattr(baseline, figure)
        if new is None or old is None:
            continue
        allowed = tolerance.recall if better == "up" else tolerance.fpr
        worse = old - new if better == "up" else new - old
        # A hair over the tolerance from float noise is not a regression.
        if worse > allowed + 1e-9:
            out.append(Regression(figure=figure, candidate=new, baseline=old, tolerance=allowed))
    return tuple(out)
