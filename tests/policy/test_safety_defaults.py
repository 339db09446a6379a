"""The built-in trained policy: its stages in order, the combine stage that decides inputs, the n-gram
stage's own output thresholds, and a version that follows every guard, threshold and weight in it."""

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
    ngram_output_allow_below=0.12,
    ngram_output_block_above=0.93,
    combine_weights=(1.3, 0.4),
    combine_bias=-0.8,
    combine_threshold=0.74,
)


def test_inputs_are_decided_by_one_score_from_the_ngram_and_embedding_stages() -> None:
    spec = trained_policy(GUARDS)
    stages = spec.stages
    assert stages[0] == RULES_STAGE
    assert [s.kind for s in stages] == ["rules", "model", "model", "combine", "model"]
    assert [s.guard for s in stages] == ["", GUARDS.ngram, GUARDS.embedding, "", GUARDS.one_token]
    # Inputs: the n-gram and embedding stages settle nothing; the combine stage reads both and decides.
    assert stages[1].thresholds("input") == stages[2].thresholds("input") == (0.0, 1.0)
    combine = stages[3].combine
    assert not isinstance(combine, msgspec.UnsetType)
    assert (combine.reads, combine.weights, combine.bias) == ((1, 2), (1.3, 0.4), -0.8)
    assert stages[3].thresholds("input") == (0.74, 0.74)  # no band: the one-token guard sees no input
    # Outputs: the n-gram stage at its own pair, the embedding stage at its calibrated one; the combine
    # stage (fitted on prompts) passes them on, and the one-token guard decides, no band.
    assert stages[1].thresholds("output") == (0.12, 0.93)
    assert stages[2].thresholds("output") == (0.65, 0.95)
    assert stages[3].thresholds("output") == (0.0, 1.0)
    assert stages[4].thresholds("output") == (0.65, 0.65)
    assert stages[0].output_block_above is msgspec.UNSET  # the rules judge both directions at one pair
    assert spec.past_last_stage == "escalate"


def test_the_version_follows_the_guards_and_the_combination() -> None:
    version = _trained_version(GUARDS)
    assert version.startswith("trained-")
    assert _trained_version(GUARDS) == version
    for change in (
        {"ngram": "ngram-guard@dddddddddddd"},
        {"ngram_output_allow_below": 0.2},
        {"ngram_output_block_above": 0.95},
        {"combine_weights": (1.3, 0.5)},
        {"combine_bias": -0.7},
        {"combine_threshold": 0.7},
    ):
        assert _trained_version(msgspec.structs.replace(GUARDS, **change)) != version, change


def test_the_embedding_policy_is_the_trained_embedding_stage_after_the_rules() -> None:
    stages = embedding_policy(GUARDS).stages
    assert stages[0] == RULES_STAGE
    assert stages[1].guard == GUARDS.embedding
    # Alone, it decides inputs in a band of its own; outputs at its pair of the trained policy.
    assert stages[1].thresholds("input") == (0.55, 0.65)
    assert stages[1].thresholds("output") == trained_policy(GUARDS).stages[2].thresholds("output")
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
