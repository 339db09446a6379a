"""The figures of `ops.bench.overhead`: per target and rate, the gateway against the mock at the same rate,
a summary per mode and quota store, the table and the plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from gateway.quantile import nearest_rank

Mode = Literal["whole", "stream"]
# The mock server, or a gateway: named by its quota store ("memory", "redis"), then its default policy and
# storage where a run compares several ("memory/rules/postgres"), or, with several processes, "workers-N".
Target = str


class Latency(msgspec.Struct, frozen=True, kw_only=True):
    """Percentiles in seconds over the completed requests (0 without any)."""

    p50: float
    p99: float


class Measure(msgspec.Struct, frozen=True, kw_only=True):
    """One target under one rate of one mode."""

    target: Target
    offered_per_s: float
    sent: int
    completed: int
    errors: int  # non-200 answers, transport failures and timeouts
    achieved_per_s: float  # completed over the time from the first send to the last answer
    latency: Latency  # the whole answer
    first_chunk: Latency | None  # streams: the first chunk with text
    chunks: int  # streams: chunks with text delivered
    cpu_s: float  # the server process's user + system CPU over the step
    cpu_per_request_ms: float
    cpu_per_chunk_us: float | None
    client_lag_p99_ms: float  # how late the load generator sent (its own limit, not the server's)
    saturated: bool
    error_sample: str = ""


class OnsetBin(msgspec.Struct, frozen=True, kw_only=True):
    """The requests an overload step sent in one slice of its start (`start_s` seconds in, for `width_s`):
    how many were admitted and shed, and the slowest of each (seconds; None without any)."""

    start_s: float
    width_s: float
    admitted: int
    shed: int
    admitted_max: float | None
    shed_max: float | None


def onset_bins(sent: Sequence[tuple[float, int, float | None]], width: float, span: float) -> list[OnsetBin]:
    """`sent` (each request's send time into the step, HTTP status, total seconds or None) in slices of
    `width` s over the first `span` s: where the start of a jump queued."""
    bins = []
    for index in range(round(span / width)):
        start = index * width
        inside = [(status, total) for at, status, total in sent if start <= at < start + width]
        admitted = [t for status, t in inside if status == 200 and t is not None]
        shed = [t for status, t in inside if status == 503 and t is not None]
        bins.append(
            OnsetBin(
                start_s=start,
                width_s=width,
                admitted=len(admitted),
                shed=len(shed),
                admitted_max=max(admitted, default=None),
                shed_max=max(shed, default=None),
            )
        )
    return bins


class OverloadMeasure(msgspec.Struct, frozen=True, kw_only=True):
    """Whole answers past saturation to one gateway: the admitted and the shed, and the mock at that rate."""

    target: Target
    offered_per_s: float
    sent: int
    admitted: int  # 200
    shed: int  # 503 (overloaded, or no replica could take it)
    other: int  # other statuses, transport failures, timeouts
    # The others by status (0: a transport failure or timeout), with the first error body of each.
    other_by_status: dict[str, int] = {}
    other_sample: dict[str, str] = {}
    admitted_latency: Latency
    shed_latency: Latency  # how long a shed request took to be told
    # The same, for the requests sent `steady_after_s` or later into the step (past its onset).
    steady_after_s: float
    steady_admitted_latency: Latency
    steady_shed_latency: Latency
    mock: Measure
    shed_by_reason: dict[str, int] = {}  # the gateway's lockgate:shed_requests_total over the step
    onset: list[OnsetBin] = []  # the step's first half second in slices (`onset_bins`)

    def brief(self) -> str:
        """One line of figures."""
        added = 1000 * (self.admitted_latency.p99 - self.mock.latency.p99)
        return (
            f"{self.admitted}/{self.sent} admitted, p50 {1000 * self.admitted_latency.p50:.1f} ms, "
            f"p99 {1000 * self.admitted_latency.p99:.1f} ms (added p99 {added:.1f} ms over the mock at this "
            f"rate{', itself saturated' if self.mock.saturated else ''}); {self.shed} shed in p50 "
            f"{1000 * self.shed_latency.p50:.1f} ms, p99 {1000 * self.shed_latency.p99:.1f} ms; "
            f"sent after {self.steady_after_s:g} s: admitted p99 "
            f"{1000 * self.steady_admitted_latency.p99:.1f} ms, shed p99 "
            f"{1000 * self.steady_shed_latency.p99:.1f} ms; {self.other} other"
            + "".join(f", {n} x {status}" for status, n in sorted(self.other_by_status.items()))
            + "; metrics: "
            + (", ".join(f"{n} {reason}" for reason, n in sorted(self.shed_by_reason.items())) or "-")
            + self._onset_brief()
        )

    def _onset_brief(self) -> str:
        """The onset's slowest admitted and shed request, and the slices they were sent in."""
        parts = []
        admitted = [(b.admitted_max, b.start_s) for b in self.onset if b.admitted_max is not None]
        shed = [(b.shed_max, b.start_s) for b in self.onset if b.shed_max is not None]
        for kind, timed in (("admitted", admitted), ("shed", shed)):
            if timed:
                worst, start = max(timed)
                parts.append(f"slowest {kind} {1000 * worst:.1f} ms (sent {1000 * start:.0f} ms in)")
        if not parts:
            return ""
        span = sum(b.width_s for b in self.onset)
        return f"; in the first {span:g} s: " + ", ".join(parts)


class Point(msgspec.Struct, frozen=True, kw_only=True):
    """One rate of one mode: the mock and each gateway measured back to back."""

    mode: Mode
    rate: float
    mock: Measure
    gateways: list[Measure]


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """One gateway quota store in one mode: added latency, gateway CPU, and the most it served before
    saturation."""

    mode: Mode
    quota: Target
    rate: float  # the lowest rate, where neither side queues: the added latency
    added_p50_ms: float
    added_p99_ms: float
    cpu_rate: float  # the highest unsaturated rate: the CPU figures (the mock's at the same rate)
    cpu_per_request_ms: float
    cpu_per_chunk_us: float | None  # streams: all CPU over chunks (the request's fixed cost included)
    # Streams: what a chunk costs beyond a whole answer of as many tokens at the same rate, i.e. (CPU per
    # stream - CPU per whole request) / chunks per stream; None without both modes.
    marginal_cpu_per_chunk_us: float | None
    mock_cpu_per_request_ms: float
    max_unsaturated_per_s: float  # the highest achieved rate of an unsaturated step (0 if none)
    saturated_at: float | None  # the offered rate where it first saturated; None: not reached


class GateCost(msgspec.Struct, frozen=True, kw_only=True):
    """What a gated gateway costs beyond the same gateway without a gate (`baseline`, policy `none`), in one
    mode, each figure at one rate for both."""

    mode: Mode
    target: Target
    baseline: Target
    cpu_rate: float  # the gated gateway's highest unsaturated rate (or its lowest)
    cpu_per_request_ms: float
    baseline_cpu_per_request_ms: float
    # Streams: the CPU beyond the baseline's over the baseline's chunks per stream (the gate's cost per
    # chunk; a gate that holds text back sends the same tokens in fewer chunks).
    cpu_per_chunk_beyond_us: float | None
    rate: float  # the lowest rate: the latency
    added_p50_ms: float  # p50 latency beyond the baseline's
    added_p99_ms: float

    @property
    def cpu_ratio(self) -> float:
        return (
            self.cpu_per_request_ms / self.baseline_cpu_per_request_ms
            if self.baseline_cpu_per_request_ms
            else 0.0
        )


class OverheadReport(msgspec.Struct, frozen=True, kw_only=True):
    """The whole run."""

    seconds_per_step: float
    max_tokens: int
    prompt_words: int
    guards: list[str]
    storages: list[str]
    server_core: int
    client_core: int
    points: list[Point]
    summaries: list[Summary]
    overloads: list[OverloadMeasure] = []
    gate_costs: list[GateCost] = []
    # Per gateway, the gate decisions its log says the audit trail could not take over the whole run
    # (refused with 503, or served unaudited under fail-open: either way not recorded).
    unrecorded: dict[Target, int] = {}


def percentiles(values: Sequence[float]) -> Latency:
    """Nearest-rank p50 and p99."""
    return Latency(p50=nearest_rank(values, 0.5), p99=nearest_rank(values, 0.99))


def _cpu_rate(pairs: Sequence[tuple[Point, Measure]]) -> float:
    """The highest rate the gateway served unsaturated (the lowest if none): there its idle work (probes,
    refreshes) weighs least on the per-request figures."""
    fine = [p.rate for p, g in pairs if not g.saturated]
    return max(fine) if fine else pairs[0][0].rate


def summarise(points: Sequence[Point]) -> list[Summary]:
    """One summary per (mode, quota store) measured: added latency at the lowest rate, CPU at the highest
    unsaturated one."""
    out: list[Summary] = []
    at = {(p.mode, p.rate, g.target): g for p in points for g in p.gateways}
    for mode in dict.fromkeys(p.mode for p in points):
        rows = [p for p in points if p.mode == mode]
        for quota in dict.fromkeys(g.target for p in rows for g in p.gateways):
            pairs = [(p, g) for p in rows for g in p.gateways if g.target == quota]
            low, gw = pairs[0]
            cpu_rate = _cpu_rate(pairs)
            cpu = at[(mode, cpu_rate, quota)]
            mock = next(p.mock for p in rows if p.rate == cpu_rate)
            whole = at.get(("whole", cpu_rate, quota))
            marginal = None
            if mode == "stream" and whole is not None and not whole.saturated and cpu.chunks:
                per_stream = cpu.chunks / cpu.completed
                marginal = 1000 * (cpu.cpu_per_request_ms - whole.cpu_per_request_ms) / per_stream
            first = [p.rate for p, g in pairs if g.saturated]
            fine = [g.achieved_per_s for _, g in pairs if not g.saturated]
            out.append(
                Summary(
                    mode=mode,
                    quota=quota,
                    rate=low.rate,
                    added_p50_ms=1000 * (gw.latency.p50 - low.mock.latency.p50),
                    added_p99_ms=1000 * (gw.latency.p99 - low.mock.latency.p99),
                    cpu_rate=cpu_rate,
                    cpu_per_request_ms=cpu.cpu_per_request_ms,
                    cpu_per_chunk_us=cpu.cpu_per_chunk_us,
                    marginal_cpu_per_chunk_us=marginal,
                    mock_cpu_per_request_ms=mock.cpu_per_request_ms,
                    max_unsaturated_per_s=max(fine, default=0.0),
                    saturated_at=first[0] if first else None,
                )
            )
    return out


def gate_costs(points: Sequence[Point], baselines: dict[Target, Target]) -> list[GateCost]:
    """For each gated target (`baselines` maps it to its twin without a gate), mode by mode: its CPU per
    request against the twin's at the same rate, and its latency against the twin's at the lowest rate."""
    out: list[GateCost] = []
    at = {(p.mode, p.rate, g.target): g for p in points for g in p.gateways}
    for mode in dict.fromkeys(p.mode for p in points):
        rows = [p for p in points if p.mode == mode]
        for target, baseline in baselines.items():
            pairs = [
                (p, at[(mode, p.rate, target)], at[(mode, p.rate, baseline)])
                for p in rows
                if (mode, p.rate, target) in at and (mode, p.rate, baseline) in at
            ]
            if not pairs:
                continue
            fine = [(p, g, b) for p, g, b in pairs if not g.saturated and not b.saturated]
            point, gated, twin = fine[-1] if fine else pairs[0]
            beyond = None
            if mode == "stream" and twin.completed and twin.chunks:
                # Over the twin's chunks: the tokens a stream carries (a gate holding text back for its
                # checks sends them in fewer, larger chunks).
                per_stream = twin.chunks / twin.completed
                beyond = 1000 * (gated.cpu_per_request_ms - twin.cpu_per_request_ms) / per_stream
            _, low, low_twin = pairs[0]
            out.append(
                GateCost(
                    mode=mode,
                    target=target,
                    baseline=baseline,
                    cpu_rate=point.rate,
                    cpu_per_request_ms=gated.cpu_per_request_ms,
                    baseline_cpu_per_request_ms=twin.cpu_per_request_ms,
                    cpu_per_chunk_beyond_us=beyond,
                    rate=pairs[0][0].rate,
                    added_p50_ms=1000 * (low.latency.p50 - low_twin.latency.p50),
                    added_p99_ms=1000 * (low.latency.p99 - low_twin.latency.p99),
                )
            )
    return out


def format_table(report: OverheadReport) -> str:
    """One line per point and target, then the summaries."""
    header = f"{'mode':>6} {'rate/s':>7} {'target':>18} {'done/s':>7} {'err':>5} {'p50 ms':>7} {'p99 ms':>7} "
    header += f"{'+p50':>6} {'+p99':>6} {'cpu/req ms':>10} {'cpu/chunk us':>12} {'lag ms':>7}"
    lines = [header]
    for point in report.points:
        for m in [point.mock, *point.gateways]:
            added = m.target != "mock"
            cells = [
                f"{point.mode:>6}",
                f"{point.rate:>7g}",
                f"{m.target:>18}",
                f"{m.achieved_per_s:>7.0f}",
                f"{m.errors:>5}",
                f"{1000 * m.latency.p50:>7.2f}",
                f"{1000 * m.latency.p99:>7.2f}",
                f"{1000 * (m.latency.p50 - point.mock.latency.p50):>6.2f}" if added else f"{'':>6}",
                f"{1000 * (m.latency.p99 - point.mock.latency.p99):>6.2f}" if added else f"{'':>6}",
                f"{m.cpu_per_request_ms:>10.3f}",
                f"{m.cpu_per_chunk_us:>12.1f}" if m.cpu_per_chunk_us is not None else f"{'-':>12}",
                f"{m.client_lag_p99_ms:>7.1f}" + (" SAT" if m.saturated else ""),
            ]
            lines.append(" ".join(cells))
    lines.append("")
    for s in report.summaries:
        chunk = f", {s.cpu_per_chunk_us:.1f} us CPU/chunk" if s.cpu_per_chunk_us is not None else ""
        if s.marginal_cpu_per_chunk_us is not None:
            chunk += f" ({s.marginal_cpu_per_chunk_us:.1f} us beyond a whole answer)"
        sat = f"saturated at {s.saturated_at:g}/s" if s.saturated_at is not None else "not saturated"
        lines.append(
            f"{s.mode:>6} {s.quota:>6}: added p50 {s.added_p50_ms:.2f} ms, p99 {s.added_p99_ms:.2f} ms at "
            f"{s.rate:g}/s; at {s.cpu_rate:g}/s gateway {s.cpu_per_request_ms:.3f} ms CPU/request{chunk} "
            f"(mock {s.mock_cpu_per_request_ms:.3f}); best unsaturated {s.max_unsaturated_per_s:.0f}/s, {sat}"
        )
    for c in report.gate_costs:
        chunk = (
            f", {c.cpu_per_chunk_beyond_us:.1f} us CPU per chunk beyond it"
            if c.cpu_per_chunk_beyond_us is not None
            else ""
        )
        lines.append(
            f"{c.mode:>6} {c.target} against {c.baseline}: CPU/request {c.cpu_per_request_ms:.3f} ms = "
            f"{c.cpu_ratio:.2f}x ({c.baseline_cpu_per_request_ms:.3f} ms) at {c.cpu_rate:g}/s{chunk}; "
            f"p50 +{c.added_p50_ms:.2f} ms, p99 +{c.added_p99_ms:.2f} ms at {c.rate:g}/s"
        )
    lines.extend(f"overload {o.target:>6} at {o.offered_per_s:.0f}/s: {o.brief()}" for o in report.overloads)
    lines.extend(
        f"audit {target}: {count} gate decisions not recorded over the run"
        for target, count in report.unrecorded.items()
        if count
    )
    return "\n".join(lines)


def plot(report: OverheadReport, path: Path) -> bool:
    """Latency p50 and achieved rate against offered rate per target and mode; False without matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list[tuple[float, Measure]]] = {}
    for point in report.points:
        for m in [point.mock, *point.gateways]:
            series.setdefault(f"{point.mode} {m.target}", []).append((point.rate, m))
    for label, rows in series.items():
        rates = [r for r, _ in rows]
        left.plot(rates, [1000 * m.latency.p50 for _, m in rows], "o-", label=label)
        right.plot(rates, [m.achieved_per_s for _, m in rows], "o-", label=label)
    left.set(xlabel="offered requests/s", ylabel="latency p50 (ms)", yscale="log")
    right.set(xlabel="offered requests/s", ylabel="completed requests/s")
    for axis in (left, right):
        axis.grid(True)
        axis.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True
