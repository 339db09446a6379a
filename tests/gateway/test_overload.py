"""Load shedding at the door: generation requests past the adaptive concurrency limit or the in-flight limit,
while the event loop runs late, or the share the CPU signal sheds, get 503 `overloaded` with Retry-After
before anything else runs; other routes always pass. The adaptive limit follows latency, and the CPU signal
CPU clocks, on injected clocks."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from litestar.types import Message, Receive, Scope, Send

from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.vllm_remote import RemoteEngineConfig
from gateway.app import _cpu_is_requests_own, create_app, running
from gateway.config import ReplicaSpec
from gateway.generation.prompts import PromptRenderer
from gateway.overload import (
    SCHEDSTAT,
    ConcurrencyLimit,
    CpuShedder,
    LoopLagMonitor,
    OverloadConfig,
    OverloadGate,
    thread_demand,
)
from tests.conftest import MODEL, OutcomeLog, Tenancy, eventually, make_config, serving


class FakeLoop:
    """A clock and a sleep that advances it by the interval plus whatever lag the test sets."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lag = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds + self.lag


async def test_only_lag_that_persists_through_the_window_counts() -> None:
    loop = FakeLoop()
    monitor = LoopLagMonitor(0.01, 3, loop.clock, loop.sleep)
    assert monitor.lag == pytest.approx(0.0)
    loop.lag = 0.2
    assert await monitor.probe() == pytest.approx(0.2)
    assert monitor.lag == 0.0  # one late probe is not overload
    await monitor.probe()
    await monitor.probe()
    assert monitor.lag == pytest.approx(0.2)  # late on each of the last 3 probes
    loop.lag = 0.0
    await monitor.probe()
    assert monitor.lag == pytest.approx(0.0)


def scope(path: str) -> Scope:
    return {"type": "http", "path": path, "method": "POST", "headers": []}  # type: ignore[return-value]


class Held:
    """An ASGI app that answers 200 once released, holding each request until then."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.entered += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})


async def call(app: Any, path: str) -> list[dict[str, Any]]:
    """Call `app` for `path`; the messages it sent."""
    sent: list[dict[str, Any]] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(dict(message))

    await app(scope(path), receive, send)
    return sent


def refused(sent: list[dict[str, Any]], reason: str) -> None:
    start, body = sent
    assert start["status"] == 503
    headers = dict(start["headers"])
    assert headers[b"retry-after"] == b"2"
    error = json.loads(body["body"])["error"]
    assert error["code"] == "overloaded"
    assert error["type"] == "service_unavailable"
    assert reason in error["message"]


async def test_requests_past_the_in_flight_limit_are_shed_and_others_pass() -> None:
    loop = FakeLoop()
    config = OverloadConfig(max_in_flight=2, max_loop_lag=0.05, retry_after=1.5)
    gate = OverloadGate(config, LoopLagMonitor(0.01, 1, loop.clock, loop.sleep))
    held = Held()
    app = gate.wrap(held)
    first = asyncio.create_task(call(app, "/v1/chat/completions"))
    second = asyncio.create_task(call(app, "/v1/completions"))
    await eventually(lambda: _true(held.entered == 2))
    assert gate.in_flight == 2
    refused(await call(app, "/v1/chat/completions"), "too many requests in flight")
    assert held.entered == 2  # the shed request reached nothing behind the gate
    assert gate.shed == {"concurrency": 0, "cpu": 0, "in_flight": 1, "loop_lag": 0}
    health = asyncio.create_task(call(app, "/healthz"))  # not a generation route: never shed
    await eventually(lambda: _true(held.entered == 3))
    held.release.set()
    for done in await asyncio.gather(first, second, health):
        assert done[0]["status"] == 200
    assert gate.in_flight == 0
    assert (await call(app, "/v1/chat/completions"))[0]["status"] == 200


async def test_requests_are_shed_while_the_event_loop_runs_late() -> None:
    loop = FakeLoop()
    config = OverloadConfig(max_loop_lag=0.05, retry_after=2.0)
    gate = OverloadGate(config, LoopLagMonitor(0.01, 2, loop.clock, loop.sleep))
    held = Held()
    held.release.set()
    app = gate.wrap(held)
    loop.lag = 0.08
    await gate.monitor.probe()
    await gate.monitor.probe()
    refused(await call(app, "/v1/chat/completions"), "event loop is running late")
    assert gate.shed == {"concurrency": 0, "cpu": 0, "in_flight": 0, "loop_lag": 1}
    assert (await call(app, "/readyz"))[0]["status"] == 200
    loop.lag = 0.0
    await gate.monitor.probe()
    assert (await call(app, "/v1/chat/completions"))[0]["status"] == 200
    disabled = OverloadGate(
        msgspec.structs.replace(config, enabled=False), LoopLagMonitor(0.01, 1, loop.clock, loop.sleep)
    )
    loop.lag = 1.0
    await disabled.monitor.probe()
    assert disabled.refusal() is None


async def _true(value: bool) -> bool:
    return value


@pytest.fixture
async def slow_engine() -> AsyncIterator[SimulatedEngine]:
    """A simulated engine slow enough that a long answer stays in flight while a test looks."""
    engine = SimulatedEngine(SimulatorConfig(decode_step_s=0.05, decode_step_s_per_seq=0.0), model_name=MODEL)
    await engine.start()
    yield engine
    await engine.shutdown()


async def test_a_gateway_at_its_in_flight_limit_sheds_with_retry_after(
    slow_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    config = msgspec.structs.replace(make_config(), overload=OverloadConfig(max_in_flight=1, retry_after=3.0))
    app = create_app(config, engine=slow_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1000}
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, timeout=30, headers=tenancy.consumer_headers) as http,
    ):
        async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            assert stream.status_code == 200
            shed = await http.post("/v1/chat/completions", json=body)
            assert shed.status_code == 503
            assert shed.headers["retry-after"] == "3"
            assert shed.headers["x-request-id"]
            assert shed.json()["error"]["code"] == "overloaded"
            assert (await http.get("/healthz")).status_code == 200
        gate: OverloadGate = app.state.overload
        await eventually(lambda: _true(gate.in_flight == 0))  # the closed stream has left
        answered = await http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        assert answered.status_code == 200, answered.text
        assert gate.shed["in_flight"] == 1


ADAPTIVE = OverloadConfig(
    adaptive=True,
    max_in_flight=100,
    min_limit=4,
    latency_tolerance=1.0,
    latency_percentile=0.9,
    sample_interval=0.1,
    min_rtt_interval=10.0,
    min_rtt_requests=5,
)


def interval(limit: ConcurrencyLimit, loop: FakeLoop, latency: float, *, company: int, peak: int) -> None:
    """One sample interval: `peak` in flight at once, then five requests completing in `latency` s, the
    last of them after the interval has run out (which updates the limit)."""
    limit.admitted(peak)
    for i in range(5):
        loop.now += ADAPTIVE.sample_interval * (0.1 if i < 4 else 0.7)
        limit.completed(latency, company)


def with_baseline(loop: FakeLoop, latency: float = 0.004) -> ConcurrencyLimit:
    """A limit whose baseline was measured on uncontended requests of `latency` s."""
    limit = ConcurrencyLimit(ADAPTIVE, loop.clock)
    assert limit.limit == ADAPTIVE.max_in_flight  # no baseline: only the ceiling
    assert limit.min_rtt is None
    interval(limit, loop, latency, company=0, peak=1)
    assert limit.min_rtt == pytest.approx(latency)
    return limit


def test_the_limit_falls_while_latency_is_above_the_baseline_and_never_below_its_floor() -> None:
    loop = FakeLoop()
    limit = with_baseline(loop)
    seen = [limit.limit]
    for _ in range(12):  # four times the baseline: twice what the tolerance allows
        interval(limit, loop, 0.016, company=50, peak=limit.limit)
        seen.append(limit.limit)
    # Halved plus sqrt(limit) headroom each interval, down to the floor and held there.
    assert seen[:4] == [100, 60, 37, 24]
    assert seen == sorted(seen, reverse=True)
    assert seen[-1] == ADAPTIVE.min_limit
    interval(limit, loop, 1.0, company=50, peak=limit.limit)  # however slow
    assert limit.limit == ADAPTIVE.min_limit
    assert limit.min_rtt == pytest.approx(0.004)  # contended requests never move the baseline


def test_the_limit_recovers_when_latency_falls_back_but_only_as_far_as_it_is_used() -> None:
    loop = FakeLoop()
    limit = with_baseline(loop)
    for _ in range(12):
        interval(limit, loop, 0.016, company=50, peak=limit.limit)
    assert limit.limit == ADAPTIVE.min_limit
    interval(limit, loop, 0.004, company=10, peak=limit.limit)  # back at the baseline: doubled plus headroom
    assert limit.limit == 2 * 4 + 2
    interval(limit, loop, 0.008, company=10, peak=limit.limit)  # at baseline * (1 + tolerance): headroom only
    assert limit.limit == int(10 + math.sqrt(10))
    held = limit.limit
    interval(limit, loop, 0.004, company=1, peak=held // 2 - 1)  # fast but mostly unused: no rise
    assert limit.limit == held
    for _ in range(10):
        interval(limit, loop, 0.004, company=10, peak=limit.limit)
    assert limit.limit == ADAPTIVE.max_in_flight  # never above the static ceiling


def test_the_baseline_is_remeasured_from_uncontended_requests_each_min_rtt_interval() -> None:
    loop = FakeLoop()
    limit = with_baseline(loop, 0.004)
    interval(limit, loop, 0.002, company=ADAPTIVE.min_limit - 1, peak=3)
    assert limit.min_rtt == pytest.approx(0.004)  # not before min_rtt_interval has passed
    loop.now += ADAPTIVE.min_rtt_interval
    interval(limit, loop, 0.002, company=ADAPTIVE.min_limit - 1, peak=3)
    assert limit.min_rtt == pytest.approx(0.002)
    loop.now += ADAPTIVE.min_rtt_interval
    for _ in range(3):  # overloaded: no request is uncontended, the baseline stays
        interval(limit, loop, 0.05, company=ADAPTIVE.min_limit, peak=limit.limit)
    assert limit.min_rtt == pytest.approx(0.002)


class Responder:
    """An ASGI app that answers once released; `clock` advances by `took` while it works, and a stream's
    body comes in two chunks with `tail` s of generation between them."""

    def __init__(self, loop: FakeLoop, *, took: float, stream: bool = False, tail: float = 0.0) -> None:
        self.loop = loop
        self.took = took
        self.stream = stream
        self.tail = tail
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.release.wait()
        self.loop.now += self.took
        kind = b"text/event-stream; charset=utf-8" if self.stream else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        if self.stream:
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            self.loop.now += self.tail
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})


async def test_latency_runs_to_the_end_of_an_answer_and_to_the_first_byte_of_a_stream() -> None:
    loop = FakeLoop()
    config = msgspec.structs.replace(ADAPTIVE, min_rtt_requests=1, sample_interval=0.0)
    gate = OverloadGate(config, LoopLagMonitor(0.01, 1, loop.clock, loop.sleep))
    assert gate.limit is not None
    await call(gate.wrap(Responder(loop, took=0.003)), "/v1/chat/completions")
    assert gate.limit.min_rtt == pytest.approx(0.003)
    loop.now += config.min_rtt_interval
    await call(gate.wrap(Responder(loop, took=0.002, stream=True, tail=30.0)), "/v1/chat/completions")
    assert gate.limit.min_rtt == pytest.approx(0.002)  # the 30 s generated after the first byte: not latency


async def test_requests_past_the_adaptive_limit_are_shed_and_counted() -> None:
    loop = FakeLoop()
    gate = OverloadGate(
        msgspec.structs.replace(ADAPTIVE, retry_after=2.0), LoopLagMonitor(0.01, 1, loop.clock, loop.sleep)
    )
    slow = Responder(loop, took=0.016)
    app = gate.wrap(slow)
    for _ in range(ADAPTIVE.min_rtt_requests):  # one at a time: uncontended, the baseline
        await call(gate.wrap(Responder(loop, took=0.004)), "/v1/chat/completions")
        loop.now += 0.02
    assert gate.limit is not None
    assert gate.limit.min_rtt == pytest.approx(0.004)
    for _ in range(10):  # then slow, with company: the limit falls to its floor
        slow.release.clear()
        at = gate.limit.limit
        together = [asyncio.create_task(call(app, "/v1/chat/completions")) for _ in range(at)]
        await eventually(lambda at=at: _true(gate.in_flight == at))  # type: ignore[misc]
        slow.release.set()
        await asyncio.gather(*together)
        loop.now += ADAPTIVE.sample_interval
    assert gate.limit.limit == ADAPTIVE.min_limit
    slow.release.clear()
    held = [asyncio.create_task(call(app, "/v1/chat/completions")) for _ in range(ADAPTIVE.min_limit)]
    await eventually(lambda: _true(gate.in_flight == ADAPTIVE.min_limit))
    shed_before = dict(gate.shed)
    refused(await call(app, "/v1/completions"), "more requests in flight than it is serving")
    assert gate.shed == {**shed_before, "concurrency": shed_before["concurrency"] + 1}
    assert (await call(gate.wrap(Responder(loop, took=0.0)), "/healthz"))[0]["status"] == 200  # never shed
    slow.release.set()
    await asyncio.gather(*held)
    static = OverloadGate(
        msgspec.structs.replace(ADAPTIVE, adaptive=False), LoopLagMonitor(0.01, 1, loop.clock, loop.sleep)
    )
    assert static.limit is None


class FakeCpu:
    """CPU clocks that run with a `FakeLoop`'s time: the loop thread busy `loop_share` of it, the process
    `process_cores` cores' worth of it (the loop thread included)."""

    def __init__(self, loop: FakeLoop) -> None:
        self.loop = loop
        self._since = loop.now
        self._thread = 0.0
        self._process = 0.0
        self._loop_share = 0.0
        self._process_cores = 0.0

    def load(self, loop_share: float, process_cores: float) -> None:
        """From now on, this much CPU."""
        self._thread, self._process = self.thread(), self.process()
        self._since = self.loop.now
        self._loop_share, self._process_cores = loop_share, process_cores

    def thread(self) -> float:
        return self._thread + (self.loop.now - self._since) * self._loop_share

    def process(self) -> float:
        return self._process + (self.loop.now - self._since) * self._process_cores


CPU = OverloadConfig(
    cpu_shedding=True,
    target_utilisation=0.8,
    cpu_climb_utilisation=0.8,  # the controller alone, without the dead band (tested on its own)
    cpu_window=0.2,
    cpu_gain=10.0,
    cpu_release_gain=5.0,
    max_shed_fraction=0.9,
    lag_probe_interval=0.05,
    max_loop_lag=0.0,
    retry_after=2.0,
)


def shedder(loop: FakeLoop, cpu: FakeCpu, cores: int = 4, config: OverloadConfig = CPU) -> CpuShedder:
    return CpuShedder(config, loop.clock, cpu.thread, cpu.process, cores=cores)


def run_for(shed: CpuShedder, loop: FakeLoop, seconds: float, step: float = 0.05) -> list[float]:
    """Sample every `step` s for `seconds`; the shed fraction after each sample."""
    fractions = []
    for _ in range(round(seconds / step)):
        loop.now += step
        shed.sample()
        fractions.append(shed.fraction)
    return fractions


def test_utilisation_is_the_larger_of_the_loop_share_and_the_process_share_over_the_window() -> None:
    loop = FakeLoop()
    cpu = FakeCpu(loop)
    shed = shedder(loop, cpu, cores=4)
    shed.sample()
    assert shed.utilisation == 0.0  # one reading: nothing measured yet
    cpu.load(loop_share=0.7, process_cores=1.2)  # the loop is the bottleneck: 70% of its core
    run_for(shed, loop, 0.5)
    assert shed.utilisation == pytest.approx(0.7)
    cpu.load(loop_share=0.4, process_cores=3.6)  # threads fill the cores: 90% of all four
    run_for(shed, loop, 0.5)
    assert shed.utilisation == pytest.approx(0.9)
    cpu.load(loop_share=0.0, process_cores=0.0)
    run_for(shed, loop, 0.1)  # half the window idle, half at 90%
    assert shed.utilisation == pytest.approx(0.45)
    run_for(shed, loop, 0.1)  # only what the window holds counts
    assert shed.utilisation == pytest.approx(0.0)
    cpu.load(loop_share=1.0, process_cores=6.0)  # readings a little off never pass 1
    run_for(shed, loop, 0.5)
    assert shed.utilisation == pytest.approx(1.0)


def test_nothing_is_shed_below_the_target_however_long() -> None:
    loop = FakeLoop()
    cpu = FakeCpu(loop)
    shed = shedder(loop, cpu)
    cpu.load(loop_share=0.79, process_cores=3.0)  # 79% and 75%: both under the 80% target
    assert set(run_for(shed, loop, 60.0)) == {0.0}
    assert not any(shed.shed() for _ in range(10_000))


def test_the_shed_fraction_rises_while_over_the_target_and_falls_back_under_it() -> None:
    loop = FakeLoop()
    cpu = FakeCpu(loop)
    shed = shedder(loop, cpu)
    shed.sample()
    cpu.load(loop_share=1.0, process_cores=1.0)  # saturated: 0.2 over the target
    rising = run_for(shed, loop, 1.0)
    # cpu_gain * (1.0 - 0.8) per second: 0.1 a probe, up to max_shed_fraction.
    assert rising[:3] == pytest.approx([0.1, 0.2, 0.3])
    assert rising == sorted(rising)
    assert rising[-1] == pytest.approx(CPU.max_shed_fraction)
    cpu.load(loop_share=0.7, process_cores=1.0)  # 0.1 under the target: back down, once the window shows it,
    falling = run_for(
        shed, loop, 3.0
    )  # at the slower cpu_release_gain (0.025 a probe), and no further than 0
    assert falling == sorted(falling, reverse=True)
    steps = [a - b for a, b in itertools.pairwise(falling) if b > 0]
    assert steps[4:] == pytest.approx([0.025] * len(steps[4:]))
    assert falling[-1] == 0.0
    cpu.load(loop_share=0.9, process_cores=1.0)  # over again by 0.1: once the window holds only that, half
    run_for(shed, loop, CPU.cpu_window)  # as fast (0.05 a probe)
    again = [shed.fraction, *run_for(shed, loop, 0.2)]
    assert [b - a for a, b in itertools.pairwise(again)] == pytest.approx([0.05] * 4)


def test_between_the_target_and_the_climb_the_fraction_holds() -> None:
    loop = FakeLoop()
    cpu = FakeCpu(loop)
    shed = shedder(loop, cpu, config=msgspec.structs.replace(CPU, cpu_climb_utilisation=0.95))
    shed.sample()
    cpu.load(loop_share=0.9, process_cores=1.0)  # over the 80% target, but the window has idle moments
    assert set(run_for(shed, loop, 2.0)) == {0.0}
    cpu.load(loop_share=1.0, process_cores=1.0)  # no idle moment: a backlog, so it climbs
    assert run_for(shed, loop, 0.5)[-1] > 0.5
    cpu.load(loop_share=0.9, process_cores=1.0)  # back in the band: held where it was, not released
    run_for(shed, loop, CPU.cpu_window)
    held = run_for(shed, loop, 1.0)
    assert held == pytest.approx([held[0]] * len(held))
    cpu.load(loop_share=0.5, process_cores=1.0)  # under the target: falls back to 0
    assert run_for(shed, loop, 10.0)[-1] == 0.0


def test_the_climb_must_lie_between_the_target_and_the_whole_cpu() -> None:
    for climb in (0.5, 1.01):
        with pytest.raises(msgspec.ValidationError, match="cpu_climb_utilisation"):
            msgspec.convert({"target_utilisation": 0.85, "cpu_climb_utilisation": climb}, OverloadConfig)


def test_the_shed_requests_are_the_fraction_of_arrivals_spread_evenly() -> None:
    loop = FakeLoop()
    shed = shedder(loop, FakeCpu(loop))
    shed.fraction = 0.25
    assert [shed.shed() for _ in range(8)] == [False, False, False, True] * 2
    shed.fraction = 0.6
    pattern = [shed.shed() for _ in range(1000)]
    assert abs(sum(pattern) - 600) <= 1  # within one request (rounding of the credit)
    assert max(len(run) for run in "".join("x" if s else "." for s in pattern).split(".")) == 2
    shed.fraction = 0.0
    assert not any(shed.shed() for _ in range(100))


def test_arrivals_sample_the_signal_when_the_probes_run_late() -> None:
    loop = FakeLoop()
    cpu = FakeCpu(loop)
    config = msgspec.structs.replace(CPU, lag_probe_interval=1 / 16)  # binary fractions: exact sums
    shed = shedder(loop, cpu, config=config)
    shed.sample()
    cpu.load(loop_share=1.0, process_cores=1.0)  # saturated: the loop works through a backlog, no probe runs
    fractions = []
    for _ in range(6):
        loop.now += config.lag_probe_interval / 2  # two arrivals a probe interval: every second one samples
        shed.shed()
        fractions.append(shed.fraction)
    # As if probed every interval: cpu_gain * (1.0 - 0.8) / 16 s = 0.125 a sample.
    assert fractions == pytest.approx([0.0, 0.125, 0.125, 0.25, 0.25, 0.375])
    assert shed.utilisation == 1.0


def arrive(shed: CpuShedder, loop: FakeLoop, rate: float, seconds: float) -> list[bool]:
    """Arrivals every 1 / `rate` s for `seconds`, no probe running; whether each was shed."""
    shed_or_not = []
    for _ in range(round(rate * seconds)):
        loop.now += 1 / rate
        shed_or_not.append(shed.shed())
    return shed_or_not


FEED = msgspec.structs.replace(CPU, lag_probe_interval=1 / 16, cpu_window=0.25)


def steady(config: OverloadConfig = FEED, rate: float = 40) -> tuple[FakeLoop, FakeCpu, CpuShedder]:
    """A signal on one core after 6 s of `rate` requests a second at 40% of the core (by default 40 a second
    at 10 ms of CPU each), nothing shed."""
    loop = FakeLoop()
    cpu = FakeCpu(loop)
    shed = shedder(loop, cpu, cores=1, config=config)
    shed.sample()
    cpu.load(loop_share=0.4, process_cores=0.4)
    assert not any(arrive(shed, loop, rate=rate, seconds=6.0))
    return loop, cpu, shed


def test_a_jump_in_arrivals_is_shed_as_it_arrives_at_the_cost_learned_before() -> None:
    loop, cpu, shed = steady()
    assert shed.cost == pytest.approx(0.010, rel=0.1)  # the cost's average has settled
    assert shed.floor == 0.0
    # Three times what the core can serve, the CPU just over the target: the controller starts to climb,
    # the floor is where it is heading at once.
    cpu.load(loop_share=0.9, process_cores=0.9)
    jump = arrive(shed, loop, rate=300, seconds=1.5 * FEED.cpu_window)
    assert shed.utilisation == pytest.approx(0.9)
    # predicted = 300/s x 10 ms = 3.0 cores' worth: shed all but target / predicted of the arrivals.
    assert shed.floor == pytest.approx(1 - FEED.target_utilisation / 3.0, abs=0.08)
    assert shed.fraction < shed.floor / 2
    assert sum(jump[-30:]) == pytest.approx(30 * shed.floor, abs=2)
    assert shed.cost == pytest.approx(0.010, rel=0.1)  # not learned from the rise
    # Back to 40 a second: the floor falls with the arrivals, once the window holds only them.
    arrive(shed, loop, rate=40, seconds=2 * FEED.cpu_window)
    assert shed.floor == 0.0


def test_arrivals_under_what_the_cpu_can_serve_set_no_floor() -> None:
    loop, _, shed = steady()
    # 90/s of 10 ms: over the target (the controller's part) but within the core: no floor.
    assert not any(arrive(shed, loop, rate=90, seconds=1.0))
    assert shed.floor == 0.0


def test_a_burst_of_arrivals_the_cpu_does_not_show_sets_no_floor() -> None:
    # Long streams: each arrival's CPU is spread over seconds, so a burst of them over one window is not
    # the overload its count predicts while the CPU stays under the target.
    loop, _, shed = steady()
    assert not any(arrive(shed, loop, rate=300, seconds=FEED.cpu_window))
    assert shed.floor == 0.0


def test_a_jump_is_shed_within_a_probe_interval_before_the_window_shows_it() -> None:
    loop, cpu, shed = steady(rate=400)  # 1 ms each: a probe interval holds 62 requests' worth
    cpu.load(loop_share=1.0, process_cores=1.0)  # saturated from the jump on
    jump = arrive(shed, loop, rate=3000, seconds=2 * FEED.lag_probe_interval)
    # Half the window saturated, half at 40%: the window is still under the target, the controller idle.
    assert shed.utilisation < FEED.target_utilisation
    assert shed.fraction == 0.0
    # The last probe interval: 3000/s x 1 ms = 3.0 cores' worth on a saturated core.
    assert shed.floor == pytest.approx(1 - FEED.target_utilisation / 3.0, abs=0.08)
    assert sum(jump[-150:]) == pytest.approx(150 * shed.floor, abs=2)


def test_where_a_probe_interval_holds_few_requests_a_jump_is_judged_over_ten_requests_worth() -> None:
    loop, cpu, shed = steady()  # 10 ms each: a probe interval (62.5 ms) holds 6 requests' worth
    cpu.load(loop_share=1.0, process_cores=1.0)
    # 8 arrivals in one probe interval (a batch a busy loop read at once) predict 1.28 cores' worth, past the
    # jump, but over 10 requests' worth (100 ms) they are no jump.
    assert not any(arrive(shed, loop, rate=8 / FEED.lag_probe_interval, seconds=FEED.lag_probe_interval))
    assert shed.floor == 0.0
    # A jump that lasts is shed within those 100 ms (before the 250 ms window shows the CPU over the target).
    jump = arrive(shed, loop, rate=300, seconds=0.1)
    assert shed.utilisation < FEED.target_utilisation
    assert shed.floor == pytest.approx(1 - FEED.target_utilisation / 3.0, abs=0.1)
    assert any(jump)


def test_a_cost_learned_at_a_low_rate_comes_down_at_a_higher_one() -> None:
    loop, _, shed = steady()
    assert shed.cost == pytest.approx(0.010, rel=0.1)
    # The same 40% of the core for 90 requests a second (its fixed work spread thinner): 4.4 ms each. At the
    # cost learned before they predict 0.9, over the 80% target, while the CPU itself stays under it.
    arrive(shed, loop, rate=90, seconds=12.0)
    assert shed.cost == pytest.approx(0.4 / 90, rel=0.1)


def test_a_probe_interval_of_arrivals_just_past_the_cpu_sets_no_floor() -> None:
    loop, cpu, shed = steady()
    cpu.load(loop_share=1.0, process_cores=1.0)
    # 110/s x 10 ms = 1.1 cores' worth: past the core, but within what a chance count of an interval reaches.
    assert not any(arrive(shed, loop, rate=110, seconds=2 * FEED.lag_probe_interval))
    assert shed.floor == 0.0


def test_samples_a_moment_apart_are_no_jump() -> None:
    loop, cpu, shed = steady()
    cpu.load(loop_share=1.0, process_cores=1.0)
    loop.now += FEED.lag_probe_interval
    shed.sample()  # a probe
    loop.now += 0.0001
    assert not shed.shed()  # an arrival, too soon after the probe to sample
    loop.now += 0.0001
    shed.sample()  # the next probe right after: one arrival in 0.2 ms is no jump to 50 cores' worth
    assert shed.floor == 0.0


def test_without_feed_forward_only_the_controller_sheds() -> None:
    loop, cpu, shed = steady(msgspec.structs.replace(FEED, cpu_feed_forward=False))
    cpu.load(loop_share=0.9, process_cores=0.9)
    arrive(shed, loop, rate=300, seconds=1.5 * FEED.cpu_window)
    assert shed.cost == shed.floor == 0.0
    assert 0.0 < shed.shed_fraction == shed.fraction < 0.5  # the controller climbing, alone


async def test_the_cpu_signal_sheds_generation_requests_counted_as_cpu() -> None:
    loop = FakeLoop()
    cpu = FakeCpu(loop)
    monitor = LoopLagMonitor(CPU.lag_probe_interval, 1, loop.clock, loop.sleep)
    config = msgspec.structs.replace(CPU, max_shed_fraction=0.5)
    gate = OverloadGate(config, monitor, cpu=shedder(loop, cpu, cores=2, config=config))
    assert gate.cpu is not None
    responder = Responder(loop, took=0.0)
    app = gate.wrap(responder)
    cpu.load(loop_share=0.5, process_cores=1.0)  # 50%: nothing shed
    for _ in range(20):
        await monitor.probe()  # each probe samples the CPU clocks
    assert [(await call(app, "/v1/chat/completions"))[0]["status"] for _ in range(20)] == [200] * 20
    cpu.load(loop_share=1.0, process_cores=2.0)  # saturated long enough to shed the most it may: half
    for _ in range(20):
        await monitor.probe()
    assert gate.cpu.fraction == 0.5
    answers = [await call(app, "/v1/chat/completions") for _ in range(20)]
    assert [sent[0]["status"] for sent in answers] == [200, 503] * 10
    for sent in answers[1::2]:
        refused(sent, "its CPU is saturated")
    assert gate.shed == {"concurrency": 0, "cpu": 10, "in_flight": 0, "loop_lag": 0}
    for path in ("/healthz", "/readyz", "/metrics", "/admin/tenants"):  # never shed
        assert (await call(app, path))[0]["status"] == 200
    assert gate.shed["cpu"] == 10
    cpu.load(loop_share=0.2, process_cores=0.2)
    for _ in range(10):
        await monitor.probe()
    assert gate.cpu.fraction == 0.0
    assert [(await call(app, "/v1/completions"))[0]["status"] for _ in range(20)] == [200] * 20


def test_the_cpu_signal_is_off_unless_configured() -> None:
    loop = FakeLoop()
    monitor = LoopLagMonitor(0.05, 1, loop.clock, loop.sleep)
    gate = OverloadGate(OverloadConfig(), monitor)
    assert gate.cpu is None
    assert monitor.after_probe == []
    assert OverloadGate(msgspec.structs.replace(CPU, cpu_shedding=False), monitor).cpu is None


async def test_auto_leaves_the_cpu_signal_off_while_an_engine_runs_in_the_process(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    config = msgspec.structs.replace(make_config(), overload=OverloadConfig(max_loop_lag=0.0))
    assert config.overload.cpu_shedding == "auto"  # the default
    app = create_app(config, engine=sim_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with running(app):
        assert app.state.overload.cpu is None
    remote = msgspec.structs.replace(
        config,
        engines=[
            ReplicaSpec(
                kind="vllm_remote",
                remote=RemoteEngineConfig(url="http://vllm:8000", served_model=MODEL, max_model_len=2048),
            )
        ],
    )
    assert _cpu_is_requests_own(remote, 0, given_engine=False)
    assert not _cpu_is_requests_own(remote, 1, given_engine=False)  # a guard model's engine in the process
    local = msgspec.structs.replace(remote, engines=[*remote.engines, ReplicaSpec(kind="vllm_local")])
    assert not _cpu_is_requests_own(local, 0, given_engine=False)
    assert not _cpu_is_requests_own(config, 0, given_engine=False)  # the embedded engine
    # The simulator makes its tokens on the event loop, for the requests it serves: their own CPU.
    sim = msgspec.structs.replace(config.engine, kind="simulated")
    simulated = msgspec.structs.replace(config, engine=sim)
    assert _cpu_is_requests_own(simulated, 0, given_engine=False)
    assert not _cpu_is_requests_own(simulated, 0, given_engine=True)  # the caller's engine: of unknown kind
    mixed = msgspec.structs.replace(remote, engines=[*remote.engines, ReplicaSpec(kind="simulated")])
    assert _cpu_is_requests_own(mixed, 0, given_engine=False)


async def test_auto_turns_the_cpu_signal_on_for_the_simulated_engine(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    """The overhead bench's gateway (`engine.kind = "simulated"`, its own process) sheds on CPU by default:
    at twice what it serves, refused at the door instead of late in the pipeline (docs/overhead.md)."""
    config = msgspec.structs.replace(make_config(), overload=OverloadConfig(max_loop_lag=0.0))
    config = msgspec.structs.replace(config, engine=msgspec.structs.replace(config.engine, kind="simulated"))
    app = create_app(config, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with running(app):
        assert app.state.overload.cpu is not None


@pytest.mark.skipif(not SCHEDSTAT.exists(), reason="no schedstat: the loop's CPU time is its demand")
def test_the_loop_demand_counts_at_least_the_time_the_thread_ran() -> None:
    ran = time.thread_time()
    assert thread_demand() >= ran - 0.01  # schedstat and the CPU clock may round a tick apart


@pytest.mark.parametrize("freeze", [False, True])
async def test_the_serving_process_freezes_what_start_up_built(
    freeze: bool, slow_engine: SimulatedEngine, renderer: PromptRenderer, tenancy: Tenancy
) -> None:
    # A full collection walking the start-up objects stopped the loop for ~350 ms under load: `lockgate
    # serve` moves them out of the collector's sight once started; apps built by tests leave the heap alone.
    app = create_app(
        make_config(), engine=slow_engine, renderer=renderer, tenants=tenancy.store, freeze_start_up=freeze
    )
    # The session froze what collection imported (tests/conftest.py): count what the app adds to that.
    before = gc.get_freeze_count()
    try:
        async with running(app):
            frozen = gc.get_freeze_count()
        stopped = gc.get_freeze_count()
    finally:
        if gc.get_freeze_count() != before:  # the heap back as the session had it (the app's objects aside)
            gc.unfreeze()
            if before:
                gc.freeze()
    assert (frozen > before) is freeze
    # Stopped, it unfreezes them for the interpreter's exit (frozen objects outlive its finalization, where
    # triton's extension module reports them as leaked); an app that froze nothing unfreezes nothing.
    assert (stopped == 0) is freeze
