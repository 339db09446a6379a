"""Figures of a run, from its samples: latency percentiles, goodput, SLO attainment, counts by outcome.

- TTFT and inter-token latency come from every request that streamed text (completed or cancelled after its
  first token); end-to-end latency from completed requests only. Percentiles interpolate linearly between
  the closest ranks (numpy's default).
- A request meets its class's SLO when it completed with TTFT <= `ttft` and a mean inter-token gap <=
  `itl`. Attainment = requests meeting it / requests sent less those the client cancelled on purpose
  (rejections and errors count as misses). Goodput = requests meeting it per second of the run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import msgspec

from ops.bench.load.client import Sample
from ops.bench.load.workload import Slo, Workload


class Percentiles(msgspec.Struct, frozen=True, kw_only=True):
    """Summary of one latency, in seconds (None without samples)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """Counts and figures of a set of requests (a class, a tenant, or all)."""

    sent: int
    completed: int
    cancelled: int
    rejected: int
    errors: int
    slo_met: int
    slo_attainment: float | None
    goodput_per_s: float
    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """The JSON written by `lockgate bench` (`report.json`)."""

    target: str
    model: str
    started_at: float  # Unix time
    duration_s: float  # from the start to the end of the last request
    offered_rate: float  # requests sent per second of arrivals
    overall: Summary
    classes: dict[str, Summary]
    tenants: dict[str, Summary]
    rejections: dict[str, int]  # "429 queue_full": count
    errors: dict[str, int]
    workload: Workload  # API keys redacted
    samples: list[Sample]


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of non-empty `values`, interpolated linearly between ranks."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(values: Sequence[float]) -> Percentiles:
    """Count, mean, p50, p90 and p99."""
    if not values:
        return Percentiles(count=0, mean=None, p50=None, p90=None, p99=None)
    return Percentiles(
        count=len(values),
        mean=sum(values) / len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
    )


def meets(sample: Sample, slo: Slo) -> bool:
    """Whether a request completed within its class's targets."""
    if sample.status != "completed" or sample.ttft is None:
        return False
    mean_itl = sum(sample.itl) / len(sample.itl) if sample.itl else 0.0
    return sample.ttft <= slo.ttft and mean_itl <= slo.itl


def summarize(samples: Sequence[Sample], workload: Workload, duration_s: float) -> Summary:
    """The figures of `samples`, each judged against its own class's SLO."""
    statuses = Counter(s.status for s in samples)
    met = sum(meets(s, workload.slo_of(s.priority)) for s in samples)
    judged = len(samples) - statuses["cancelled"]
    return Summary(
        sent=len(samples),
        completed=statuses["completed"],
        cancelled=statuses["cancelled"],
        rejected=statuses["rejected"],
        errors=statuses["error"],
        slo_met=met,
        slo_attainment=met / judged if judged else None,
        goodput_per_s=met / duration_s if duration_s > 0 else 0.0,
        ttft=percentiles([s.ttft for s in samples if s.ttft is not None]),
        itl=percentiles([gap for s in samples for gap in s.itl]),
        e2e=percentiles([s.e2e for s in samples if s.status == "completed" and s.e2e is not None]),
    )


def _by(samples: Iterable[Sample], key: str) -> dict[str, list[Sample]]:
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(getattr(sample, key), []).append(sample)
    return dict(sorted(groups.items()))


def _reasons(samples: Iterable[Sample], status: str) -> dict[str, int]:
    counts = Counter(f"{s.http_status or '-'} {s.code or '-'}" for s in samples if s.status == status)
    return dict(counts.most_common())


def build_report(
    samples: Sequence[Sample], workload: Workload, *, target: str, started_at: float, duration_s: float
) -> Report:
    """The report of a run."""
    ordered = sorted(samples, key=lambda s: s.index)
    span = max((s.scheduled for s in ordered), default=0.0)
    redacted = msgspec.structs.replace(
        workload, tenants=tuple(msgspec.structs.replace(t, api_key="<redacted>") for t in workload.tenants)
    )
    return Report(
        target=target,
        model=workload.model,
        started_at=started_at,
        duration_s=duration_s,
        offered_rate=len(ordered) / span if span > 0 else 0.0,
        overall=summarize(ordered, workload, duration_s),
        classes={k: summarize(v, workload, duration_s) for k, v in _by(ordered, "priority").items()},
        tenants={k: summarize(v, workload, duration_s) for k, v in _by(ordered, "tenant").items()},
        rejections=_reasons(ordered, "rejected"),
        errors=_reasons(ordered, "error"),
        workload=redacted,
        samples=ordered,
    )


def encode(report: Report) -> bytes:
    """The report as indented JSON."""
    return msgspec.json.format(msgspec.json.encode(report), indent=2)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def render(report: Report) -> str:
    """A plain-text summary for the terminal."""
    rows = [("all", report.overall), *report.classes.items()]
    lines = [
        f"target {report.target}  model {report.model}  {report.overall.sent} requests in "
        f"{report.duration_s:.1f} s (offered {report.offered_rate:.2f}/s)",
        f"{'class':<12}{'sent':>6}{'done':>6}{'cancel':>7}{'reject':>7}{'error':>6}"
        f"{'TTFT p50/p90/p99 ms':>24}{'ITL p50/p90/p99 ms':>22}{'SLO':>7}{'goodput/s':>11}",
    ]
    for name, s in rows:
        ttft = "/".join(_ms(v) for v in (s.ttft.p50, s.ttft.p90, s.ttft.p99))
        itl = "/".join(_ms(v) for v in (s.itl.p50, s.itl.p90, s.itl.p99))
        slo = "-" if s.slo_attainment is None else f"{s.slo_attainment:.0%}"
        lines.append(
            f"{name:<12}{s.sent:>6}{s.completed:>6}{s.cancelled:>7}{s.rejected:>7}{s.errors:>6}"
            f"{ttft:>24}{itl:>22}{slo:>7}{s.goodput_per_s:>11.2f}"
        )
    for title, counts in (("rejections", report.rejections), ("errors", report.errors)):
        if counts:
            lines.append(f"{title}: " + ", ".join(f"{k} x{v}" for k, v in counts.items()))
    return "\n".join(lines)
