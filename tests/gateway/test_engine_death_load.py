"""Engine death under concurrent load from the openai SDK (issue 7, "fault tests ... under concurrent load").

Eight SDK clients keep sending a mix of streaming and whole requests to a gateway whose supervised
(simulated) engine is killed twice. Every request must end in one of three declared ways: completed, a stream
ended by an error event, or 503 `engine_unavailable` (or `no_healthy_replica`, once a refresh has taken the
replica out) with Retry-After; none may hang; every quota reservation settles with the usage its request
had; `/healthz` stays 200 (the gateway recovers by itself); and after each restart every client is served
again, with no action on the gateway.

Deterministic by events: the supervisor's backoff sleep is a gate the test opens, a refused client waits for
the test to say its Retry-After has passed (after the restart), and the kill happens while the test's own
streams are open (so some stream always dies mid-way).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import openai

from engines.base import Engine
from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.supervisor import RestartPolicy, SupervisedEngine
from policy.quota.base import BucketSpec
from policy.quota.meter import QuotaMeter
from tests.conftest import MODEL, OutcomeLog
from tests.gateway.test_engine_death import (
    QUESTION,
    Deploy,
    Deployment,
    Gate,
    deploy,  # noqa: F401 - the fixture, used by name
    ends_with_an_error_event,
    open_streams,
)

WORKERS = 8
PER_WORKER = 60  # bound on each client's requests (the tenant's request bucket holds 1000, never refilled)
HANG = 30.0  # hang guard for one request or one wait: never a performance assertion
REQUESTS = BucketSpec(key="tenant:{acme}:req", capacity=1000, rate=1)

COMPLETED = "completed"
STREAM_ERROR = "stream ended by an error event"
REFUSED = "503 engine_unavailable"


class Gates:
    """The supervisor's backoff sleep: waits on the gate of the current kill (a fresh, closed one each)."""

    def __init__(self) -> None:
        self.current = Gate()

    async def __call__(self, seconds: float) -> None:
        await self.current(seconds)


class Tally:
    """What each client saw, and an event per change for the test to wait on."""

    def __init__(self) -> None:
        self.results: list[Counter[str]] = [Counter() for _ in range(WORKERS)]
        self.sent = [0] * WORKERS
        self.failures: list[str] = []
        self.parked = 0  # clients waiting out a Retry-After now
        self.retry_allowed = asyncio.Event()  # set by the test once the engine serves again
        self.last_round = False  # each client stops after its next request that is not refused
        self._changed = asyncio.Event()

    def record(self, worker: int, result: str) -> None:
        if result not in (COMPLETED, STREAM_ERROR, REFUSED):
            self.failures.append(f"worker {worker}: {result}")
        self.results[worker][result] += 1
        self.changed()

    def changed(self) -> None:
        self._changed.set()

    def total(self, result: str) -> int:
        return sum(counts[result] for counts in self.results)

    def completed(self) -> list[int]:
        return [counts[COMPLETED] for counts in self.results]

    async def until(self, check: Callable[[], bool]) -> None:
        """Wait until `check()` holds, re-checking on every change; fails at once on a failed request, and
        past the hang guard."""
        async with asyncio.timeout(HANG):
            while not check() and not self.failures:
                self._changed.clear()
                await self._changed.wait()
        assert not self.failures, self.failures


def state(supervisor: SupervisedEngine) -> str:
    """The supervisor's state now (a call, so that a type checker does not narrow it across awaits)."""
    return supervisor.state


def engine_unavailable(body: object) -> bool:
    return isinstance(body, dict) and body.get("code") == "engine_unavailable"


async def one_request(sdk: openai.AsyncOpenAI, stream: bool, max_tokens: int) -> str:
    """Send one request and classify how it ended; anything but the three declared ends is a failure."""
    try:
        async with asyncio.timeout(HANG):
            if not stream:
                answer = await sdk.chat.completions.create(
                    model=MODEL, messages=QUESTION, max_tokens=max_tokens
                )
                finish = answer.choices[0].finish_reason
                used = answer.usage.completion_tokens if answer.usage else None
                if (finish, used) != ("length", max_tokens):
                    return f"whole answer with finish {finish}, {used} tokens of {max_tokens}"
                return COMPLETED
            chunks = await sdk.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=max_tokens, stream=True
            )
            async with chunks:
                ended: str | None = None
                try:
                    async for chunk in chunks:
                        if chunk.choices and chunk.choices[0].finish_reason:
                            ended = chunk.choices[0].finish_reason
                except openai.APIError as exc:
                    # An SSE error event is a plain APIError; a dropped connection or a status is not.
                    if type(exc) is openai.APIError and engine_unavailable(exc.body):
                        return STREAM_ERROR
                    return f"stream ended by {exc!r} {exc.body!r}"
                if ended != "length":
                    return f"stream ended with finish {ended} and no error"
                return COMPLETED
    except openai.APIStatusError as exc:
        retry_after = exc.response.headers.get("Retry-After", "")
        # Refused by the dead engine itself, or by the router once a refresh has taken the replica out.
        declared = exc.status_code == 503 and exc.code in ("engine_unavailable", "no_healthy_replica")
        if declared and retry_after.isdigit() and int(retry_after) >= 1:
            return REFUSED
        return f"HTTP {exc.status_code} {exc.code} Retry-After={retry_after!r}: {exc.message}"
    except TimeoutError:
        return f"hung: no end within {HANG} s"
    except Exception as exc:
        return f"raised {exc!r}"


async def client(worker: int, gw: Deployment, tally: Tally) -> None:
    """One SDK client looping over a bounded, deterministic mix of requests until its last round. After a
    503 it waits out its Retry-After, which ends when the test says so (once the engine serves again)."""
    sdk = openai.AsyncOpenAI(base_url=gw.sdk.base_url, api_key=gw.sdk.api_key, max_retries=0)
    async with sdk:
        for n in range(PER_WORKER):
            stream = (worker + n) % 2 == 0
            max_tokens = 20 + (37 * worker + 53 * n) % 181  # 20..200
            tally.sent[worker] += 1
            tally.changed()
            result = await one_request(sdk, stream, max_tokens)
            tally.record(worker, result)
            if result == REFUSED:
                tally.parked += 1
                tally.changed()
                await tally.retry_allowed.wait()
                tally.parked -= 1
            elif tally.last_round:
                return


async def test_engine_deaths_under_load_from_sdk_clients(deploy: Deploy, outcomes: OutcomeLog) -> None:  # noqa: F811
    def factory() -> Engine:
        return SimulatedEngine(
            SimulatorConfig(decode_step_s=0.005, decode_step_s_per_seq=0.0), model_name=MODEL
        )

    gates = Gates()
    supervisor = SupervisedEngine(factory, RestartPolicy(health_interval=3600), sleep=gates)
    await supervisor.start()
    tally = Tally()
    victims = 0
    try:
        async with deploy(supervisor) as gw:
            assert await gw.status("/healthz") == 200
            clients = [asyncio.create_task(client(worker, gw, tally)) for worker in range(WORKERS)]
            try:
                await tally.until(lambda: min(tally.sent) >= 1)  # every client has sent a request
                for cycle in (1, 2):
                    victims += await kill_and_restart(gw, supervisor, gates, tally, last=cycle == 2)
                    assert supervisor.restarts == cycle
                async with asyncio.timeout(HANG):
                    await asyncio.gather(*clients)
            finally:
                for task in clients:
                    task.cancel()
                await asyncio.gather(*clients, return_exceptions=True)
            assert not tally.failures, tally.failures
            assert supervisor.restarts == 2
            assert tally.total(REFUSED) == 2 * WORKERS
            assert tally.total(COMPLETED) >= 2 * WORKERS  # each client served again after each restart
            assert await gw.status("/healthz") == 200

            # Every request reserved quota and reported an outcome; every reservation settled with its usage.
            requests = sum(sum(counts.values()) for counts in tally.results) + victims
            await outcomes.wait_count(requests)
            await gw.assert_every_reservation_settled(outcomes)
            meter: QuotaMeter = gw.app.state.services.meter
            assert meter.counters["reserved"] == requests
            assert meter.counters["settle_given_up"] == 0
            assert meter.counters["reserve_unknown"] == 0
            [left] = await meter.store.levels([REQUESTS], 0.0)
            assert left == REQUESTS.capacity - requests
    finally:
        await supervisor.shutdown()


async def kill_and_restart(
    gw: Deployment, supervisor: SupervisedEngine, gates: Gates, tally: Tally, *, last: bool
) -> int:
    """Kill the engine under load, hold its restart until every client has been refused, let it restart,
    and wait until every client is served again (then, on the `last` time, stops). Returns how many streams
    of the test's own it killed."""
    gates.current = Gate()
    tally.retry_allowed.clear()
    refused_before = tally.total(REFUSED)
    # Streams of the test's own, running in the engine (first chunk read): some stream surely dies mid-way.
    victims = await open_streams(gw.sdk, 2)
    engine = supervisor.engine
    assert isinstance(engine, SimulatedEngine)
    engine.kill("engine core exited")
    async with asyncio.timeout(HANG):
        messages = await asyncio.gather(*(ends_with_an_error_event(s) for s in victims))
        await supervisor.wait_for("restarting")
    assert all("not available" in m for m in messages), messages
    # The restart waits at the gate until every client has been refused (and waits out its Retry-After).
    await tally.until(lambda: tally.parked == WORKERS)
    assert tally.total(REFUSED) - refused_before == WORKERS
    assert state(supervisor) == "restarting"
    assert await gw.status("/healthz") == 200, "the gateway recovers by itself: liveness must hold"
    assert await gw.status("/readyz") == 503
    gates.current.open()
    async with asyncio.timeout(HANG):
        await supervisor.wait_for("ready", "failed")
    assert state(supervisor) == "ready"
    assert await gw.status("/readyz") == 200
    assert await gw.status("/healthz") == 200
    # Service resumed by itself: once their Retry-After is over, every client is served again.
    served = tally.completed()
    tally.last_round = last
    tally.retry_allowed.set()
    await tally.until(lambda: all(now > then for now, then in zip(tally.completed(), served, strict=True)))
    return len(victims)
