"""Thresholds from a calibration split, under a declared budget.

Given every stage's stored score of every item of the calibration split (`python -m ops.eval score`, which
runs every stage on every item), search the model stages' (allow_below, block_above) on a grid for the
thresholds that block the most unsafe items while

- at most `lookalike_fpr` of the look-alikes (safe items of kind `lookalike`; every safe item in a set
  without kinds) are blocked, and
- at most `band` of all items end in the band (allowed and flagged for review: escalation must stay the
  exception), and
- at most `safe_outputs` of the safe outputs (everyday replies and refusals: items of shape `output`) are
  blocked: the same stages check the model's answers, and an everyday answer cut is a failure users see
  (none, by default), and
- at most `everyday_prompts` of the everyday prompts (safe prompts of kind `everyday`: recipes, cover
  letters, "Tell me more.") are blocked: look-alikes are not the only benign traffic, and a guard that
  blocks one everyday request in ten has failed its users however few look-alikes it blocks (3% by default:
  at 5% on the multilingual set's calibration split the choice blocked 8.6% of its test split's everyday
  prompts, whose figure swings with a few scenarios, so the default keeps a margin).

Each direction is searched on its own items under that budget: the prompts give every model stage its input
pair, the outputs its output pair (`CascadeStage.output_allow_below`/`output_block_above`), so a pair that
must spare everyday answers never binds the one that judges prompts. Ties go to fewer escalations, then to
fewer look-alikes blocked. Rules stages keep their thresholds (a rule
scores 0, 0.5 or 1), and so do the stages named in `keep` (a stage whose thresholds are chosen elsewhere).
The search mirrors `guard.cascade.route` on arrays (a stage that failed on an item passes it on, as a
failure would leave its categories unjudged); the figures it returns are then computed exactly by
`ops.eval.evaluation.evaluate` at the chosen thresholds, which is what `replay` prints. Thresholds are never
chosen on the items a guard was trained on or on the test split: pass `--split calibration`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from guard.labelled import LabelledItem
from ops.eval.evaluation import ItemScores, Report, Thresholds, evaluate, replay_item

Bools = npt.NDArray[np.bool_]


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    """What a policy declares it may cost: look-alikes, safe outputs and everyday prompts blocked, and items
    escalated to the band."""

    lookalike_fpr: float = 0.05
    band: float = 0.10
    safe_outputs: float = 0.0
    everyday_prompts: float = 0.03


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    """The thresholds chosen (a pair per stage for inputs, one for outputs), whether they meet the budget,
    and the exact figures at them."""

    thresholds: tuple[Thresholds, ...]  # judging inputs (items of shape `prompt`)
    output_thresholds: tuple[Thresholds, ...]  # judging outputs (the stored pairs where there are none)
    budget: Budget
    met: bool  # False: no grid point met the budget; the thresholds are the least over it
    blocked_recall: float  # unsafe items blocked
    lookalike_fpr: float  # look-alikes blocked
    band_share: float  # items escalated
    safe_output_fpr: float  # safe outputs blocked
    everyday_fpr: float  # everyday prompts blocked
    report: Report


def _grid(step: float) -> list[Thresholds]:
    points = [round(i * step, 6) for i in range(round(1 / step) + 1)]
    return [(a, b) for a, b in itertools.product(points, points) if a <= b]


class _Items(msgspec.Struct, frozen=True):
    """One direction's items as arrays: scores (items x stages, NaN where a stage failed) and groups."""

    p: npt.NDArray[np.float64]
    unsafe: Bools
    lookalike: Bools
    safe_outputs: Bools
    everyday: Bools


def calibrate(
    items: Sequence[LabelledItem],
    scores: Sequence[ItemScores],
    budget: Budget,
    *,
    step: float = 0.05,
    keep: Sequence[int] = (),
    dataset_sha256: str = "",
) -> Calibration:
    """The best thresholds for `items` (each needs its stored scores; see the module docstring), searched
    for each direction on its own items under the same budget: a pair per stage for prompts, and one for
    outputs. The stages at the indices in `keep` keep their stored pairs, as rules stages do."""
    by_id = {s.id: s for s in scores}
    missing = [i.id for i in items if i.id not in by_id]
    if missing:
        raise ValueError(f"no scores for {len(missing)} item(s), e.g. {missing[:3]}")
    stages = {by_id[i.id].stages for i in items}
    if len(stages) != 1:
        raise ValueError(f"the items were scored by cascades of different lengths: {sorted(stages)}")
    count = stages.pop()
    runs = [{r.index: r for r in by_id[i.id].runs} for i in items]
    if any(len(r) != count for r in runs):
        raise ValueError("a stored trace stops early (scored with --early-exit): score every stage")
    output = np.array([i.shape == "output" for i in items])
    fixed = [runs[0][k].guard == "rules" or k in keep for k in range(count)]
    nan = float("nan")
    p = np.array([[r[k].p_unsafe if r[k].p_unsafe is not None else nan for k in range(count)] for r in runs])
    unsafe = np.array([i.label == "unsafe" for i in items])
    kinds = {i.kind for i in items}
    lookalike = np.array(
        [i.label == "safe" and (i.kind == "lookalike" if "lookalike" in kinds else True) for i in items]
    )
    safe_outputs = output & ~unsafe
    everyday = np.array([i.kind == "everyday" for i in items])
    chosen: list[tuple[Thresholds, ...]] = []
    over = 0.0
    for mask in (~output, output):
        # The pairs stored with this direction's items (with the other's where it has none).
        first = runs[int(np.argmax(mask))] if mask.any() else runs[0]
        stored = [(first[k].allow_below, first[k].block_above) for k in range(count)]
        if not mask.any():
            # No items of this direction: inputs keep the stored pairs, outputs take the inputs' pairs.
            chosen.append(chosen[0] if chosen else tuple(stored))
            continue
        choices = [[stored[k]] if fixed[k] else _grid(step) for k in range(count)]
        direction = _Items(p[mask], unsafe[mask], lookalike[mask], safe_outputs[mask], everyday[mask])
        combo, direction_over = _search(direction, choices, budget)
        chosen.append(combo)
        over += direction_over
    inputs, outputs = chosen
    report = evaluate(
        items, scores, inputs, "escalate", output_thresholds=outputs, dataset_sha256=dataset_sha256
    )
    blocked, band = _exact(items, by_id, inputs, outputs)
    return Calibration(
        thresholds=inputs,
        output_thresholds=outputs,
        budget=budget,
        met=over == 0.0,
        blocked_recall=float(blocked[unsafe].mean()) if unsafe.any() else 0.0,
        lookalike_fpr=float(blocked[lookalike].mean()) if lookalike.any() else 0.0,
        band_share=float(band.mean()),
        safe_output_fpr=float(blocked[safe_outputs].mean()) if safe_outputs.any() else 0.0,
        everyday_fpr=float(blocked[everyday].mean()) if everyday.any() else 0.0,
        report=report,
    )


def _search(
    items: _Items, choices: Sequence[Sequence[Thresholds]], budget: Budget
) -> tuple[tuple[Thresholds, ...], float]:
    """The best combination of `choices` (one list per stage) for `items`, and how far over budget it is.
    Within budget first, then recall, then fewer escalations and look-alikes blocked."""
    best: tuple[tuple[float, ...], tuple[Thresholds, ...]] | None = None
    for combo in itertools.product(*choices):
        blocked, band = _route(items.p, combo)
        fpr = float(blocked[items.lookalike].mean()) if items.lookalike.any() else 0.0
        share = float(band.mean())
        recall = float(blocked[items.unsafe].mean()) if items.unsafe.any() else 0.0
        cut = float(blocked[items.safe_outputs].mean()) if items.safe_outputs.any() else 0.0
        everyday = float(blocked[items.everyday].mean()) if items.everyday.any() else 0.0
        over = (
            max(fpr - budget.lookalike_fpr, 0.0)
            + max(share - budget.band, 0.0)
            + max(cut - budget.safe_outputs, 0.0)
            + max(everyday - budget.everyday_prompts, 0.0)
        )
        key = (-over, recall, -share, -fpr)
        if best is None or key > best[0]:
            best = (key, tuple(combo))
    assert best is not None
    return best[1], -best[0][0]


def _route(p: npt.NDArray[np.float64], combo: Sequence[Thresholds]) -> tuple[Bools, Bools]:
    """(blocked, band) of every item at `combo`: the first stage whose score is under its allow threshold
    allows, over its block threshold blocks; a failed stage (NaN) passes the item on."""
    undecided = np.ones(p.shape[0], dtype=bool)
    blocked = np.zeros(p.shape[0], dtype=bool)
    for k, (allow_below, block_above) in enumerate(combo):
        score = p[:, k]
        ok = ~np.isnan(score)
        block = undecided & ok & (score > block_above)
        allow = undecided & ok & (score < allow_below)
        blocked |= block
        undecided &= ~(block | allow)
    return blocked, undecided


def _exact(
    items: Sequence[LabelledItem],
    by_id: dict[str, ItemScores],
    thresholds: Sequence[Thresholds],
    output_thresholds: Sequence[Thresholds],
) -> tuple[Bools, Bools]:
    """(blocked, band) of every item as `ops.eval.evaluation` decides it at `thresholds` (outputs at
    `output_thresholds`)."""
    results = [
        replay_item(by_id[i.id], thresholds, "escalate", output_thresholds, output=i.shape == "output").result
        for i in items
    ]
    blocked = np.array([r is not None and r.verdict == "block" for r in results])
    band = np.array([r is not None and r.decided_by is None and r.verdict == "escalate" for r in results])
    return blocked, band
