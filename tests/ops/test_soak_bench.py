"""`python -m ops.bench.soak`: a short soak of the gated gateway on the simulator, its engine killed once."""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench.soak import IN_FLIGHT_GAUGES, checks, main, metric_sum


def test_a_short_soak_kills_the_engine_and_finds_everything_back_at_rest(tmp_path: Path) -> None:
    # 6 s of streams at 40/s, a fifth closed after a chunk or three, the engine killed halfway and restarted.
    args = ["--minutes", "0.1", "--rate", "40", "--kills", "1", "--cancel-fraction", "0.2"]
    code = main([*args, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "soak.json").read_text())
    by_name = {c["name"]: c for c in report["checks"]}
    # Memory growth over seconds says nothing (the run is all warm-up): only that RSS was read throughout.
    assert len(report["rss_mb"]) >= 5
    assert all(mb > 0 for _, mb in report["rss_mb"])
    for name in ("engine", "audit", "quota", "dead engines"):
        assert by_name[name]["ok"], by_name[name]
    assert by_name["dead engines"]["detail"] == "still referenced: 0 of 1"  # the kill happened
    load = report["load"]
    assert load["completed"] > 0
    assert load["closed"] > 0  # clients left mid-stream, and the gateway still ended at rest
    assert sum(load["by_status"].values()) == load["sent"]
    rest = report["metrics_at_rest"]
    # Every request past the door reserved once (a shed one never reaches the quota), each settled.
    assert 0 < rest["reservations"] <= load["sent"]
    assert code == (0 if by_name["memory"]["ok"] else 1)


def test_every_check_can_fail() -> None:
    rest = dict.fromkeys(IN_FLIGHT_GAUGES, 0.0) | {
        "reservations": 10.0,
        "settlements": 10.0,
        "settle_noops": 0.0,
        "settle_failures": 0.0,
    }
    rss = [(0.0, 100.0), (5.0, 100.0), (10.0, 104.0)]
    assert all(c.ok for c in checks(rss, 2.0, rest, 0, "0 of 2"))
    failed = checks(
        [(0.0, 100.0), (5.0, 100.0), (10.0, 106.0)],
        2.0,
        rest | {"lockgate:engine_in_flight": 2.0, "settlements": 9.0},
        3,
        "1 of 2",
    )
    assert not any(c.ok for c in failed)
    assert "lockgate:engine_in_flight 2" in failed[1].detail


def test_metric_sums_add_every_labelled_sample_of_a_name_only() -> None:
    text = "\n".join(
        [
            "# HELP lockgate:engine_in_flight x",
            'lockgate:engine_in_flight{replica="a",pool="p"} 2.0',
            'lockgate:engine_in_flight{replica="b",pool="p"} 1.0',
            "lockgate:engine_in_flight_other 7.0",
            "lockgate:quota_reservations_total 5.0",
        ]
    )
    assert metric_sum(text, "lockgate:engine_in_flight") == 3.0
    assert metric_sum(text, "lockgate:quota_reservations_total") == 5.0
    assert metric_sum(text, "lockgate:missing") == 0.0
