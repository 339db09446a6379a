"""`python -m ops.bench.workers --quick`: `lockgate serve --workers 1` and `--workers 2` (Redis quotas,
PostgreSQL) in the same run, a second of open-loop load per rate on each, and a well-formed report. Figures
are printed, never asserted."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from ops.bench.workers import WorkersReport, main


def test_a_quick_run_measures_one_and_two_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    with capsys.disabled():
        print(printed)

    report = msgspec.json.decode((tmp_path / "workers.json").read_bytes(), type=WorkersReport)
    assert {m.target for m in report.measures} == {"workers-1", "workers-2"}
    for measure in report.measures:
        assert measure.completed > 0, measure.error_sample
        assert measure.cpu_s > 0
    assert [s.workers for s in report.summaries] == [1, 2]
    assert report.summaries[0].scaling == 1.0
    assert "scaling" in printed
