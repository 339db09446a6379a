"""Training the n-gram guard (ops/guard_training/ngram.py): the threshold rule on made-up scores, and a
run on a tiny labelled directory that keeps training, calibration and test apart."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from guard.dataset import DataItem, family_splits, load_data_dir
from guard.ngram import NgramHead
from ops.guard_training.data import TrainError
from ops.guard_training.ngram import (
    GUARD_JSON,
    NgramReport,
    NgramSettings,
    choose_thresholds,
    directed_figures,
    figures,
    train_ngram,
)
from tests.ops.tiny_guard_data import write_tiny_guard_data

RULE = NgramSettings()


def item(n: int, kind: str) -> DataItem:
    """A calibration item of `kind` (its other fields follow from it)."""
    unsafe = kind in ("request", "harmful")
    output = kind in ("reply", "refusal", "harmful")
    return DataItem(
        id=f"f{n:03d}-en",
        family=f"f{n:03d}",
        text="x",
        label="unsafe" if unsafe else "safe",
        hazard="none" if kind in ("everyday", "reply") else "S1",
        language="en",
        severity="high" if unsafe else "none",
        shape="output" if output else "prompt",
        kind=kind,  # type: ignore[arg-type]
        context="none",
    )


def calibration(groups: dict[str, list[float]]) -> tuple[list[float], list[DataItem]]:
    scores: list[float] = []
    items: list[DataItem] = []
    for kind, values in groups.items():
        for value in values:
            items.append(item(len(items), kind))
            scores.append(value)
    return scores, items


# Enough of every group for both directions (appended where a test leaves a direction's group out).
HARMFUL_OUTPUTS = {"harmful": [0.99] * 5}
HARMFUL_PROMPTS = {"request": [0.99] * 5}


def test_input_block_above_keeps_look_alike_prompts_under_budget_whatever_outputs_score() -> None:
    lookalikes = [i / 100 for i in range(100)]  # 0.00 .. 0.99
    scores, items = calibration(
        {
            "lookalike": lookalikes,
            "reply": [0.97],
            "refusal": [0.1],
            "request": [0.99] * 10,
            **HARMFUL_OUTPUTS,
        }
    )
    chosen = choose_thresholds(scores, items, RULE)
    # A safe output scoring 0.97 binds the output pair only.
    assert chosen.input.block_above == pytest.approx(np.quantile(lookalikes, 0.95))
    blocked = [
        s > chosen.input.block_above for s, i in zip(scores, items, strict=True) if i.kind == "lookalike"
    ]
    assert sum(blocked) <= 5
    assert chosen.output.block_above == 0.97
    assert not any(
        s > chosen.output.block_above
        for s, i in zip(scores, items, strict=True)
        if i.shape == "output" and i.label == "safe"
    )


def test_input_block_above_keeps_everyday_prompts_under_its_quantile_too() -> None:
    everyday = [i / 100 for i in range(100)]  # 0.00 .. 0.99: above the look-alikes
    scores, items = calibration(
        {"lookalike": [0.1] * 20, "everyday": everyday, "reply": [0.1], **HARMFUL_PROMPTS, **HARMFUL_OUTPUTS}
    )
    chosen = choose_thresholds(scores, items, RULE)
    assert chosen.input.block_above == pytest.approx(np.quantile(everyday, RULE.everyday_quantile))
    assert sum(s > chosen.input.block_above for s in everyday) <= 1


def test_each_direction_gets_its_own_pair_from_its_own_items() -> None:
    # Prompts score low and outputs high: one pair for both would block every harmful prompt's look-alike
    # twin or let every harmful prompt through.
    scores, items = calibration(
        {
            "lookalike": [0.2 + i / 1000 for i in range(20)],
            "everyday": [0.1] * 20,
            "request": [0.5] * 20,
            "reply": [0.8 + i / 1000 for i in range(20)],
            "refusal": [0.85] * 10,
            "harmful": [0.95] * 10,
        }
    )
    chosen = choose_thresholds(scores, items, RULE)
    assert chosen.input.block_above < 0.5 < chosen.output.block_above
    # Outputs: never under the floor (generated text's tail is not bounded by a few dozen replies) ...
    assert chosen.output.block_above == pytest.approx(RULE.output_block_floor)
    # ... and above every safe output where they score higher than it.
    unfloored = msgspec.structs.replace(RULE, output_block_floor=0.0)
    assert choose_thresholds(scores, items, unfloored).output.block_above == pytest.approx(0.85)
    prompts = [(s, i) for s, i in zip(scores, items, strict=True) if i.shape == "prompt"]
    assert all(s > chosen.input.block_above for s, i in prompts if i.label == "unsafe")


def test_allow_below_gives_the_band_at_most_its_share_of_a_directions_items() -> None:
    # 100 prompts; harmful ones high, so the 20% cap does not bind.
    scores, items = calibration(
        {
            "lookalike": [0.5 + i / 1000 for i in range(20)],  # 0.500 .. 0.519
            "everyday": [i / 100 for i in range(50)],  # 0.00 .. 0.49
            "request": [0.95] * 30,
            "reply": [0.1] * 10,
            **HARMFUL_OUTPUTS,
        }
    )
    chosen = choose_thresholds(scores, items, RULE).input
    prompts = [s for s, i in zip(scores, items, strict=True) if i.shape == "prompt"]
    assert chosen.block_above == pytest.approx(
        max(np.quantile(prompts[:20], 0.95), np.quantile(prompts[20:70], 0.99))
    )
    band = [s for s in prompts if chosen.allow_below <= s <= chosen.block_above]
    assert len(band) <= 10
    # The widest such band: one more prompt (the next score down) would not fit.
    below = max(s for s in prompts if s < chosen.allow_below)
    assert len([s for s in prompts if below <= s <= chosen.block_above]) > 10


def test_allow_below_never_lets_more_than_a_fifth_of_a_directions_harmful_items_through() -> None:
    # Harmful outputs spread low: the band rule alone would allow most of them outright.
    harmful = [i / 100 for i in range(0, 100, 5)]  # 20 items, 0.00 .. 0.95
    scores, items = calibration(
        {
            "lookalike": [0.99] * 20,
            "reply": [0.0] * 60,
            "refusal": [0.99],
            "harmful": harmful,
            **HARMFUL_PROMPTS,
        }
    )
    chosen = choose_thresholds(scores, items, RULE).output
    assert chosen.allow_below == pytest.approx(np.quantile(harmful, 0.2))
    allowed = [
        s for s, i in zip(scores, items, strict=True) if i.label == "unsafe" and s < chosen.allow_below
    ]
    assert len(allowed) <= 0.2 * len(harmful)
    assert 0.0 <= chosen.allow_below <= chosen.block_above <= 1.0


def test_ties_never_overfill_the_band() -> None:
    scores, items = calibration(
        {
            "lookalike": [0.9] * 10,
            "everyday": [0.3] * 80,
            "request": [0.95] * 10,
            "reply": [0.1],
            **HARMFUL_OUTPUTS,
        }
    )
    chosen = choose_thresholds(scores, items, RULE).input
    # Eighty tied prompts cannot share a band of ten: none of them is in it.
    assert chosen.allow_below > 0.3
    assert sum(1 for s in scores[:100] if chosen.allow_below <= s <= chosen.block_above) <= 10


@pytest.mark.parametrize(
    "groups",
    [
        {"reply": [0.1], "request": [0.9], **HARMFUL_OUTPUTS},  # no look-alikes
        {"lookalike": [0.1], "reply": [0.1], "request": [0.9]},  # no harmful outputs
        {"lookalike": [0.1], "reply": [0.1], **HARMFUL_OUTPUTS},  # no harmful prompts
    ],
)
def test_a_calibration_split_without_a_group_a_direction_needs_is_refused(
    groups: dict[str, list[float]],
) -> None:
    scores, items = calibration(groups)
    with pytest.raises(TrainError, match="look-alikes, safe outputs and harmful items of both shapes"):
        choose_thresholds(scores, items, RULE)


def test_train_ngram_keeps_the_splits_apart(tmp_path: Path) -> None:
    data = write_tiny_guard_data(tmp_path / "data")
    lines: list[str] = []
    report = train_ngram(data, tmp_path / "ngram", NgramSettings(epochs=20), say=lines.append)
    items = load_data_dir(data)
    split = family_splits(items)
    by_id = {i.id: i for i in items}
    assert {split[by_id[i].family] for i in report.train_ids} == {"train"}
    assert {split[by_id[i].family] for i in report.test_scores} == {"test"}
    calibration_split = [i for i in items if split[i.family] == "calibration"]
    assert report.calibration.input.items == sum(1 for i in calibration_split if i.shape == "prompt")
    assert report.calibration.output.items == sum(1 for i in calibration_split if i.shape == "output")
    # The thresholds are the rule's on the calibration scores of the saved head, scored as in service.
    head = NgramHead.load(tmp_path / "ngram", report.weights_sha256)
    assert head.training_data_sha256 == report.training_data_sha256
    calibration_items = [i for i in items if split[i.family] == "calibration"]
    scores = [max(head.score_text(i.text)) for i in calibration_items]
    assert report.thresholds == choose_thresholds(scores, calibration_items, report.settings)
    assert report.thresholds.input != report.thresholds.output  # each direction its own pair
    assert report.calibration == directed_figures(scores, calibration_items, report.thresholds)
    prompts = [(s, i) for s, i in zip(scores, calibration_items, strict=True) if i.shape == "prompt"]
    assert report.calibration.input == figures(
        [s for s, _ in prompts], [i for _, i in prompts], report.thresholds.input
    )
    # It learnt something: harmful test items are blocked, everyday ones are not, in either direction.
    assert report.test.input.harmful_blocked == report.test.output.harmful_blocked == 1.0
    assert report.test.input.everyday_prompts_blocked == 0.0
    # By construction no safe output of the calibration split is cut (the test split's may be: the output
    # pair's block_above is the highest safe output score seen in calibration, on this tiny set a thin edge).
    assert report.calibration.output.safe_outputs_blocked == 0.0
    assert report.test.input.safe_outputs_blocked is None  # no outputs among the prompts
    saved = msgspec.json.decode((tmp_path / "ngram" / GUARD_JSON).read_bytes(), type=NgramReport)
    assert saved == report
    assert any("epoch 20/20" in line for line in lines)
    assert any("block_above" in line for line in lines)
    with pytest.raises(TrainError, match="exists"):
        train_ngram(data, tmp_path / "ngram", say=lines.append)
