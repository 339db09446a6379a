"""`python -m ops.bench.asgi_cost`: chat requests driven into the gateway's ASGI app, whole and streamed, all
answered 200, and the CPU per request printed (never asserted)."""

from __future__ import annotations

import pstats
import re
from pathlib import Path

import pytest

from ops.bench.asgi_cost import main


@pytest.mark.parametrize(
    ("mode", "quota"), [("whole", "memory"), ("stream", "memory"), ("whole", "redis-lease")]
)
def test_a_short_run_prints_the_cpu_per_request(
    mode: str, quota: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every request answered 200 (main raises otherwise): with `redis-lease`, granted from quota leases.
    assert main(["--mode", mode, "--quota", quota, "--requests", "150"]) == 0
    printed = capsys.readouterr().out
    with capsys.disabled():
        print(printed)
    line = re.search(
        rf"^{mode}, {quota} quotas, guard none, log level warning, 150 requests: (\d+) us CPU per request "
        r"\(100-request batches: fastest (\d+) us, median (\d+) us\)$",
        printed,
        re.MULTILINE,
    )
    assert line is not None, printed
    assert all(int(figure) > 0 for figure in line.groups())


def test_the_mock_server_is_driven_the_same_way(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--server", "mock", "--max-tokens", "4", "--requests", "100"]) == 0
    printed = capsys.readouterr().out
    line = re.search(r"^whole, mock server, 100 requests: (\d+) us CPU per request", printed, re.MULTILINE)
    assert line is not None, printed
    assert int(line.group(1)) > 0


def test_the_gate_is_measured_and_profiled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # With the rules stage on every request, its checks (and their audit records) are in the measured part.
    profile = tmp_path / "rules.prof"
    assert main(["--guard", "rules", "--requests", "100", "--profile", str(profile)]) == 0
    printed = capsys.readouterr().out
    assert re.search(
        r"^whole, memory quotas, guard rules, log level warning, 100 requests: \d+ us", printed, re.M
    )
    functions = {name for _, _, name in pstats.Stats(str(profile)).stats}  # type: ignore[attr-defined]
    assert "score_sync" in functions
