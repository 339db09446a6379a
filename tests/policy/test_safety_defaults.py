"""The built-in trained policy: its stages in order, the n-gram stage's own thresholds, and a version that
follows every guard and threshold in it."""

from __future__ import annotations

import msgspec
import pytest

from policy.safety.defaults import (
    RULES_STAGE,
    TrainedGuards,
    _embedding_version,
    _trained_version,
    embedding_policy,
    register_default_policy,
    trained_policy,
)

GUARDS = TrainedGuards(
    embedding="minilm-guard@aaaaaaaaaaaa",
    one_token="SmolLM2-135M-guard@bbbbbbbbbbbb",
    ngram="ngram-guard@cccccccccccc",
    ngram_allow_below=0.31,
    ngram_block_above=0.77,
    ngram_output_allow_below=0.12,
    ngram_output_block_above=0.93,
)


def test_the_ngram_stage_runs_after_the_rules_and_before_the_embedding_guard() -> None:
    stages = trained_policy(GUARDS).stages
    assert stages[0] == RULES_STAGE
    assert [s.guard for s in stages[1:]] == [GUARDS.ngram, GUARDS.embedding, GUARDS.one_token]
    assert stages[1].thresholds("input") == (0.31, 0.77)
    assert stages[1].thresholds("output") == (0.12, 0.93)
    # The rules judge both directions at one pair (their output pair is unset); the later model stages have
    # a pair per direction (chosen by `ops.eval calibrate`).
    assert stages[0].output_block_above is msgspec.UNSET
    assert all(s.output_block_above is not msgspec.UNSET for s in stages[2:])
    # The last stage decides what reaches it in either direction: no band, so nothing escalates past it.
    for direction in ("input", "output"):
        allow_below, block_above = stages[-1].thresholds(direction)
        assert allow_below == block_above
    assert trained_policy(GUARDS).past_last_stage == "escalate"


def test_the_version_follows_the_ngram_guard_and_its_thresholds() -> None:
    version = _trained_version(GUARDS)
    assert version.startswith("trained-")
    assert _trained_version(GUARDS) == version
    for change in (
        {"ngram": "ngram-guard@dddddddddddd"},
        {"ngram_allow_below": 0.3},
        {"ngram_block_above": 0.8},
        {"ngram_output_allow_below": 0.2},
        {"ngram_output_block_above": 0.95},
    ):
        assert _trained_version(msgspec.structs.replace(GUARDS, **change)) != version, change


def test_the_embedding_policy_is_the_trained_embedding_stage_after_the_rules() -> None:
    stages = embedding_policy(GUARDS).stages
    assert stages == (RULES_STAGE, trained_policy(GUARDS).stages[2])
    assert stages[1].guard == GUARDS.embedding
    version = _embedding_version(GUARDS)
    assert version.startswith("embedding-")
    assert version.removeprefix("embedding-") != _trained_version(GUARDS).removeprefix("trained-")
    # It follows the embedding guard, not the guards it does not run.
    assert (
        _embedding_version(msgspec.structs.replace(GUARDS, embedding="minilm-guard@eeeeeeeeeeee")) != version
    )
    assert _embedding_version(msgspec.structs.replace(GUARDS, ngram="ngram-guard@dddddddddddd")) == version


@pytest.mark.parametrize("choice", ["trained", "embedding"])
async def test_a_policy_with_model_stages_needs_the_prepared_guards(choice: str) -> None:
    with pytest.raises(ValueError, match="needs the prepared guards"):
        await register_default_policy(None, choice, None)  # type: ignore[arg-type]
