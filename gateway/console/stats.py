"""The console's policy statistics: per policy version, decisions per hour (a flagged allow drawn as a flag,
not as an allow), how often reviewers overturned its blocks, and per guard stage its score histogram over the
window and its scores hour by hour (median, and the 10th to 90th percentile), drawn as inline SVG so that
drift (scores moving over time) and a threshold change (a second threshold line) are visible without any
script or external asset. Every chart says what it counts: its scale's top, its total, and on time axes the
UTC hours.

Bounded: at most `MAX_RECORDS` records of the last `WINDOW_S` seconds in the reviewer's scope are read
(`AuditStore.query` pages); the page says when that cut the window short.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from html import escape

import msgspec

from gateway.quantile import nearest_rank
from policy.audit.base import MAX_QUERY_LIMIT, AuditQuery, AuditStore
from policy.audit.records import AuditRecord

WINDOW_S = 48 * 3600.0
MAX_RECORDS = 5000
BINS = 20
_HOUR = 3600.0
# Decisions as the charts count them: an allow flagged for review counts as `flagged`.
_COLOURS = {
    "allow": "#3a9d5d", "flagged": "#e0a526", "flag": "#e0a526", "block": "#c8372d", "refuse": "#8e44ad",
    "deny": "#555e6b",
}  # fmt: skip
# A time axis is labelled every this many hours (UTC).
_TICK_HOURS = 6
# The decisions whose reviews give a policy version's overturn rate.
_BLOCKS = ("block", "refuse")


class StageScores(msgspec.Struct, kw_only=True):
    """One stage's scores (histogram bins over 0..1, and every score by hour) and the thresholds it ran
    with."""

    bins: list[int]
    allow_below: set[float]
    block_above: set[float]
    hourly: dict[int, list[float]] = msgspec.field(default_factory=dict)  # unix hour -> scores in it


class HourSpread(msgspec.Struct, frozen=True, kw_only=True):
    """One hour of a stage's scores: how many, their median and 10th and 90th percentiles."""

    n: int
    p10: float
    p50: float
    p90: float


def spread(scores: list[float]) -> HourSpread:
    """The spread of one hour's scores (nearest-rank percentiles; `scores` not empty)."""
    return HourSpread(
        n=len(scores),
        p10=nearest_rank(scores, 0.1),
        p50=nearest_rank(scores, 0.5),
        p90=nearest_rank(scores, 0.9),
    )


class PolicyStats(msgspec.Struct, kw_only=True):
    """One policy version's decisions by hour, the reviews of its decisions in the window (reversal and
    uphold records, by what they reviewed), and the score distribution of each of its stages."""

    hourly: dict[int, Counter[str]]  # hour index (unix hour) -> decision (flagged allows: "flagged") -> count
    stages: dict[str, StageScores]
    # (decision reviewed, review decision) -> count, e.g. ("block", "reversal"): a block overturned.
    reviews: Counter[tuple[str, str]] = msgspec.field(default_factory=Counter)

    def blocks(self) -> int:
        """Blocks and refusals in the window."""
        return sum(counts[d] for counts in self.hourly.values() for d in _BLOCKS)

    def overturned_blocks(self) -> tuple[int, int]:
        """(blocks reviewed, blocks overturned): the window's blocks and refusals that a review in the window
        upheld or overturned."""
        reviewed = sum(n for (what, _review), n in self.reviews.items() if what in _BLOCKS)
        overturned = sum(
            n for (what, review), n in self.reviews.items() if what in _BLOCKS and review == "reversal"
        )
        return reviewed, overturned


def charted(record: AuditRecord) -> str:
    """The decision a chart counts a record under: an allow flagged for review is a flag."""
    return "flagged" if record.flagged and record.decision == "allow" else record.decision


async def collect(store: AuditStore, scope: str | None, now: float) -> tuple[dict[str, PolicyStats], bool]:
    """The statistics of the gate's decisions (not review records) in scope over the window; and whether
    `MAX_RECORDS` cut it short."""
    q = AuditQuery(tenant=scope, since=now - WINDOW_S, limit=MAX_QUERY_LIMIT)
    stats: dict[str, PolicyStats] = {}
    # (tenant, seq) -> the decision as charted, for the reviews that follow (a review comes after what it
    # reviews in its tenant's chain, and the pages are in (tenant, seq) order).
    reviewed: dict[tuple[str, int], str] = {}
    read = 0
    while read < MAX_RECORDS:
        page = await store.query(q)
        for record in page[: MAX_RECORDS - read]:
            _add(stats, record, reviewed)
        read += len(page)
        if len(page) < q.page_size():
            return stats, False
        q = q.after(page[-1])
    return stats, True


def _add(stats: dict[str, PolicyStats], record: AuditRecord, reviewed: dict[tuple[str, int], str]) -> None:
    policy = stats.setdefault(record.policy or "(none)", PolicyStats(hourly={}, stages={}))
    if record.stage == "review":
        # A review record carries the reviewed decision's policy; what it reviewed was read earlier in the
        # same pass when it is in the window (a decision before the window: "earlier", not in the rate).
        what = reviewed.get((record.tenant, record.reverses or 0), "earlier")
        policy.reviews[(what, record.decision)] += 1
        return
    reviewed[(record.tenant, record.seq)] = charted(record)
    policy.hourly.setdefault(int(record.at // _HOUR), Counter())[charted(record)] += 1
    for run in record.stages:
        if run.score is None:
            continue
        scores = policy.stages.setdefault(
            run.stage, StageScores(bins=[0] * BINS, allow_below=set(), block_above=set())
        )
        clamped = min(max(run.score, 0.0), 1.0)
        scores.bins[min(int(clamped * BINS), BINS - 1)] += 1
        scores.hourly.setdefault(int(record.at // _HOUR), []).append(clamped)
        if run.allow_below is not None:
            scores.allow_below.add(run.allow_below)
        if run.block_above is not None:
            scores.block_above.add(run.block_above)


def _time_axis(hours: int, last: int, step: int, height: int) -> str:
    """Labels under a time axis of `hours` columns `step` px wide ending at unix hour `last`: the UTC hour
    every `_TICK_HOURS`, with the date at midnight."""
    parts = []
    for i in range(hours):
        hour = last - hours + 1 + i
        if hour % _TICK_HOURS:
            continue
        at = time.gmtime(hour * _HOUR)
        label = time.strftime("%d %b" if at.tm_hour == 0 else "%H:00", at)
        parts.append(
            f'<line x1="{i * step}" y1="{height}" x2="{i * step}" y2="{height + 4}" stroke="#555"/>'
            f'<text x="{i * step}" y="{height + 15}" font-size="10">{label}</text>'
        )
    return "".join(parts)


def hourly_svg(hourly: dict[int, Counter[str]], now: float) -> str:
    """Stacked bars: decisions per hour over the window, oldest left, coloured by decision (flagged allows
    as flags); the scale's top and the window's total written on it, the hours (UTC) under it."""
    hours = int(WINDOW_S // _HOUR)
    last = int(now // _HOUR)
    width, height, bar = hours * 12, 120, 10
    peak = max((sum(c.values()) for c in hourly.values()), default=0) or 1
    total = sum(sum(c.values()) for c in hourly.values())
    parts = [f'<svg class="hourly" width="{width + 60}" height="{height + 35}" role="img">']
    for i in range(hours):
        counts = hourly.get(last - hours + 1 + i, Counter())
        y = float(height)
        for decision in sorted(counts):
            h = counts[decision] / peak * height
            y -= h
            colour = _COLOURS.get(decision, "#999")
            parts.append(
                f'<rect x="{i * 12}" y="{y:.1f}" width="{bar}" height="{h:.1f}" fill="{colour}">'
                f"<title>{escape(decision)}: {counts[decision]}</title></rect>"
            )
    parts.append(
        f'<text x="{width + 4}" y="10" font-size="10">{peak}/h</text>'
        f'<text x="{width + 4}" y="{height}" font-size="10">0</text>'
        f'<text class="total" x="0" y="{height + 30}" font-size="10">{total} decisions, hours in UTC</text>'
    )
    parts.append(_time_axis(hours, last, 12, height) + "</svg>")
    return "".join(parts)


def histogram_svg(scores: StageScores) -> str:
    """Score histogram over 0..1 with a line at each threshold the stage ran with (two lines of one kind:
    the threshold changed in the window)."""
    width, height = BINS * 16, 100
    peak = max(scores.bins) or 1
    parts = [f'<svg class="histogram" width="{width + 60}" height="{height + 35}" role="img">']
    for i, n in enumerate(scores.bins):
        h = n / peak * height
        lo = i / BINS
        parts.append(
            f'<rect x="{i * 16}" y="{height - h:.1f}" width="14" height="{h:.1f}" fill="#2a6fdb">'
            f"<title>{lo:.2f}-{lo + 1 / BINS:.2f}: {n}</title></rect>"
        )
    for values, colour, label in ((scores.allow_below, "#3a9d5d", "allow below"),
                                  (scores.block_above, "#c8372d", "block above")):  # fmt: skip
        for value in sorted(v for v in values if math.isfinite(v)):
            x = min(max(value, 0.0), 1.0) * width
            parts.append(
                f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{height}" stroke="{colour}" stroke-width="2">'
                f"<title>{label} {value}</title></line>"
            )
    parts.append(f'<text x="0" y="{height + 15}" font-size="10">0</text>')
    parts.append(f'<text x="{width - 10}" y="{height + 15}" font-size="10">1</text>')
    parts.append(
        f'<text x="{width + 4}" y="10" font-size="10">{peak}</text>'
        f'<text x="{width + 4}" y="{height}" font-size="10">0</text>'
        f'<text class="total" x="0" y="{height + 30}" font-size="10">{sum(scores.bins)} scores</text></svg>'
    )
    return "".join(parts)


def drift_svg(hourly: dict[int, list[float]], now: float) -> str:
    """A stage's scores hour by hour over the window, oldest left: a bar from the 10th to the 90th
    percentile and a dot at the median, on a 0..1 scale (an hour with no score is left empty)."""
    hours = int(WINDOW_S // _HOUR)
    last = int(now // _HOUR)
    width, height = hours * 12, 100
    parts = [f'<svg class="drift" width="{width + 60}" height="{height + 35}" role="img">']
    for i in range(hours):
        scores = hourly.get(last - hours + 1 + i)
        if not scores:
            continue
        s = spread(scores)
        x = i * 12 + 5
        top, bottom, mid = ((1 - v) * height for v in (s.p90, s.p10, s.p50))
        title = f"<title>n {s.n}: median {s.p50:.3f}, 10-90% {s.p10:.3f}-{s.p90:.3f}</title>"
        parts.append(
            f'<line x1="{x}" y1="{top:.1f}" x2="{x}" y2="{bottom:.1f}" stroke="#9bb7e0" stroke-width="6">'
            f"{title}</line>"
            f'<circle cx="{x}" cy="{mid:.1f}" r="3" fill="#2a6fdb">{title}</circle>'
        )
    counted = sum(len(v) for v in hourly.values())
    parts.append(
        f'<text x="{width + 4}" y="10" font-size="10">score 1</text>'
        f'<text x="{width + 4}" y="{height}" font-size="10">score 0</text>'
        f'<text class="total" x="0" y="{height + 30}" font-size="10">{counted} scores, hours in UTC</text>'
    )
    parts.append(_time_axis(hours, last, 12, height) + "</svg>")
    return "".join(parts)


def stats_body(stats: dict[str, PolicyStats], now: float, truncated: bool) -> str:
    """The statistics page's body, one section per policy version."""
    hours = int(WINDOW_S // _HOUR)
    head = f"<p>Decisions of the last {hours} hours in your scope"
    head += f" (only the first {MAX_RECORDS} records were read).</p>" if truncated else ".</p>"
    legend = " ".join(
        f'<span style="color:{colour}">■ {escape(name)}</span>' for name, colour in _COLOURS.items()
    )
    sections = [head, f"<p>{legend}</p>"]
    for name in sorted(stats):
        policy = stats[name]
        total = Counter[str]()
        for counts in policy.hourly.values():
            total.update(counts)
        summary = ", ".join(f"{escape(d)} {n}" for d, n in sorted(total.items()))
        reviewed, overturned = policy.overturned_blocks()
        rate = f"{overturned / reviewed:.0%}" if reviewed else "none reviewed"
        appeals = (
            f'<p class="overturns">Blocks and refusals: {policy.blocks()}; reviewed: {reviewed}, '
            f"overturned: {overturned} ({rate} of those reviewed)</p>"
        )
        sections.append(
            f'<section class="policy"><h2>{escape(name)}</h2><p>{summary}</p>{appeals}'
            f"<h3>Decisions per hour</h3>{hourly_svg(policy.hourly, now)}"
        )
        for stage in sorted(policy.stages):
            scores = policy.stages[stage]
            thresholds = f"allow below {sorted(scores.allow_below)}, block above {sorted(scores.block_above)}"
            sections.append(
                f"<h3>Scores of {escape(stage)}</h3><p>{escape(thresholds)}</p>{histogram_svg(scores)}"
                f"<p>By hour (median, 10th-90th percentile):</p>{drift_svg(scores.hourly, now)}"
            )
        sections.append("</section>")
    if not stats:
        sections.append("<p>No decisions in this window.</p>")
    return "".join(sections)
