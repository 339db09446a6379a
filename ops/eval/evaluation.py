"""Guard evaluation, offline: stored stage scores, threshold replay, calibration and the reports of a cascade.

Scoring runs models once; everything after that is pure. `score_all_stages` runs EVERY stage of a cascade on
every item, ignoring early exit, so the stored `StageRun`s hold a score for each stage. `replay` then decides
each item again under any thresholds and band action, through `guard.cascade.route` and the same early exit
as `Cascade.run`, without a model: with every stage stored, a replay is exactly what a fresh cascade with
those thresholds would have decided. A stage has a pair for inputs and may have one for outputs: `evaluate`
judges items of shape `output` at the output pairs, as the cascade judges the output guard's items. A trace
recorded with early exit (`score_with_cascade(..., all_stages=False)`, or a production audit trail) lacks
the stages that never ran; an item whose replay needs one of them is counted as `needs_rerun`, never guessed.

Final decisions are counted against the labels as `guard.labelled` says (its `metrics`); the labelled items
and how a guard sees one are there too, since serving uses them (the publish-time red-team check).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import msgspec

from guard.cascade import BandAction, Cascade, CascadeResult, StageRun, route, stage_verdict
from guard.dataset import dataset_dir_sha256
from guard.labelled import LabelledItem, Metrics, guard_input, metrics, read_jsonl

__all__ = [
    "CalibrationBin",
    "ItemScores",
    "Replayed",
    "Report",
    "StageReport",
    "Thresholds",
    "auroc",
    "dataset_sha256",
    "deciding_score",
    "evaluate",
    "expected_calibration_error",
    "load_scores",
    "parse_thresholds",
    "replay",
    "replay_item",
    "save_items",
    "save_scores",
    "score_all_stages",
    "score_with_cascade",
    "show_thresholds",
]

# (allow_below, block_above) of one stage.
Thresholds = tuple[float, float]

ECE_BINS = 10


class ItemScores(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The stage runs recorded for one item, as the cascade recorded them, and what scoring it cost.

    `stages` is how many stages the cascade had: fewer `runs` than that means a trace with early exit.
    """

    id: str
    runs: tuple[StageRun, ...]
    stages: int
    cost_s: float


class Replayed(msgspec.Struct, frozen=True, kw_only=True):
    """One item decided again from its stored runs; `result` is None when a stage it needs was not stored."""

    id: str
    result: CascadeResult | None
    # The latency of the stages this routing reached: what the item would have cost with early exit.
    cost_s: float = 0.0


class CalibrationBin(msgspec.Struct, frozen=True, kw_only=True):
    """One equal-width bin of deciding scores: how many, their mean, and the share of them labelled unsafe."""

    low: float
    high: float
    count: int
    mean_score: float | None
    unsafe_share: float | None


class StageReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one stage did in the replayed routing, and how well its score ranks items on its own."""

    index: int
    guard: str
    allow_below: float | None  # None: the stored thresholds were used and they differ between items
    block_above: float | None
    # The pair outputs were judged at (None: no outputs, or stored pairs that differ between them).
    output_allow_below: float | None = None
    output_block_above: float | None = None
    reached: float  # share of items the routing ran this stage on
    allowed: float  # share of items this stage settled as allow
    blocked: float  # share of items this stage settled as block
    errors: int  # stored runs of this stage that failed
    auroc: float | None  # over every stored score of this stage, whether or not the routing reached it
    mean_latency_s: float | None  # over every stored run of this stage


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """Final decisions evaluated: overall, per language/category/severity, calibration, stages, cost."""

    n: int
    band: BandAction
    dataset_sha256: str = ""
    overall: Metrics
    by_language: dict[str, Metrics]
    by_category: dict[str, Metrics]
    by_severity: dict[str, Metrics]
    ece: float | None
    calibration: tuple[CalibrationBin, ...]
    stages: tuple[StageReport, ...]
    band_share: float  # share of items no stage settled, decided by the band action
    error_share: float
    needs_rerun: int
    mean_cost_s: float | None  # per item, over the stages the routing reached
    mean_scoring_cost_s: float | None  # per item, as stored (every stage when scored with score_all_stages)


_SCORES_DECODER = msgspec.json.Decoder(ItemScores)
_ENCODER = msgspec.json.Encoder()


def save_items(path: str | Path, items: Iterable[LabelledItem]) -> None:
    """Write items as JSONL, one per line."""
    Path(path).write_bytes(b"".join(_ENCODER.encode(i) + b"\n" for i in items))


def load_scores(path: str | Path) -> list[ItemScores]:
    """Stored item scores from a JSONL file."""
    return read_jsonl(Path(path), _SCORES_DECODER)


def save_scores(path: str | Path, scores: Iterable[ItemScores]) -> None:
    """Write item scores as JSONL, one per line."""
    Path(path).write_bytes(b"".join(_ENCODER.encode(s) + b"\n" for s in scores))


def dataset_sha256(path: str | Path) -> str:
    """sha256 of the file's bytes (of a data directory's files: `guard.dataset.dataset_dir_sha256`): which
    version of a labelled set a figure came from."""
    if Path(path).is_dir():
        return dataset_dir_sha256(path)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


async def score_all_stages(cascade: Cascade, items: Iterable[LabelledItem]) -> list[ItemScores]:
    """Run every stage of `cascade` on every item, ignoring early exit, so any threshold replay is exact.

    Each run is recorded exactly as `Cascade.run` records it (verdicts at the stage's thresholds); a failing
    stage is recorded as an `error` run and the next stage still runs.
    """
    return await score_with_cascade(cascade, items, all_stages=True)


async def score_with_cascade(
    cascade: Cascade, items: Iterable[LabelledItem], *, all_stages: bool = True
) -> list[ItemScores]:
    """The stage runs of `cascade` on each item (one at a time: latencies stay those of an idle guard).

    `all_stages=False` records the cascade as it runs in service, with early exit; a replay of such a trace
    reports the items it cannot decide as `needs_rerun`.
    """
    out: list[ItemScores] = []
    for item in items:
        guarded = guard_input(item, cascade.categories)
        started = time.perf_counter()
        if all_stages:
            # The cascade's own recording, so a stored run is exactly what the service would have audited.
            runs = await cascade.run_every_stage(guarded)
        else:
            runs = (await cascade.run(guarded)).runs
        out.append(
            ItemScores(
                id=item.id, runs=runs, stages=len(cascade.stages), cost_s=time.perf_counter() - started
            )
        )
    return out


def parse_thresholds(text: str) -> tuple[list[Thresholds], list[Thresholds]]:
    """`"0.2,0.8;0.3,0.7/0.1,0.95"` -> ([(0.2, 0.8), (0.3, 0.7)], [(0.2, 0.8), (0.1, 0.95)]): per stage,
    stages by `;`, `allow_below,block_above` for inputs, then optionally `/allow_below,block_above` for
    outputs (without it, outputs are judged at the input pair). Returns (input pairs, output pairs)."""
    inputs: list[Thresholds] = []
    outputs: list[Thresholds] = []
    for part in text.split(";"):
        pairs = [_pair(part, half) for half in part.split("/")]
        if len(pairs) > 2:
            raise ValueError(f"stage thresholds {part!r}: expected allow_below,block_above[/allow,block]")
        inputs.append(pairs[0])
        outputs.append(pairs[-1])
    return inputs, outputs


def _pair(part: str, text: str) -> Thresholds:
    fields = [f.strip() for f in text.split(",")]
    if len(fields) != 2:
        raise ValueError(f"stage thresholds {part!r}: expected allow_below,block_above")
    allow_below, block_above = float(fields[0]), float(fields[1])
    if not 0.0 <= allow_below <= block_above <= 1.0:
        raise ValueError(f"stage thresholds {part!r}: need 0 <= allow_below <= block_above <= 1")
    return allow_below, block_above


def show_thresholds(inputs: Sequence[Thresholds], outputs: Sequence[Thresholds] | None = None) -> str:
    """The `--thresholds` text of these pairs (the inverse of `parse_thresholds`)."""
    outputs = outputs if outputs is not None else inputs
    return ";".join(
        f"{a:g},{b:g}" + ("" if (a, b) == (c, d) else f"/{c:g},{d:g}")
        for (a, b), (c, d) in zip(inputs, outputs, strict=True)
    )


def _rethreshold(run: StageRun, thresholds: Thresholds | None) -> StageRun:
    """`run` judged again at `thresholds` (its own when None); a failed run stays failed."""
    if run.p_unsafe is None or run.verdict == "error":
        return (
            run
            if thresholds is None
            else msgspec.structs.replace(run, allow_below=thresholds[0], block_above=thresholds[1])
        )
    allow_below, block_above = thresholds if thresholds is not None else (run.allow_below, run.block_above)
    return msgspec.structs.replace(
        run,
        allow_below=allow_below,
        block_above=block_above,
        verdict=stage_verdict(run.p_unsafe, allow_below, block_above),
    )


def replay_item(
    scores: ItemScores,
    thresholds: Sequence[Thresholds] | None,
    band: BandAction,
    output_thresholds: Sequence[Thresholds] | None = None,
    *,
    output: bool = False,
) -> Replayed:
    """Decide one item again from its stored runs, with `Cascade.run`'s early exit, through `route`: an
    `output` item at `output_thresholds` (at `thresholds` when None), any other at `thresholds`."""
    if output and output_thresholds is not None:
        thresholds = output_thresholds
    if thresholds is not None and len(thresholds) != scores.stages:
        raise ValueError(f"item {scores.id}: {len(thresholds)} stage thresholds for {scores.stages} stages")
    stored = {run.index: run for run in scores.runs}
    runs: list[StageRun] = []
    for index in range(scores.stages):
        run = stored.get(index)
        if run is None:  # early exit in the stored trace: this stage never saw the item
            return Replayed(id=scores.id, result=None)
        runs.append(_rethreshold(run, thresholds[index] if thresholds is not None else None))
        result = route(runs, band)
        if result.decided_by == index:
            return Replayed(id=scores.id, result=result, cost_s=sum(r.latency_s for r in runs))
    return Replayed(id=scores.id, result=route(runs, band), cost_s=sum(r.latency_s for r in runs))


def replay(
    scores: Iterable[ItemScores],
    thresholds: Sequence[Thresholds] | None = None,
    band: BandAction = "escalate",
) -> list[Replayed]:
    """Every item decided again at `thresholds` (per stage; None: as stored) and `band`, without models.
    Scores carry no shape: every item is judged at these pairs (`evaluate` judges outputs at theirs)."""
    return [replay_item(s, thresholds, band) for s in scores]


def deciding_score(result: CascadeResult) -> float | None:
    """The score behind the final decision: the deciding stage's, or the last stage's for the band action."""
    if result.verdict == "error" or not result.runs:
        return None
    run = result.runs[result.decided_by] if result.decided_by is not None else result.runs[-1]
    return run.p_unsafe


def expected_calibration_error(
    pairs: Iterable[tuple[float, bool]], bins: int = ECE_BINS
) -> tuple[float | None, tuple[CalibrationBin, ...]]:
    """ECE of (score, is_unsafe) pairs over `bins` equal-width bins of [0, 1] (1.0 falls in the last one):
    sum over bins of (bin count / n) * |mean score - unsafe share|. None when there are no pairs."""
    members: list[list[tuple[float, bool]]] = [[] for _ in range(bins)]
    for score, unsafe in pairs:
        members[min(int(score * bins), bins - 1)].append((score, unsafe))
    total = sum(len(m) for m in members)
    ece = 0.0
    out: list[CalibrationBin] = []
    for b, member in enumerate(members):
        mean = unsafe_share = None
        if member:
            mean = sum(s for s, _ in member) / len(member)
            unsafe_share = sum(1 for _, u in member if u) / len(member)
            ece += len(member) / total * abs(mean - unsafe_share)
        out.append(
            CalibrationBin(
                low=b / bins,
                high=(b + 1) / bins,
                count=len(member),
                mean_score=mean,
                unsafe_share=unsafe_share,
            )
        )
    return (ece if total else None), tuple(out)


def auroc(pairs: Iterable[tuple[float, bool]]) -> float | None:
    """Area under the ROC curve of (score, is_unsafe) pairs (ties count half); None without both labels."""
    ranked = sorted(pairs, key=lambda p: p[0])
    positives = sum(1 for _, u in ranked if u)
    negatives = len(ranked) - positives
    if not positives or not negatives:
        return None
    rank_sum = 0.0
    i = 0
    while i < len(ranked):  # average ranks over runs of equal scores (Mann-Whitney U)
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        mean_rank = (i + 1 + j) / 2
        rank_sum += mean_rank * sum(1 for _, u in ranked[i:j] if u)
        i = j
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def _by(
    items: Sequence[LabelledItem], results: Mapping[str, CascadeResult | None], key: str
) -> dict[str, Metrics]:
    groups: dict[str, list[LabelledItem]] = {}
    for item in items:
        groups.setdefault(str(getattr(item, key)), []).append(item)
    return {
        name: metrics((i.label, results[i.id]) for i in members) for name, members in sorted(groups.items())
    }


def _stage_reports(
    items: Sequence[LabelledItem],
    scores: Mapping[str, ItemScores],
    replayed: Mapping[str, Replayed],
    thresholds: Sequence[Thresholds] | None,
    output_thresholds: Sequence[Thresholds] | None,
) -> tuple[StageReport, ...]:
    n = len(items)
    stages = max((scores[i.id].stages for i in items), default=0)
    results = [r.result for r in replayed.values() if r.result is not None]
    out: list[StageReport] = []
    for index in range(stages):
        stored = [
            (run, item.label == "unsafe")
            for item in items
            for run in scores[item.id].runs
            if run.index == index
        ]
        reached = sum(1 for r in results if len(r.runs) > index)
        settled = [r.verdict for r in results if r.decided_by == index]
        latencies = [run.latency_s for run, _ in stored]
        allow_below, block_above = _pair_of(_runs(items, scores, index, output=False), thresholds, index)
        output_allow_below, output_block_above = _pair_of(
            _runs(items, scores, index, output=True),
            output_thresholds if output_thresholds is not None else thresholds,
            index,
        )
        out.append(
            StageReport(
                index=index,
                guard=stored[0][0].guard if stored else "",
                allow_below=allow_below,
                block_above=block_above,
                output_allow_below=output_allow_below,
                output_block_above=output_block_above,
                reached=reached / n if n else 0.0,
                allowed=settled.count("allow") / n if n else 0.0,
                blocked=settled.count("block") / n if n else 0.0,
                errors=sum(1 for run, _ in stored if run.verdict == "error" or run.p_unsafe is None),
                auroc=auroc((run.p_unsafe, u) for run, u in stored if run.p_unsafe is not None),
                mean_latency_s=sum(latencies) / len(latencies) if latencies else None,
            )
        )
    return tuple(out)


def _runs(
    items: Sequence[LabelledItem], scores: Mapping[str, ItemScores], index: int, *, output: bool
) -> list[StageRun]:
    """The stored runs of stage `index` on the outputs (or on the other items) of `items`."""
    return [
        run
        for item in items
        if (item.shape == "output") == output
        for run in scores[item.id].runs
        if run.index == index
    ]


def _pair_of(
    runs: Sequence[StageRun], thresholds: Sequence[Thresholds] | None, index: int
) -> tuple[float | None, float | None]:
    """The pair stage `index` judged `runs` at: the given one, else the stored one when all agree; none for
    no runs."""
    if not runs:
        return None, None
    if thresholds is not None:
        return thresholds[index]
    pairs = {(run.allow_below, run.block_above) for run in runs}
    return pairs.pop() if len(pairs) == 1 else (None, None)


def evaluate(
    items: Sequence[LabelledItem],
    scores: Iterable[ItemScores],
    thresholds: Sequence[Thresholds] | None = None,
    band: BandAction = "escalate",
    *,
    output_thresholds: Sequence[Thresholds] | None = None,
    dataset_sha256: str = "",
) -> Report:
    """The report on `items` with their stored `scores` decided at `thresholds` (None: as stored) and `band`;
    items of shape `output` at `output_thresholds` (None: at `thresholds`).

    Every item needs scores (ValueError otherwise); scores of other items are ignored, so one scores file
    serves both splits.
    """
    by_id = {s.id: s for s in scores}
    missing = [i.id for i in items if i.id not in by_id]
    if missing:
        raise ValueError(f"no scores for {len(missing)} item(s), e.g. {missing[:3]}")
    replayed = {
        i.id: replay_item(by_id[i.id], thresholds, band, output_thresholds, output=i.shape == "output")
        for i in items
    }
    results = {k: r.result for k, r in replayed.items()}
    n = len(items)
    decided = [(i, r) for i in items if (r := results[i.id]) is not None]
    calibration_pairs = [
        (score, item.label == "unsafe") for item, r in decided if (score := deciding_score(r)) is not None
    ]
    ece, bins = expected_calibration_error(calibration_pairs)
    costs = [r.cost_s for r in replayed.values() if r.result is not None]
    scoring_costs = [by_id[i.id].cost_s for i in items]
    return Report(
        n=n,
        band=band,
        dataset_sha256=dataset_sha256,
        overall=metrics((i.label, results[i.id]) for i in items),
        by_language=_by(items, results, "language"),
        by_category=_by(items, results, "category"),
        by_severity=_by(items, results, "severity"),
        ece=ece,
        calibration=bins,
        stages=_stage_reports(items, by_id, replayed, thresholds, output_thresholds),
        band_share=_share(
            sum(1 for _, r in decided if r.decided_by is None and r.runs and r.verdict != "error"), n
        ),
        error_share=_share(sum(1 for _, r in decided if r.verdict == "error"), n),
        needs_rerun=n - len(decided),
        mean_cost_s=sum(costs) / len(costs) if costs else None,
        mean_scoring_cost_s=sum(scoring_costs) / n if n else None,
    )


def _share(count: int, n: int) -> float:
    return count / n if n else 0.0
