"""The safety gate's rules stage: a long item is matched off the event loop, with the same decision."""

from __future__ import annotations

import math

import msgspec
import pytest

from engines.breaker import BreakerPolicy
from guard.base import Classifier, GuardInput, Span
from policy.safety.decision import GuardRecord
from policy.safety.gate import RecordContext, SafetyGate
from policy.safety.records import audit_draft
from registry.models import (
    CascadeStage,
    GuardModelSpec,
    PolicyCategory,
    PolicySpec,
    Published,
    RulePattern,
    RulesSpec,
    StageCombination,
)
from registry.view import ResolvedGuard, ResolvedPolicy
from tests.gateway.test_prompts import CountingPool
from tests.guard.fakes import Scripted

SPEC = PolicySpec(
    categories=(PolicyCategory(name="violence", severity="high"),),
    stages=(CascadeStage(kind="rules", allow_below=0.6, block_above=0.75),),  # no rule: 0.5, allowed
    past_last_stage="block",
    fail_modes={"violence": "closed"},
    hold_back_tokens=4,
    retention="hash",
    rules=RulesSpec(
        block=(RulePattern(category="violence", pattern="forbidden phrase", applies_to="input"),)
    ),
)
POLICY = ResolvedPolicy(
    ref="rules-only@1",
    policy=Published(
        kind="policy",
        name="rules-only",
        version="1",
        content_hash="0" * 64,
        spec_json="{}",
        published_at=0.0,
        actor="test",
    ),
    spec=SPEC,
    guards=(),
    generation=1,
)
CONTEXT = RecordContext(tenant="t", key_id="k", request_id="r")


def no_model_guards(guard: ResolvedGuard) -> Classifier:
    pytest.fail(f"a rules-only policy asked for guard {guard.ref}")


def user(text: str) -> GuardInput:
    return GuardInput(direction="input", spans=(Span(text=text, source="user"),))


async def test_the_rules_stage_matches_a_long_item_in_the_executor_and_a_short_one_in_place() -> None:
    records: list[GuardRecord] = []
    with CountingPool() as pool:
        gate = SafetyGate(no_model_guards, records.append, lambda: 0.0, BreakerPolicy(), executor=pool)
        short, long = "a forbidden phrase", "harmless filler " * 100 + "a forbidden phrase"
        assert len(short) <= 1_024 < len(long)  # the rules stage's inline bound
        assert (await gate.check(POLICY, user(short), CONTEXT)).action == "block"
        assert pool.submitted == 0
        assert (await gate.check(POLICY, user(long), CONTEXT)).action == "block"
        assert (await gate.check(POLICY, user("harmless filler " * 100), CONTEXT)).action == "allow"
        assert pool.submitted == 2
    assert [r.action for r in records] == ["block", "block", "allow"]


@pytest.mark.parametrize("retention", ["none", "hash", "full"])
@pytest.mark.parametrize("retain_prompts", [False, True])
async def test_the_record_holds_the_text_only_when_the_policy_and_the_tenant_both_keep_it(
    retention: str, retain_prompts: bool
) -> None:
    records: list[GuardRecord] = []
    gate = SafetyGate(no_model_guards, records.append, lambda: 0.0, BreakerPolicy())
    policy = msgspec.structs.replace(POLICY, spec=msgspec.structs.replace(SPEC, retention=retention))
    context = msgspec.structs.replace(CONTEXT, retain_prompts=retain_prompts)
    for text in ("a forbidden phrase", "harmless"):  # a block, which is recorded durably, and an allow
        await gate.check(policy, user(text), context)
    kept = retention == "full" and retain_prompts
    assert [r.content for r in records] == (["a forbidden phrase", "harmless"] if kept else [None, None])
    # The hash stands for the text either way.
    assert all(len(r.content_sha256) == 64 for r in records)


def test_a_context_keeps_no_text_unless_told_the_tenant_retains_prompts() -> None:
    assert CONTEXT.retain_prompts is False


async def test_a_published_combine_stage_decides_from_the_scores_before_it_and_is_audited_as_one() -> None:
    guard = ResolvedGuard(
        ref="words@1",
        guard=msgspec.structs.replace(POLICY.policy, kind="guard_model", name="words", version="1"),
        spec=GuardModelSpec(kind="ngram", artifact="words"),
        model=None,
    )
    spec = msgspec.structs.replace(
        SPEC,
        stages=(
            CascadeStage(guard="words@1", allow_below=0.0, block_above=1.0),  # settles nothing: read below
            msgspec.structs.replace(SPEC.stages[0], allow_below=0.25),  # no rule matches: 0.5, passed on
            CascadeStage(
                kind="combine",
                allow_below=0.5,
                block_above=0.5,
                combine=StageCombination(reads=(0,), weights=(2.0,), bias=1.0),
            ),
        ),
    )
    policy = msgspec.structs.replace(POLICY, spec=spec, guards=(guard,))
    words = Scripted("words@1", 0.3, "violence")
    records: list[GuardRecord] = []
    gate = SafetyGate(lambda g: words, records.append, lambda: 0.0, BreakerPolicy())
    # logit(0.3) = -0.85: 1 + 2 x -0.85 = -0.69 < logit(0.5), allowed by the combine stage; at 0.45, blocked.
    assert (await gate.check(policy, user("harmless"), CONTEXT)).action == "allow"
    words.p_unsafe = 0.45
    assert (await gate.check(policy, user("harmless"), CONTEXT)).action == "block"
    block = audit_draft(records[-1])
    assert [(s.kind, s.stage) for s in block.stages] == [
        ("model", "words@1"),
        ("rules", "rules"),
        ("combine", "combine"),
    ]
    assert block.stages[2].score == pytest.approx(1 / (1 + math.exp(-(1 + 2 * math.log(0.45 / 0.55)))))
