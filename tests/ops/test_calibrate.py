"""Thresholds chosen on a calibration split under a declared budget (`ops/eval/calibrate.py`)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from guard.cascade import StageRun, stage_verdict
from guard.labelled import LabelledItem
from ops.eval.__main__ import main
from ops.eval.calibrate import Budget, calibrate
from ops.eval.evaluation import ItemScores, Report, save_items, save_scores


def item(i: int, label: str, kind: str) -> LabelledItem:
    return LabelledItem(
        id=f"x{i}",
        text=f"text {i}",
        label=label,  # type: ignore[arg-type]
        category="violent_crimes",
        language="en",
        severity="high" if label == "unsafe" else "none",
        split="calibration",
        kind=kind,
    )


def scored(i: int, rules: float, model: float | None) -> ItemScores:
    runs = [
        StageRun(
            index=0,
            guard="rules",
            allow_below=0.25,
            block_above=0.75,
            p_unsafe=rules,
            verdict=stage_verdict(rules, 0.25, 0.75),
            latency_s=0.001,
        ),
        StageRun(
            index=1,
            guard="g@1",
            allow_below=0.5,
            block_above=0.5,
            p_unsafe=model,
            verdict="error" if model is None else stage_verdict(model, 0.5, 0.5),
            latency_s=0.01,
        ),
    ]
    return ItemScores(id=f"x{i}", runs=tuple(runs), stages=2, cost_s=0.011)


def dataset() -> tuple[list[LabelledItem], list[ItemScores]]:
    """20 unsafe items scored 0.55..0.99 by the model, 20 look-alikes 0.05..0.60, 10 everyday 0.0; one
    unsafe item blocked by a rule, one look-alike allowed by a rule."""
    items, scores = [], []
    for i in range(20):
        items.append(item(i, "unsafe", "request"))
        scores.append(scored(i, 1.0 if i == 0 else 0.5, 0.55 + i * 0.023))
    for i in range(20, 40):
        items.append(item(i, "safe", "lookalike"))
        scores.append(scored(i, 0.0 if i == 20 else 0.5, 0.05 + (i - 20) * 0.029))
    for i in range(40, 50):
        items.append(item(i, "safe", "everyday"))
        scores.append(scored(i, 0.5, 0.0))
    return items, scores


def test_the_thresholds_block_most_within_the_budget() -> None:
    items, scores = dataset()
    result = calibrate(items, scores, Budget(lookalike_fpr=0.05, band=0.10))
    assert result.met
    # The rules stage keeps its thresholds; the model stage gets the search's.
    assert result.thresholds[0] == (0.25, 0.75)
    allow_below, block_above = result.thresholds[1]
    assert allow_below <= block_above
    assert result.lookalike_fpr <= 0.05
    assert result.band_share <= 0.10
    # Look-alikes reach 0.60, unsafe items start at 0.55: the overlap costs recall, no more than it must.
    assert result.blocked_recall >= 0.85
    # The exact report agrees with the search.
    assert result.report.overall.n == len(items)


def test_a_budget_no_threshold_meets_is_said_so() -> None:
    # Allowing everything meets any budget unless a fixed stage is already over it: here a rule blocks a
    # look-alike, and the budget allows none.
    items, scores = dataset()
    scores[21] = scored(21, 1.0, 0.1)
    result = calibrate(items, scores, Budget(lookalike_fpr=0.0, band=0.10))
    assert not result.met
    assert result.lookalike_fpr == pytest.approx(1 / 20)
    # Still the most recall for what it costs: the model stage blocks over the highest look-alike (0.60)
    # only: 15 unsafe items and the one the rule blocks.
    assert result.blocked_recall == pytest.approx(16 / 20)


def test_a_stage_that_failed_passes_the_item_on_and_early_exit_traces_are_refused() -> None:
    items, scores = dataset()
    scores[5] = scored(5, 0.5, None)
    assert calibrate(items, scores, Budget()).met
    cut = ItemScores(id="x1", runs=scores[1].runs[:1], stages=2, cost_s=0.0)
    with pytest.raises(ValueError, match="early"):
        calibrate(items, [cut if s.id == "x1" else s for s in scores], Budget())


def test_the_command_prints_the_thresholds_and_the_budget_met(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    from ops.eval.evaluation import save_items, save_scores

    directory = Path(str(tmp_path))
    items, scores = dataset()
    save_items(directory / "items.jsonl", items)
    save_scores(directory / "scores.jsonl", scores)
    args = [
        "calibrate",
        "--data",
        str(directory / "items.jsonl"),
        "--scores",
        str(directory / "scores.jsonl"),
    ]
    assert main([*args, "--split", "calibration"]) == 0
    out = capsys.readouterr().out
    assert "--thresholds '0.25,0.75;" in out
    assert ": met" in out


def with_outputs(items: list[LabelledItem], scores: list[ItemScores]) -> None:
    """Five everyday replies the model scores like the surest requests, and five harmful answers above."""
    for i in range(50, 60):
        label, kind, model = ("safe", "reply", 0.97) if i < 55 else ("unsafe", "harmful", 0.99)
        items.append(msgspec.structs.replace(item(i, label, kind), shape="output"))
        scores.append(scored(i, 0.5, model))


def test_no_safe_output_is_blocked_unless_the_budget_allows_it() -> None:
    items, scores = dataset()
    with_outputs(items, scores)
    strict = calibrate(items, scores, Budget())
    assert strict.met
    assert strict.safe_output_fpr == 0.0
    assert strict.output_thresholds[1][1] >= 0.97  # the output pair spares every reply
    loose = calibrate(items, scores, Budget(safe_outputs=1.0))
    assert loose.safe_output_fpr > 0.0


def test_each_direction_gets_its_own_pairs_and_outputs_never_bind_the_input_pair() -> None:
    items, scores = dataset()
    alone = calibrate(items, scores, Budget())
    with_outputs(items, scores)
    both = calibrate(items, scores, Budget())
    # The replies that score like the surest requests leave the input pair where the prompts put it.
    assert both.thresholds == alone.thresholds
    assert both.output_thresholds[1] != both.thresholds[1]
    assert both.output_thresholds[0] == both.thresholds[0] == (0.25, 0.75)  # rules keep theirs
    # The figures are those of the cascade at both pairs: every harmful answer blocked, no reply.
    stage = both.report.stages[1]
    assert (stage.output_allow_below, stage.output_block_above) == both.output_thresholds[1]
    assert (stage.allow_below, stage.block_above) == both.thresholds[1]


def test_the_cli_replays_output_pairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    items, scores = dataset()
    with_outputs(items, scores)
    data, stored = tmp_path / "items.jsonl", tmp_path / "scores.jsonl"
    save_items(data, items)
    save_scores(stored, scores)
    common = ["--scores", str(stored), "--data", str(data), "--json"]
    # One pair for both directions at 0.5: every reply (0.97) is blocked; with an output pair, none.
    assert main(["replay", *common, "--thresholds", "0.25,0.75;0.5,0.5"]) == 0
    one = msgspec.json.decode(capsys.readouterr().out, type=Report)
    assert main(["replay", *common, "--thresholds", "0.25,0.75;0.5,0.5/0.98,0.98"]) == 0
    two = msgspec.json.decode(capsys.readouterr().out, type=Report)
    assert one.overall.fp - two.overall.fp == 5  # the five replies
    assert one.overall.tp == two.overall.tp  # the harmful answers still blocked
    assert (two.stages[1].output_allow_below, two.stages[1].output_block_above) == (0.98, 0.98)
    assert (two.stages[1].allow_below, two.stages[1].block_above) == (0.5, 0.5)
    assert main(["calibrate", *common[:4]]) == 0
    printed = capsys.readouterr().out
    assert "/" in printed.split("--thresholds '")[1].split("'")[0]  # an output pair of its own


def test_a_kept_stage_keeps_its_stored_thresholds() -> None:
    items, scores = dataset()
    chosen = calibrate(items, scores, Budget())
    assert chosen.thresholds[1] != (0.5, 0.5)
    kept = calibrate(items, scores, Budget(), keep=(1,))
    assert kept.thresholds == ((0.25, 0.75), (0.5, 0.5))


def test_everyday_prompts_bind_the_input_pair_within_their_budget() -> None:
    # Everyday prompts that score like harmful requests ("Write me a cover letter"): a budget without them
    # blocks them; the default budget (at most 3% of everyday prompts) spares them at some cost in recall.
    items, scores = dataset()
    high = {f"x{i}": 0.9 for i in range(40, 50)}  # every everyday prompt scores 0.9 at the model stage
    scores = [
        msgspec.structs.replace(s, runs=(s.runs[0], msgspec.structs.replace(s.runs[1], p_unsafe=high[s.id])))
        if s.id in high
        else s
        for s in scores
    ]
    loose = calibrate(items, scores, Budget(everyday_prompts=1.0))
    assert loose.everyday_fpr == 1.0
    strict = calibrate(items, scores, Budget())
    assert strict.met
    assert strict.everyday_fpr <= 0.03
    assert strict.thresholds[1][1] >= 0.9  # the block threshold sits at or above the everyday scores
    assert strict.blocked_recall < loose.blocked_recall
