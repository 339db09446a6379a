"""What the policy makes of cascade results: sources, band actions, and fail modes per category."""

from __future__ import annotations

import msgspec
import pytest

from guard.cascade import CascadeResult, StageRun
from policy.safety.decision import decide
from policy.safety.defaults import rules_policy
from registry.models import PolicyCategory, PolicySpec

SPEC = PolicySpec(
    categories=(
        PolicyCategory(name="violence", severity="high"),
        PolicyCategory(name="spam", severity="low"),
    ),
    stages=(),
    past_last_stage="escalate",
    fail_modes={"violence": "closed", "spam": "open"},
    hold_back_tokens=0,
    retention="hash",
)


def run(index: int, guard: str, p: float | None, verdict: str) -> StageRun:
    return StageRun(
        index=index,
        guard=guard,
        allow_below=0.2,
        block_above=0.8,
        p_unsafe=p,
        verdict=verdict,  # type: ignore[arg-type]
        latency_s=0.001,
    )


def result(
    verdict: str, decided_by: int | None, *runs: StageRun, failed: tuple[str, ...] = ()
) -> CascadeResult:
    return CascadeResult(
        verdict=verdict,  # type: ignore[arg-type]
        decided_by=decided_by,
        category="violence" if verdict == "block" else "",
        runs=runs,
        failed_categories=failed,
    )


def test_rules_and_model_decisions_name_their_source() -> None:
    by_rules = decide(result("block", 0, run(0, "rules", 1.0, "block")), SPEC, "input")
    assert (by_rules.action, by_rules.source, by_rules.category) == ("block", "rules", "violence")
    assert by_rules.label == "input=rules"
    by_model = decide(
        result("allow", 1, run(0, "rules", 0.5, "next"), run(1, "g@1", 0.1, "allow")), SPEC, "output"
    )
    assert (by_model.action, by_model.source, by_model.flagged) == ("allow", "model", False)
    assert by_model.label == "output=model"


def test_escalation_allows_and_flags() -> None:
    decision = decide(result("escalate", None, run(0, "g@1", 0.5, "next")), SPEC, "input")
    assert (decision.action, decision.source, decision.flagged) == ("allow", "band", True)


def test_band_block() -> None:
    decision = decide(result("block", None, run(0, "g@1", 0.5, "next")), SPEC, "input")
    assert (decision.action, decision.source) == ("block", "band")


@pytest.mark.parametrize(
    ("failed", "action", "source"),
    [
        (("spam",), "allow", "fail_open"),
        (("violence",), "refuse", "fail_closed"),
        (("spam", "violence"), "refuse", "fail_closed"),  # one closed category is enough to refuse
        (("unknown",), "refuse", "fail_closed"),  # a category without a fail mode fails closed
        ((), "refuse", "fail_closed"),  # a failure that names no category fails closed
    ],
)
def test_fail_modes(failed: tuple[str, ...], action: str, source: str) -> None:
    decision = decide(result("error", None, run(0, "g@1", None, "error"), failed=failed), SPEC, "input")
    assert (decision.action, decision.source) == (action, source)
    assert decision.flagged == (source == "fail_open")


def test_no_stages_is_unguarded() -> None:
    decision = decide(result("allow", None), SPEC, "input")
    assert (decision.action, decision.source) == ("allow", "none")


def test_the_builtin_rules_policy_round_trips_through_the_registry_codec() -> None:
    spec = rules_policy()
    assert msgspec.json.decode(msgspec.json.encode(spec), type=PolicySpec) == spec
    assert spec.stages[0].kind == "rules"
    assert set(spec.fail_modes) == {c.name for c in spec.categories}
