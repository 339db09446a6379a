"""One score over several stages against each stage alone (`ops/eval/combine.py`)."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest

from guard.cascade import CombineStage, StageRun
from guard.labelled import LabelledItem
from ops.eval.__main__ import main
from ops.eval.calibrate import Budget
from ops.eval.combine import combine_stage, compare, stage_logits
from ops.eval.evaluation import ItemScores, save_items, save_scores
from registry.models import CascadeStage

KINDS = (("request", "unsafe", 1.5), ("lookalike", "safe", 0.0), ("everyday", "safe", -1.0))


def _run(index: int, p: float | None) -> StageRun:
    return StageRun(
        index=index,
        guard="rules" if index == 0 else f"g{index}@1",
        allow_below=0.5,
        block_above=0.5,
        p_unsafe=p,
        verdict="error" if p is None else "next",
        latency_s=0.001,
    )


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def split(name: str, seed: int, per_kind: int = 300) -> tuple[list[LabelledItem], list[ItemScores]]:
    """Items whose two model stages (1 and 2) each see the label through independent noise: the mean of
    their logits separates better than either. Stage 0 (rules) says nothing."""
    rng = np.random.default_rng(seed)
    items, scores = [], []
    for kind, label, centre in KINDS:
        for n in range(per_kind):
            item_id = f"{name}-{kind}-{n}"
            items.append(
                LabelledItem(
                    id=item_id,
                    text=item_id,
                    label=label,  # type: ignore[arg-type]
                    category="violent_crimes",
                    language="en" if n % 2 else "zh",
                    severity="high" if label == "unsafe" else "none",
                    split=name,  # type: ignore[arg-type]
                    kind=kind,
                )
            )
            a, b = (float(centre + rng.normal(0.0, 1.2)) for _ in range(2))
            runs = (_run(0, 0.5), _run(1, _sigmoid(a)), _run(2, _sigmoid(b)))
            scores.append(ItemScores(id=item_id, runs=runs, stages=3, cost_s=0.003))
    return items, scores


def test_the_combination_blocks_more_than_either_stage_within_the_same_rule() -> None:
    fit_items, fit_scores = split("calibration", seed=1)
    test_items, test_scores = split("test", seed=2)
    budget = Budget(lookalike_fpr=0.05, everyday_prompts=0.03)
    result = compare(fit_items, fit_scores, test_items, test_scores, [1, 2], budget)
    one, two, combined = result.candidates
    assert [c.name for c in result.candidates] == ["stage 1", "stage 2", "combined"]
    assert combined.harmful_blocked > max(one.harmful_blocked, two.harmful_blocked) + 0.05
    # Both stages carry the same signal: the fit weighs them about alike.
    w1, w2 = result.combination.coef
    assert w1 > 0
    assert w2 > 0
    assert 0.6 < w1 / w2 < 1.6
    # The rule holds on the fitting split, where the threshold was chosen.
    fitted, logits = stage_logits(fit_items, fit_scores, [1, 2])
    blocked = result.combination.score(logits) > combined.threshold
    lookalike = np.array([i.kind == "lookalike" for i in fitted])
    everyday = np.array([i.kind == "everyday" for i in fitted])
    assert blocked[lookalike].mean() <= 0.05
    assert blocked[everyday].mean() <= 0.03
    assert set(combined.by_language) == {"en", "zh"}
    assert result.fitted_on == result.measured_on == 900


def test_nothing_of_the_measuring_split_is_fitted_on() -> None:
    fit_items, fit_scores = split("calibration", seed=1)
    test_items, test_scores = split("test", seed=2)
    budget = Budget()
    first = compare(fit_items, fit_scores, test_items, test_scores, [1, 2], budget)
    flipped = [
        LabelledItem(**{**{f: getattr(i, f) for f in i.__struct_fields__}, "label": "safe"})
        for i in test_items
    ]
    second = compare(fit_items, fit_scores, flipped, test_scores, [1, 2], budget)
    assert second.combination == first.combination
    assert [c.threshold for c in second.candidates] == [c.threshold for c in first.candidates]
    assert second.candidates[-1].harmful_blocked == 0.0  # no harmful item left to block


def test_outputs_and_items_a_stage_failed_on_are_left_out() -> None:
    items, scores = split("calibration", seed=3, per_kind=10)
    output = LabelledItem(
        id="out",
        text="a reply",
        label="safe",
        category="benign",
        language="en",
        severity="none",
        split="calibration",
        shape="output",
        kind="reply",
    )
    failed = scores[0]
    scores[0] = ItemScores(id=failed.id, runs=(*failed.runs[:2], _run(2, None)), stages=3, cost_s=0.0)
    kept, logits = stage_logits([*items, output], [*scores, scores[1]], [1, 2])
    assert output not in kept
    assert items[0] not in kept
    assert len(kept) == len(items) - 1
    assert logits.shape == (len(kept), 2)
    with pytest.raises(ValueError, match="at least one stage"):
        compare(items, scores, items, scores, [], Budget())


def test_the_command_prints_each_stage_and_the_combination(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fit_items, fit_scores = split("calibration", seed=1, per_kind=60)
    test_items, test_scores = split("test", seed=2, per_kind=60)
    save_items(tmp_path / "data.jsonl", [*fit_items, *test_items])
    save_scores(tmp_path / "c.jsonl", fit_scores)
    save_scores(tmp_path / "t.jsonl", test_scores)
    args = ["combine", "--data", str(tmp_path / "data.jsonl"), "--scores", str(tmp_path / "c.jsonl")]
    args += ["--split", "calibration", "--measure-scores", str(tmp_path / "t.jsonl"), "--stages", "1", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Fitted on 180 prompts, measured on 180" in out
    assert "| stage 1 |" in out
    assert "| stage 2 |" in out
    assert "| combined |" in out
    assert '{"kind":"combine",' in out  # the stage to publish
    with pytest.raises(SystemExit, match="no prompt has a score"):
        main([*args[:-3], "--stages", "7"])


async def test_the_printed_stage_decides_as_the_measured_combination() -> None:
    """The combine stage the command prints, run by the cascade on stored runs, blocks exactly the items the
    comparison's combination blocks at its threshold."""
    fit_items, fit_scores = split("calibration", seed=1)
    result = compare(fit_items, fit_scores, fit_items, fit_scores, [1, 2], Budget())
    stage = combine_stage(result)
    assert stage.kind == "combine"
    assert msgspec.json.decode(msgspec.json.encode(stage), type=CascadeStage) == stage  # publishable as is
    fitted, logits = stage_logits(fit_items, fit_scores, [1, 2])
    measured = result.combination.score(logits) > result.candidates[-1].threshold
    combine = CombineStage(
        stage.combine,  # type: ignore[arg-type]  # set: a combine stage
        allow_below=stage.allow_below,
        block_above=stage.block_above,
        categories=(),
    )
    by_id = {s.id: s for s in fit_scores}
    staged = [combine.score(by_id[item.id].runs).p_unsafe > stage.block_above for item in fitted]
    assert staged == list(measured)
    assert 0 < sum(staged) < len(staged)
