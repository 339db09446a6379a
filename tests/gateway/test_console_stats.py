"""The console's policy statistics (`gateway.console.stats`): a stage's live scores over time, hour by hour,
so drift shows as the median moving, read from the audit trail in the reviewer's scope."""

from __future__ import annotations

from typing import cast

from gateway.console.stats import WINDOW_S, collect, drift_svg, hourly_svg, spread, stats_body
from policy.audit.base import AuditQuery, AuditStore
from policy.audit.records import AuditedStage, AuditRecord, Decision

HOUR = 3600.0
NOW = 1_000 * HOUR + 1800.0


class _Store:
    """Only what `collect` reads: `query`, filtered by tenant and time, paged by seq."""

    def __init__(self, records: list[AuditRecord]) -> None:
        self.records = records

    async def query(self, q: AuditQuery) -> list[AuditRecord]:
        found = [
            r
            for r in self.records
            if (q.tenant is None or r.tenant == q.tenant)
            and (q.since is None or r.at >= q.since)
            and (r.tenant, r.seq) > (q.after_tenant or "", q.after_seq)
        ]
        return found[: q.page_size()]


def _record(seq: int, at: float, score: float, tenant: str = "acme") -> AuditRecord:
    run = AuditedStage(stage="ngram@1", kind="model", score=score, allow_below=0.3, block_above=0.9)
    return AuditRecord(
        tenant=tenant, key_id="k", request_id=f"r{seq}", at=at, stage="input", decision="allow",
        source="model", policy="default@1", stages=(run,), seq=seq, prev_hash="", hash="",
    )  # fmt: skip


def test_spread_is_nearest_rank() -> None:
    assert spread([0.5]).p50 == spread([0.5, 0.5]).p50 == 0.5
    s = spread([i / 10 for i in range(10, 0, -1)])  # 1.0 .. 0.1, unordered input
    assert (s.n, s.p10, s.p50, s.p90) == (10, 0.1, 0.5, 0.9)


async def test_scores_are_kept_by_hour_so_drift_shows_and_other_tenants_do_not() -> None:
    early, late = NOW - 5 * HOUR, NOW - HOUR
    records = [_record(i + 1, early + i, 0.1 + i / 100) for i in range(10)]
    records += [_record(i + 11, late + i, 0.8 + i / 100) for i in range(10)]
    records += [_record(1, late, 0.99, tenant="other")]
    records += [_record(21, NOW - WINDOW_S - HOUR, 0.5)]  # before the window: not read
    store = cast(AuditStore, _Store(sorted(records, key=lambda r: (r.tenant, r.seq))))
    stats, truncated = await collect(store, "acme", NOW)
    assert not truncated
    hourly = stats["default@1"].stages["ngram@1"].hourly
    assert sorted(hourly) == [int(early // HOUR), int(late // HOUR)]
    before, after = spread(hourly[int(early // HOUR)]), spread(hourly[int(late // HOUR)])
    assert (before.n, after.n) == (10, 10)
    assert before.p50 < 0.2 < 0.8 < after.p50  # the stage's scores moved up: drift, visible by hour
    svg = drift_svg(hourly, NOW)
    assert svg.count("<circle") == 2  # two hours with scores; empty hours draw nothing
    assert f"median {after.p50:.3f}" in svg
    page = stats_body(stats, NOW, truncated)
    assert "By hour (median, 10th-90th percentile)" in page
    assert "0.990" not in page  # the other tenant's score is not in this reviewer's scope


def test_an_empty_window_draws_an_empty_chart() -> None:
    svg = drift_svg({}, NOW)
    assert "<circle" not in svg
    assert svg.endswith("</svg>")


def _decision(
    seq: int, at: float, decision: Decision, *, flagged: bool = False, reverses: int | None = None
) -> AuditRecord:
    return AuditRecord(
        tenant="acme", key_id="k", request_id=f"d{seq}", at=at, stage="review" if reverses else "input",
        decision=decision, source="reviewer" if reverses else "rules", policy="strict@2", flagged=flagged,
        reverses=reverses, seq=seq, prev_hash="", hash="",
    )  # fmt: skip


async def test_flags_are_drawn_as_flags_and_each_version_shows_the_overturn_rate_of_its_blocks() -> None:
    at = NOW - 2 * HOUR
    records = [
        _decision(1, at, "allow"),
        _decision(2, at, "allow", flagged=True),
        _decision(3, at, "allow", flagged=True),
        _decision(4, at, "block"),
        _decision(5, at, "block"),
        _decision(6, at, "refuse"),
        _decision(7, at + 10, "reversal", reverses=4),  # a block overturned
        _decision(8, at + 11, "uphold", reverses=5),  # a block upheld
        _decision(9, at + 12, "reversal", reverses=2),  # a flag overturned: not a block's
    ]
    store = cast(AuditStore, _Store(records))
    stats, _truncated = await collect(store, "acme", NOW)
    policy = stats["strict@2"]
    [hour] = policy.hourly.values()
    assert hour == {"allow": 1, "flagged": 2, "block": 2, "refuse": 1}  # reviews are not decisions
    assert policy.blocks() == 3
    assert policy.overturned_blocks() == (2, 1)
    page = stats_body(stats, NOW, False)
    assert "flagged 2" in page
    assert "Blocks and refusals: 3; reviewed: 2, overturned: 1 (50% of those reviewed)" in page
    svg = hourly_svg(policy.hourly, NOW)
    assert "<title>flagged: 2</title>" in svg
    assert ">6 decisions, hours in UTC<" in svg  # the total, on the chart
    assert ">6/h<" in svg  # the scale's top
    # The time axis is labelled with UTC hours every few hours, the date at midnight.
    assert svg.count('font-size="10">') >= WINDOW_S // HOUR // 6
    assert ":00<" in svg
