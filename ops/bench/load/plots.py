"""PNG plots of a run (matplotlib, Agg canvas, no pyplot state): latency CDFs per class, and a timeline of
arrivals and time to first token. matplotlib comes with the `dev` extra; it is imported only here."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ops.bench.load.client import Sample
from ops.bench.load.report import Report

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_COLOURS = {"interactive": "tab:blue", "batch": "tab:orange"}


def available() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def _figure(width: float, height: float, rows: int) -> tuple[Figure, list[Axes]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, [figure.add_subplot(rows, 1, i + 1) for i in range(rows)]


def _cdf(axes: Axes, values: Sequence[float], label: str, colour: str) -> None:
    ordered = sorted(values)
    if not ordered:
        return
    fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
    axes.step(
        [v * 1000 for v in ordered],
        fractions,
        where="post",
        label=f"{label} (n={len(ordered)})",
        color=colour,
    )


def latency_cdfs(report: Report, path: Path) -> Path:
    """TTFT and inter-token latency CDFs, one line per class."""
    figure, (ttft, itl) = _figure(8, 7, 2)
    for klass in report.classes:
        samples = [s for s in report.samples if s.priority == klass]
        colour = _COLOURS.get(klass, "tab:green")
        _cdf(ttft, [s.ttft for s in samples if s.ttft is not None], klass, colour)
        _cdf(itl, [gap for s in samples for gap in s.itl], klass, colour)
    for axes, name in ((ttft, "time to first token"), (itl, "inter-token latency")):
        axes.set_xlabel(f"{name} (ms)")
        axes.set_ylabel("fraction of requests" if axes is ttft else "fraction of gaps")
        axes.set_ylim(0, 1.02)
        axes.grid(alpha=0.3)
        if axes.has_data():
            axes.legend(loc="lower right")
    figure.suptitle(f"{report.model} at {report.target}: {report.overall.sent} requests")
    figure.savefig(path, dpi=110)
    return path


def _arrival_rate(samples: Sequence[Sample]) -> tuple[list[float], list[float], float]:
    """Bin starts, arrivals per second in each, and the bin width: 1 s, or a twentieth of a short run."""
    span = max((s.scheduled for s in samples), default=0.0)
    width = 1.0 if span >= 20 else max(span, 1e-3) / 20
    counts = [0] * (int(span / width) + 1)
    for sample in samples:
        counts[int(sample.scheduled / width)] += 1
    return [i * width for i in range(len(counts))], [c / width for c in counts], width


def timeline(report: Report, path: Path) -> Path:
    """Arrivals per second, and each request's TTFT at its arrival time (rejections and errors marked)."""
    figure, (rate, latency) = _figure(9, 6, 2)
    latency.sharex(rate)
    starts, rates, width = _arrival_rate(report.samples)
    rate.bar(starts, rates, width=width, align="edge", color="tab:gray")
    rate.set_ylabel("arrivals per second")
    for klass in report.classes:
        got = [s for s in report.samples if s.priority == klass and s.ttft is not None]
        latency.scatter(
            [s.scheduled for s in got],
            [s.ttft or 0.0 for s in got],
            s=8,
            label=f"{klass} TTFT",
            color=_COLOURS.get(klass, "tab:green"),
        )
    failed = [s for s in report.samples if s.status in ("rejected", "error")]
    if failed:
        latency.scatter(
            [s.scheduled for s in failed],
            [0.0] * len(failed),
            marker="x",
            color="tab:red",
            label="rejected / error",
        )
    latency.set_xlabel("arrival (s from start)")
    latency.set_ylabel("time to first token (s)")
    latency.grid(alpha=0.3)
    if latency.has_data():
        latency.legend(loc="upper left")
    figure.savefig(path, dpi=110)
    return path


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    """Both plots into `out_dir`; their paths."""
    return [latency_cdfs(report, out_dir / "latency_cdf.png"), timeline(report, out_dir / "timeline.png")]
