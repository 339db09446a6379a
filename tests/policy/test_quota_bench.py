"""The quota benchmark runs end to end and prints every row (no timing assertions: machines differ)."""

from __future__ import annotations

import re

import pytest

from ops.bench import quota

NAMES = (
    "redis INCR (baseline)",
    "memory reserve+reconcile",
    "redis reserve+reconcile",
    "leased reserve+reconcile",
)


def test_bench_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert quota.main(["--seconds", "0.2", "--concurrency", "4"]) == 0
    table, summary = capsys.readouterr().out.split("\n\n")
    rows = table.splitlines()[2:]  # After the title and the column header.
    # Name, then the clients column: sequential (1) and concurrent (4) for every backend.
    assert [(row[:26].strip(), row[26:].split()[0]) for row in rows] == [
        (name, clients) for name in NAMES for clients in ("1", "4")
    ]
    expected = [f"{re.escape(name)} \\({clients} clients\\)" for name in NAMES[1:] for clients in ("1", "4")]
    lines = summary.splitlines()
    assert len(lines) == len(expected)
    for line, start in zip(lines, expected, strict=True):
        assert re.fullmatch(start + r" p99 = \d+\.\d\dx INCR p99", line), line


def test_bench_refuses_a_remote_redis() -> None:
    with pytest.raises(SystemExit):
        quota.main(["--host", "10.0.0.1"])
