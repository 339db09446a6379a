"""The audit trail benchmark runs end to end on both stores and prints every row (no timing assertions:
machines differ)."""

from __future__ import annotations

import os

import msgspec
import pytest

from ops.bench import audit


def test_bench_records_every_draft_on_both_stores(capsys: pytest.CaptureFixture[str]) -> None:
    allowed = os.sched_getaffinity(0)  # the bench pins this process: put it back as it was
    try:
        assert (
            audit.main(["--records", "300", "--batch-size", "64", "--core", str(min(allowed)), "--json"]) == 0
        )
    finally:
        os.sched_setaffinity(0, allowed)
    figures = msgspec.json.decode(capsys.readouterr().out, type=list[audit.Figure])
    assert [(f.store, f.way) for f in figures] == [
        (store, way) for store in ("sqlite", "postgres") for way in ("insert", "append", "writer")
    ]
    for figure in figures:
        assert figure.records == 300
        assert figure.seconds > 0
        assert figure.cpu_seconds >= 0


def test_table_compares_each_store_with_its_own_baseline() -> None:
    figures = [
        audit.Figure(store="sqlite", way="insert", records=100, seconds=0.01, cpu_seconds=0.001),
        audit.Figure(store="sqlite", way="append", records=100, seconds=0.02, cpu_seconds=0.004),
    ]
    rows = audit.table(figures).splitlines()[2:]
    assert rows[0].startswith("| sqlite | insert | 100 | 10,000 | 10.0 us | 1.00x |")
    assert rows[1].startswith("| sqlite | append | 100 | 5,000 | 40.0 us | 4.00x |")
