"""Load shedding at the door: generation requests past the in-flight limit, or while the event loop runs late,
get 503 `overloaded` with Retry-After before anything else runs; other routes always pass."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from litestar.types import Message, Receive, Scope, Send

from engines.simulated import SimulatedEngine, SimulatorConfig
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from gateway.overload import LoopLagMonitor, OverloadConfig, OverloadGate
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
    assert gate.shed == {"in_flight": 1, "loop_lag": 0}
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
    assert gate.shed == {"in_flight": 0, "loop_lag": 1}
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
