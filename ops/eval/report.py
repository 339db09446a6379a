"""A `ops.eval.evaluation.Report` as markdown: overall figures, breakdowns, stages, calibration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from guard.labelled import Metrics
from ops.eval.evaluation import Report, StageReport

_METRIC_HEADER = (
    "",
    "n",
    "TP",
    "FP",
    "TN",
    "FN",
    "errors",
    "rerun",
    "precision",
    "recall",
    "F1",
    "FPR",
    "FNR",
)


def _num(value: float | None, digits: int = 3) -> str:
    """A rate with `digits` decimals, or "-" where it is undefined (a zero denominator)."""
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _last_flags(n: int) -> list[bool]:
    return [i == n - 1 for i in range(n)]


def _metric_row(name: str, m: Metrics) -> list[str]:
    counts = [str(v) for v in (m.n, m.tp, m.fp, m.tn, m.fn, m.errors, m.needs_rerun)]
    rates = [_num(v) for v in (m.precision, m.recall, m.f1, m.fpr, m.fnr)]
    return [name, *counts, *rates]


def _breakdown(title: str, groups: Mapping[str, Metrics]) -> list[str]:
    return [
        "",
        f"### By {title}",
        "",
        *_table(_METRIC_HEADER, [_metric_row(k, m) for k, m in groups.items()]),
    ]


def render(report: Report, *, title: str = "Guard evaluation") -> str:
    """The report as a markdown document."""
    lines = [
        f"## {title}",
        "",
        f"{report.n} items; past the last stage: `{report.band}`; "
        f"dataset sha256 `{report.dataset_sha256 or '-'}`.",
        "Flagged unsafe = block or escalate; errors and items needing a rerun are counted apart, never as",
        "safe, and left out of the rates. Development figures on a small hand-written set, not a benchmark.",
        "",
        *_table(_METRIC_HEADER, [_metric_row("overall", report.overall)]),
    ]
    lines += _breakdown("language", report.by_language)
    lines += _breakdown("category (safe items of a harm category are its look-alikes)", report.by_category)
    lines += _breakdown("severity", report.by_severity)
    stage_rows = [
        [
            str(s.index),
            s.guard,
            _pairs(s),
            _num(s.reached),
            _num(s.allowed),
            _num(s.blocked),
            str(s.errors),
            _num(s.auroc),
            _num(s.mean_latency_s, 4),
        ]
        for s in report.stages
    ]
    header = (
        "stage",
        "guard",
        "allow below / block above",
        "reached",
        "allowed",
        "blocked",
        "errors",
        "AUROC",
    )
    lines += ["", "### Stages (shares of all items)", "", *_table((*header, "mean latency s"), stage_rows)]
    lines += [
        "",
        f"Reached the band (no stage settled): {_num(report.band_share)}; "
        f"errors: {_num(report.error_share)}; "
        f"needing a rerun (a stage missing from the stored trace): {report.needs_rerun}.",
        f"Mean cost per item with early exit: {_num(report.mean_cost_s, 4)} s; as scored (every stage): "
        f"{_num(report.mean_scoring_cost_s, 4)} s.",
        "",
        f"### Calibration of the deciding score (ECE, {len(report.calibration)} bins): {_num(report.ece)}",
        "",
    ]
    bin_rows = [
        # The last bin is closed: a score of 1.0 falls in it.
        [
            f"[{b.low:.1f}, {b.high:.1f}{']' if last else ')'}",
            str(b.count),
            _num(b.mean_score),
            _num(b.unsafe_share),
        ]
        for b, last in zip(report.calibration, _last_flags(len(report.calibration)), strict=True)
    ]
    lines += _table(("bin", "items", "mean score", "unsafe share"), bin_rows)
    return "\n".join(lines) + "\n"


def _pairs(stage: StageReport) -> str:
    """`allow / block`, and the outputs' pair after it where it differs."""
    shown = f"{_num(stage.allow_below, 2)} / {_num(stage.block_above, 2)}"
    output = (stage.output_allow_below, stage.output_block_above)
    if output in ((None, None), (stage.allow_below, stage.block_above)):
        return shown
    return f"{shown}; outputs {_num(output[0], 2)} / {_num(output[1], 2)}"
