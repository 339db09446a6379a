"""`python -m ops.bench.overhead --quick`: the mock OpenAI server and `lockgate serve` (memory quota store) in
child processes, a second of open-loop load per rate and mode on each, and a well-formed report with both
targets measured. Figures are printed, never asserted."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from ops.bench._overhead_report import (
    Latency,
    Measure,
    OverheadReport,
    OverloadMeasure,
    Point,
    gate_costs,
    onset_bins,
)
from ops.bench.overhead import main


def test_a_quick_run_measures_the_mock_and_the_gateway(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    with capsys.disabled():
        print(printed)

    report = msgspec.json.decode((tmp_path / "overhead.json").read_bytes(), type=OverheadReport)
    assert {p.mode for p in report.points} == {"whole", "stream"}
    for point in report.points:
        assert point.mock.target == "mock"
        assert [g.target for g in point.gateways] == ["memory"]
        for measure in (point.mock, *point.gateways):
            assert measure.sent > 0
            assert measure.completed > 0, measure.error_sample
            assert measure.latency.p50 > 0
            assert measure.cpu_s > 0
            if point.mode == "stream":
                assert measure.chunks >= measure.completed
                assert measure.first_chunk is not None
                assert measure.cpu_per_chunk_us is not None
    assert {(s.mode, s.quota) for s in report.summaries} == {("whole", "memory"), ("stream", "memory")}
    stream = next(s for s in report.summaries if s.mode == "stream")
    assert stream.marginal_cpu_per_chunk_us is not None
    assert "added p50" in printed
    # Its log was read for decisions the audit trail could not take: none at these rates.
    assert report.unrecorded == {"memory": 0}
    assert (tmp_path / "overhead.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_onset_is_sliced_by_send_time_with_the_slowest_of_each_kind() -> None:
    sent = [
        (0.00, 200, 0.010),
        (0.04, 200, 0.090),  # queued at the jump
        (0.04, 503, 0.002),
        (0.06, 503, 0.004),
        (0.07, 200, None),  # timed out: no total
        (0.08, 0, None),  # transport failure
        (0.12, 200, 0.003),  # past the span
    ]
    first, second = onset_bins(sent, width=0.05, span=0.1)
    assert (first.start_s, first.admitted, first.shed) == (0.0, 2, 1)
    assert (first.admitted_max, first.shed_max) == (0.090, 0.002)
    assert (second.start_s, second.admitted, second.shed) == (0.05, 0, 1)
    assert (second.admitted_max, second.shed_max) == (None, 0.004)
    measure = OverloadMeasure(
        target="memory",
        offered_per_s=100.0,
        sent=len(sent),
        admitted=3,
        shed=2,
        other=2,
        admitted_latency=Latency(p50=0.01, p99=0.09),
        shed_latency=Latency(p50=0.002, p99=0.004),
        steady_after_s=1.0,
        steady_admitted_latency=Latency(p50=0.0, p99=0.0),
        steady_shed_latency=Latency(p50=0.0, p99=0.0),
        mock=Measure(
            target="mock",
            offered_per_s=100.0,
            sent=7,
            completed=7,
            errors=0,
            achieved_per_s=100.0,
            latency=Latency(p50=0.001, p99=0.002),
            first_chunk=None,
            chunks=0,
            cpu_s=0.01,
            cpu_per_request_ms=0.1,
            cpu_per_chunk_us=None,
            client_lag_p99_ms=0.1,
            saturated=False,
        ),
        onset=[first, second],
    )
    assert (
        "in the first 0.1 s: slowest admitted 90.0 ms (sent 0 ms in), slowest shed 4.0 ms (sent 50 ms in)"
        in (measure.brief())
    )


def _measure(
    target: str, *, p50_ms: float, cpu_ms: float, chunks: int = 0, saturated: bool = False
) -> Measure:
    completed = 100
    return Measure(
        target=target,
        offered_per_s=100.0,
        sent=completed,
        completed=completed,
        errors=0,
        achieved_per_s=100.0,
        latency=Latency(p50=p50_ms / 1000, p99=2 * p50_ms / 1000),
        first_chunk=None,
        chunks=chunks,
        cpu_s=cpu_ms * completed / 1000,
        cpu_per_request_ms=cpu_ms,
        cpu_per_chunk_us=1000 * cpu_ms * completed / chunks if chunks else None,
        client_lag_p99_ms=0.1,
        saturated=saturated,
    )


def test_a_gated_gateway_is_compared_with_its_twin_at_the_same_rate() -> None:
    mock = _measure("mock", p50_ms=1.0, cpu_ms=0.2)

    def point(rate: float, none: Measure, rules: Measure) -> Point:
        return Point(mode="stream", rate=rate, mock=mock, gateways=[none, rules])

    points = [
        point(
            100.0,
            _measure("memory/none", p50_ms=2.0, cpu_ms=0.8, chunks=1600),
            _measure("memory/rules", p50_ms=2.5, cpu_ms=1.2, chunks=1600),
        ),
        point(
            200.0,
            _measure("memory/none", p50_ms=2.0, cpu_ms=0.6, chunks=1600),
            # Held back for its checks: the same tokens in fewer chunks.
            _measure("memory/rules", p50_ms=2.5, cpu_ms=0.9, chunks=200),
        ),
        # Saturated: not where the CPU is compared.
        point(
            400.0,
            _measure("memory/none", p50_ms=2.0, cpu_ms=0.5, chunks=1600),
            _measure("memory/rules", p50_ms=90.0, cpu_ms=0.7, chunks=1600, saturated=True),
        ),
    ]
    (cost,) = gate_costs(points, {"memory/rules": "memory/none"})
    assert (cost.mode, cost.target, cost.baseline, cost.cpu_rate) == (
        "stream",
        "memory/rules",
        "memory/none",
        200,
    )
    assert cost.cpu_ratio == pytest.approx(1.5)
    # 0.3 ms more per stream of 16 chunks.
    assert cost.cpu_per_chunk_beyond_us == pytest.approx(300 / 16)
    assert cost.rate == 100
    assert (cost.added_p50_ms, cost.added_p99_ms) == pytest.approx((0.5, 1.0))
