"""The load generator's parts without a server: arrivals, the plan, workload files, the timed client on a
mock transport with a scripted clock, and the report's figures on hand-made samples (exact values)."""

from __future__ import annotations

import itertools
import random
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import httpx
import msgspec
import pytest

import ops.bench.load as load
from ops.bench.load import (
    Arrival,
    Sample,
    Tenant,
    Uniform,
    Workload,
    WorkloadError,
    arrival_times,
    build_report,
    decode_workload,
    load_workload,
    make_plan,
    percentile,
    send,
    summarize,
)
from ops.bench.load.client import request_body
from ops.bench.load.plan import Planned
from ops.bench.load.report import encode
from ops.bench.load.run import chat_url
from ops.bench.load.workload import with_overrides

# Arrival statistics


def _dispersion(times: list[float], seconds: int) -> float:
    """Variance over mean of the arrivals per second: about 1 for Poisson, about the burst size for bursts."""
    counts = Counter(int(t) for t in times)
    per_second = [counts[i] for i in range(seconds)]
    return statistics.pvariance(per_second) / statistics.mean(per_second)


def test_poisson_arrivals_over_a_long_virtual_period() -> None:
    times = arrival_times(Arrival(rate=10.0), random.Random(1), duration=1000.0)
    # 10,000 expected, standard deviation 100: 5% is five of them.
    assert 9500 <= len(times) <= 10500
    assert times == sorted(times)
    assert times[0] > 0
    assert times[-1] < 1000.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    # Exponential gaps: standard deviation equal to the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.1, rel=0.1)
    assert 0.8 < _dispersion(times, 1000) < 1.2


def test_bursty_arrivals_come_in_bursts_at_the_same_mean_rate() -> None:
    arrival = Arrival(process="bursty", rate=10.0, burst_size=10, burst_spread=0.1)
    times = arrival_times(arrival, random.Random(2), duration=1000.0)
    # 1,000 bursts of 10 expected (standard deviation about 32 bursts).
    assert 8500 <= len(times) <= 11500
    assert times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Nine of every ten gaps are inside a burst (0.01 s apart, unless bursts overlap).
    inside = sum(gap <= 0.01 + 1e-9 for gap in gaps) / len(gaps)
    assert inside >= 0.85
    assert _dispersion(times, 1000) > 4


def test_arrivals_by_count_and_seed() -> None:
    arrival = Arrival(process="bursty", rate=50.0, burst_size=4, burst_spread=0.5)
    first = arrival_times(arrival, random.Random(3), count=37)
    assert len(first) == 37
    assert first == sorted(first)
    assert first == arrival_times(arrival, random.Random(3), count=37)
    assert first != arrival_times(arrival, random.Random(4), count=37)
    # Overlapping bursts: the first 37 of a longer list are the same arrivals.
    assert first == arrival_times(arrival, random.Random(3), count=200)[:37]
    with pytest.raises(ValueError, match="count or a duration"):
        arrival_times(arrival, random.Random(3))


# The plan


def _workload(**fields: object) -> Workload:
    tenants = [
        {"name": "chat", "api_key": "k1", "weight": 3},
        {
            "name": "jobs",
            "api_key": "k2",
            "weight": 1,
            "priority": "batch",
            "output_tokens": {"kind": "fixed", "value": 900},
        },
    ]
    return decode_workload({"tenants": tenants, **fields})


def test_the_plan_follows_weights_cancellations_and_lengths() -> None:
    workload = _workload(
        requests=4000,
        cancel_fraction=0.25,
        prompt_tokens={"kind": "lognormal", "median": 1000, "sigma": 0.5, "low": 10, "high": 3000},
        output_tokens={"kind": "uniform", "low": 5, "high": 50},
        cancel_after={"kind": "fixed", "value": 3},
        seed=7,
    )
    plan = make_plan(workload)
    assert len(plan) == 4000
    assert plan == make_plan(workload)
    assert [p.index for p in plan] == list(range(4000))
    share = Counter(p.tenant for p in plan)
    assert share["chat"] / 4000 == pytest.approx(0.75, abs=0.03)
    assert {p.priority for p in plan if p.tenant == "jobs"} == {"batch"}
    assert {p.max_tokens for p in plan if p.tenant == "jobs"} == {900}
    assert all(5 <= p.max_tokens <= 50 for p in plan if p.tenant == "chat")
    cancelled = [p for p in plan if p.cancel_after is not None]
    assert len(cancelled) / 4000 == pytest.approx(0.25, abs=0.03)
    assert {p.cancel_after for p in cancelled} == {3}
    words = sorted(p.prompt_words for p in plan)
    assert words[0] >= 10
    assert words[-1] <= 3000
    assert percentile([float(w) for w in words], 50) == pytest.approx(1000, rel=0.1)


def test_prompts_have_about_the_length_and_unique_prefixes() -> None:
    plan = make_plan(_workload(requests=50, prompt_tokens={"kind": "fixed", "value": 40}))
    prompts = [p.prompt() for p in plan]
    assert all(len(text.split()) == 40 for text in prompts)
    assert len({text.split()[0] for text in prompts}) == 50
    assert plan[3].prompt() == prompts[3]


def test_a_workload_without_tenants_cannot_be_planned() -> None:
    with pytest.raises(ValueError, match="no tenants"):
        make_plan(Workload())


# Workload files

WORKLOAD_TOML = """
model = "m"
duration = 30
prompt_tokens = {kind = "lognormal", median = 1500, sigma = 0.5, high = 6000}
output_tokens = {kind = "uniform", low = 64, high = 512}
cancel_fraction = 0.1

[arrival]
process = "bursty"
rate = 8.0
burst_size = 5

[[tenants]]
name = "chat"
api_key = "lg-one"
weight = 3

[[tenants]]
name = "jobs"
api_key = "lg-two"
priority = "batch"

[slo.batch]
ttft = 20
itl = 1.5
"""


def test_a_workload_file_decodes(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text(WORKLOAD_TOML)
    workload = load_workload(path)
    assert workload.arrival == Arrival(process="bursty", rate=8.0, burst_size=5)
    assert workload.limit() == (None, 30.0)
    assert workload.output_tokens == Uniform(low=64, high=512)
    assert [t.name for t in workload.tenants] == ["chat", "jobs"]
    assert workload.tenants[1].priority == "batch"
    assert workload.slo_of("batch").ttft == 20
    # A class the file leaves out keeps its defaults.
    assert workload.slo_of("interactive").ttft == 1.0


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ({"arrival": {"rate": "fast"}}, "$.arrival.rate"),
        ({"arrival": {"rate": 0}}, "$.arrival.rate"),
        ({"arrival": {"burst": 3}}, "unknown field `burst` - at `$.arrival`"),
        ({"tenants": [{"name": "a"}]}, "`api_key` - at `$.tenants[0]`"),
        ({"prompt_tokens": {"kind": "uniform", "low": 9, "high": 2}}, "$.prompt_tokens"),
        ({"output_tokens": {"kind": "gaussian"}}, "$.output_tokens.kind"),
        ({"cancel_fraction": 1.5}, "$.cancel_fraction"),
        ({"slo": {"gold": {"ttft": 1, "itl": 1}}}, "$.slo"),
        ({"requests": 5, "duration": 5}, "requests or duration"),
    ],
)
def test_workload_errors_name_the_field(raw: dict[str, object], where: str) -> None:
    with pytest.raises(WorkloadError, match=re.escape(where)):
        decode_workload(raw)


def test_a_broken_file_is_a_workload_error(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text("rate = = 3")
    with pytest.raises(WorkloadError, match=r"w\.toml"):
        load_workload(path)


def test_options_override_the_file() -> None:
    workload = _workload(requests=10, arrival={"process": "bursty", "rate": 2.0})
    changed = with_overrides(workload, rate=40.0, duration=5.0, seed=None, process="poisson")
    assert changed.arrival == Arrival(process="poisson", rate=40.0)
    assert changed.limit() == (None, 5.0)
    assert changed.tenants == workload.tenants
    one = with_overrides(workload, tenants=[Tenant(name="solo", api_key="k")])
    assert [t.name for t in one.tenants] == ["solo"]
    with pytest.raises(WorkloadError, match=r"\$.cancel_fraction"):
        with_overrides(workload, cancel_fraction=-1.0)


# The client, on a mock transport, with a clock that advances one step per reading


def _clock(step: float) -> Callable[[], float]:
    ticks: Iterator[float] = (i * step for i in range(1_000_000))
    return lambda: next(ticks)


def _planned(cancel_after: int | None = None) -> Planned:
    return Planned(
        index=0,
        at=0.0,
        tenant="chat",
        api_key="key",
        priority="batch",
        prompt_words=5,
        prompt_seed=1,
        max_tokens=8,
        cancel_after=cancel_after,
    )


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


ROLE = '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
TOKEN = '{"choices":[{"index":0,"delta":{"content":"ab"}}]}'
USAGE = '{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":3,"total_tokens":14}}'


async def _send(response: httpx.Response, cancel_after: int | None = None) -> tuple[Sample, httpx.Request]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return response

    planned = _planned(cancel_after)
    body = request_body(planned, "m", {"ignore_eos": True})
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        sample = await send(http, "http://x/v1/chat/completions", planned, body, _clock(0.5), origin=-1.0)
    return sample, seen[0]


async def test_a_stream_is_timed_per_chunk_with_text() -> None:
    sample, request = await _send(
        httpx.Response(200, content=_sse(ROLE, TOKEN, TOKEN, TOKEN, USAGE, "[DONE]"))
    )
    assert request.headers["authorization"] == "Bearer key"
    assert request.headers["x-lockgate-priority"] == "batch"
    body = msgspec.json.decode(request.content)
    assert body["stream_options"] == {"include_usage": True}
    assert (body["stream"], body["max_tokens"], body["ignore_eos"], body["model"]) == (True, 8, True, "m")
    # Clock readings: send 0.0, three tokens 0.5/1.0/1.5, [DONE] 2.0; the run started at -1.0.
    assert sample.status == "completed"
    assert (sample.sent, sample.ttft, sample.itl, sample.e2e) == (1.0, 0.5, (0.5, 0.5), 2.0)
    assert sample.chunks == 3
    assert (sample.prompt_tokens, sample.completion_tokens) == (11, 3)


async def test_a_planned_cancellation_closes_the_stream_after_its_chunks() -> None:
    sample, _ = await _send(httpx.Response(200, content=_sse(ROLE, TOKEN, TOKEN, TOKEN, "[DONE]")), 2)
    assert sample.status == "cancelled"
    assert (sample.ttft, sample.itl, sample.chunks, sample.e2e) == (0.5, (0.5,), 2, None)


@pytest.mark.parametrize(
    ("response", "status", "code"),
    [
        (
            httpx.Response(429, json={"error": {"message": "full", "code": "queue_full"}}),
            "rejected",
            "queue_full",
        ),
        (
            httpx.Response(504, json={"error": {"message": "late", "code": "deadline_expired"}}),
            "rejected",
            "deadline_expired",
        ),
        (
            httpx.Response(401, json={"error": {"message": "who", "code": "invalid_api_key"}}),
            "error",
            "invalid_api_key",
        ),
        (httpx.Response(502, text="bad gateway"), "error", None),
        (
            httpx.Response(200, content=_sse(TOKEN, '{"error":{"message":"boom","code":"engine_error"}}')),
            "error",
            "engine_error",
        ),
        (httpx.Response(200, content=_sse(TOKEN, TOKEN)), "error", "truncated"),
        (httpx.Response(200, content=_sse("{not json")), "error", "bad_chunk"),
    ],
)
async def test_refusals_and_failures_are_classified(
    response: httpx.Response, status: str, code: str | None
) -> None:
    sample, _ = await _send(response)
    assert (sample.status, sample.http_status, sample.code) == (status, response.status_code, code)


async def test_a_transport_failure_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    planned = _planned()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        sample = await send(http, "http://x/v1/chat/completions", planned, b"{}", _clock(1.0), origin=0.0)
    assert (sample.status, sample.code, sample.http_status) == ("error", "ConnectError", None)


def test_the_chat_url_takes_a_base_with_or_without_v1() -> None:
    assert chat_url("http://h:1") == chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"


# The report's figures


def test_percentiles_interpolate_between_ranks() -> None:
    values = [float(v) for v in range(10, 0, -1)]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([3.0], 99) == 3.0


def _sample(index: int, priority: str, status: str, **fields: object) -> Sample:
    return msgspec.convert(
        {
            "index": index,
            "tenant": f"t-{priority}",
            "priority": priority,
            "scheduled": index * 0.1,
            "sent": index * 0.1,
            "status": status,
            **fields,
        },
        Sample,
    )


SAMPLES = [
    # Interactive targets: TTFT <= 1.0 s, mean ITL <= 0.1 s.
    _sample(0, "interactive", "completed", ttft=0.5, itl=[0.05, 0.15], e2e=0.7),  # mean ITL 0.1: met
    _sample(1, "interactive", "completed", ttft=2.0, itl=[0.01], e2e=2.01),  # TTFT too long
    _sample(2, "interactive", "completed", ttft=0.2, itl=[0.3], e2e=0.5),  # ITL too long
    _sample(3, "interactive", "cancelled", ttft=0.1, itl=[0.02]),
    _sample(4, "interactive", "rejected", http_status=429, code="queue_full"),
    # Batch targets (from the workload below): TTFT <= 10 s, mean ITL <= 0.5 s.
    _sample(5, "batch", "completed", ttft=4.0, itl=[0.4, 0.4, 0.4], e2e=5.2),  # met
    _sample(6, "batch", "error", http_status=200, code="engine_error", ttft=1.0),
    _sample(7, "batch", "rejected", http_status=503, code="deadline_unmeetable"),
    _sample(8, "batch", "rejected", http_status=429, code="queue_full"),
]


def test_summary_counts_goodput_and_attainment_exactly() -> None:
    workload = _workload()
    overall = summarize(SAMPLES, workload, duration_s=4.0)
    assert (overall.sent, overall.completed, overall.cancelled, overall.rejected, overall.errors) == (
        9,
        4,
        1,
        3,
        1,
    )
    assert overall.slo_met == 2
    assert overall.slo_attainment == pytest.approx(2 / 8)  # the cancelled request is not judged
    assert overall.goodput_per_s == pytest.approx(0.5)
    # TTFT of everything that streamed: 0.1 0.2 0.5 1.0 2.0 4.0.
    assert overall.ttft.count == 6
    assert overall.ttft.p50 == pytest.approx(0.75)
    assert overall.ttft.p90 == pytest.approx(3.0)
    assert overall.ttft.mean == pytest.approx(7.8 / 6)
    assert overall.itl.count == 8
    assert overall.e2e.count == 4
    assert overall.e2e.p50 == pytest.approx((0.7 + 2.01) / 2)

    report = build_report(SAMPLES, workload, target="http://x", started_at=0.0, duration_s=4.0)
    interactive, batch = report.classes["interactive"], report.classes["batch"]
    assert (interactive.sent, interactive.slo_met, interactive.slo_attainment) == (5, 1, 0.25)
    assert interactive.goodput_per_s == pytest.approx(0.25)
    assert (batch.sent, batch.slo_met, batch.slo_attainment) == (4, 1, 0.25)
    assert batch.e2e.p99 == pytest.approx(5.2)
    assert report.rejections == {"429 queue_full": 2, "503 deadline_unmeetable": 1}
    assert report.errors == {"200 engine_error": 1}
    assert report.offered_rate == pytest.approx(9 / 0.8)
    # Keys never reach the report file.
    assert {t.api_key for t in report.workload.tenants} == {"<redacted>"}
    assert b"k1" not in encode(report)


def test_an_empty_set_has_no_percentiles() -> None:
    summary = summarize([], _workload(), duration_s=0.0)
    assert (summary.sent, summary.slo_attainment, summary.goodput_per_s, summary.ttft.p50) == (
        0,
        None,
        0.0,
        None,
    )


def test_the_package_exports_what_it_intends() -> None:
    public = {n for n in dir(load) if not n.startswith("_") and not isinstance(getattr(load, n), ModuleType)}
    assert sorted(load.__all__) == sorted(public)
