"""`python -m ops.bench.routes` on a small workload: the three targets in one run, with what follows from
the declared skills (quality and cost figures are printed, and compared only between targets of the run)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from ops.bench.routes import RoutesReport, main


def test_a_small_run_puts_the_cascade_between_cheap_and_strong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--requests", "40", "--concurrency", "4", "--out", str(tmp_path)]
    assert main(args) == 0
    with capsys.disabled():
        print(capsys.readouterr().out)
    report = msgspec.json.decode((tmp_path / "routes.json").read_bytes(), type=RoutesReport)
    cheap, strong, cascade = report.targets
    assert [t.requests for t in report.targets] == [40, 40, 40]
    # Only the route escalates; it pays for its escalations and no more than always-strong.
    assert cheap.escalated == strong.escalated == 0.0
    assert 0.0 < cascade.escalated < 1.0
    assert cheap.cost_per_request < cascade.cost_per_request < strong.cost_per_request
    # The same questions: the strong model is right more often, and escalating the unsure ones gains on the
    # cheap model's quality.
    assert cheap.quality < strong.quality
    assert cheap.quality < cascade.quality <= strong.quality
    assert (tmp_path / "routes.png").stat().st_size > 0
