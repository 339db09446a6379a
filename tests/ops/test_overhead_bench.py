"""`python -m ops.bench.overhead --quick`: the mock OpenAI server and `lockgate serve` (memory quota store) in
child processes, a second of open-loop load per rate and mode on each, and a well-formed report with both
targets measured. Figures are printed, never asserted."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from ops.bench._overhead_report import OverheadReport
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
    assert (tmp_path / "overhead.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
