"""SupervisedEngine: a dead engine is noticed, replaced with backoff, and given up on after bounded retries.

The engines are simulators; the supervisor's backoff sleeps are gates the test opens, so nothing waits on
the wall clock and each state can be observed while it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engines.base import EngineDeadError, EngineRequest, SamplingSpec
from engines.memory import release_freed_memory
from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.supervisor import RestartPolicy, State, SupervisedEngine

FAST = SimulatorConfig(decode_step_s=0.001, decode_step_s_per_seq=0.0, prefill_s_per_token=0.0)


def request(n: int, max_tokens: int = 1000) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{n}", prompt_token_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=max_tokens)
    )


class GatedSleep:
    """Backoff sleeps that last until the test opens them; records every delay asked for."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._open = asyncio.Event()
        self.waiting = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.waiting.set()
        await self._open.wait()

    def open(self) -> None:
        """Let every pending and future sleep return at once."""
        self._open.set()


class BrokenEngine(SimulatedEngine):
    """An engine that cannot start (as a vLLM start that fails on a broken host)."""

    async def start(self) -> None:
        raise RuntimeError("no memory for the KV cache")


class Factory:
    """Builds simulators, or broken engines while `broken` is set; keeps every engine it built."""

    def __init__(self) -> None:
        self.built: list[SimulatedEngine] = []
        self.broken = False

    def __call__(self) -> SimulatedEngine:
        engine = (BrokenEngine if self.broken else SimulatedEngine)(FAST, model_name="m")
        self.built.append(engine)
        return engine


@pytest.fixture
async def supervised() -> AsyncIterator[tuple[SupervisedEngine, Factory, GatedSleep]]:
    factory = Factory()
    sleep = GatedSleep()
    policy = RestartPolicy(health_interval=3600, max_restarts=3, backoff=1.0, backoff_max=3.0)
    engine = SupervisedEngine(factory, policy, sleep=sleep)
    await engine.start()
    yield engine, factory, sleep
    sleep.open()
    await engine.shutdown()


async def wait_state(engine: SupervisedEngine, state: State) -> None:
    async with asyncio.timeout(10):
        await engine.wait_for(state)


async def test_a_death_mid_stream_ends_the_stream_and_the_engine_is_replaced(
    supervised: tuple[SupervisedEngine, Factory, GatedSleep],
) -> None:
    engine, factory, sleep = supervised
    stream = engine.generate(request(1))
    await anext(stream)
    factory.built[0].kill()
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    await sleep.waiting.wait()
    # Restarting: new requests are refused at once with a retry hint; not ready, but still alive.
    assert engine.state == "restarting"
    with pytest.raises(EngineDeadError) as refused:
        await anext(engine.generate(request(2)))
    assert refused.value.retry_after is not None
    assert refused.value.retry_after >= 1
    assert not (await engine.health()).ready
    assert engine.alive
    sleep.open()
    await wait_state(engine, "ready")
    assert engine.restarts == 1
    assert len(factory.built) == 2
    deltas = [d async for d in engine.generate(request(3, max_tokens=3))]
    assert deltas[-1].finish_reason == "length"
    assert (await engine.health()).ready


async def test_a_death_seen_only_by_the_health_check_is_restarted_too() -> None:
    factory = Factory()
    gate = GatedSleep()
    engine = SupervisedEngine(factory, RestartPolicy(health_interval=0.01), sleep=gate)
    await engine.start()
    try:
        factory.built[0].kill("engine core exited")
        await wait_state(engine, "restarting")
        assert engine.last_error == "engine core exited"
        gate.open()
        await wait_state(engine, "ready")
        assert engine.restarts == 1
    finally:
        gate.open()
        await engine.shutdown()


async def test_restarts_back_off_and_give_up_after_the_limit(
    supervised: tuple[SupervisedEngine, Factory, GatedSleep],
) -> None:
    engine, factory, sleep = supervised
    factory.broken = True
    factory.built[0].kill()
    # The next request meets the dead engine: that is how the supervisor learns of it here.
    with pytest.raises(EngineDeadError):
        await anext(engine.generate(request(1)))
    sleep.open()
    await wait_state(engine, "failed")
    assert not engine.alive
    assert sleep.delays == [1.0, 2.0, 3.0]  # doubled, capped at backoff_max
    assert "restart 3 failed" in engine.last_error
    assert "no memory" in engine.last_error
    assert not (await engine.health()).ready


async def checks_pass(engine: SupervisedEngine, count: int) -> None:
    """Until the supervisor has checked its engine `count` more times."""
    target = engine.checks + count
    async with asyncio.timeout(10):
        while engine.checks < target:  # noqa: ASYNC110 - the checks run on the supervisor's own interval
            await asyncio.sleep(0.001)


class Freezable:
    """A simulator sleep that stops returning once frozen: the engine holds its requests and runs no step,
    as an engine core stopped with SIGSTOP does."""

    def __init__(self) -> None:
        self.frozen = False
        self._never = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        if self.frozen:
            await self._never.wait()
        await asyncio.sleep(0)


class ManualClock:
    """Monotonic time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_an_engine_that_holds_requests_but_runs_no_step_is_restarted() -> None:
    sleeps: list[Freezable] = []

    def factory() -> SimulatedEngine:
        sleeps.append(Freezable())
        return SimulatedEngine(FAST, model_name="m", sleep=sleeps[-1])

    clock = ManualClock()
    gate = GatedSleep()
    policy = RestartPolicy(health_interval=0.001, stall_timeout=60.0)
    engine = SupervisedEngine(factory, policy, clock=clock, sleep=gate)
    await engine.start()
    try:
        stream = engine.generate(request(1, max_tokens=1_000))
        await anext(stream)
        sleeps[0].frozen = True
        await checks_pass(engine, 2)
        # A wait shorter than the timeout is no stall.
        clock.now += 59.0
        await checks_pass(engine, 2)
        assert engine.state == "ready"
        clock.now += 2.0
        await wait_state(engine, "restarting")
        assert "stalled" in engine.last_error
        # The stream of the stalled engine ends with the death, not with a normal "abort" finish.
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        gate.open()
        await wait_state(engine, "ready")
        deltas = [d async for d in engine.generate(request(2, max_tokens=3))]
        assert deltas[-1].finish_reason == "length"
    finally:
        gate.open()
        await engine.shutdown()


async def test_scoring_passes_through_and_a_death_while_scoring_starts_a_restart(
    supervised: tuple[SupervisedEngine, Factory, GatedSleep],
) -> None:
    engine, factory, sleep = supervised
    direct = await factory.built[0].score_next_token([1, 2, 3], [5, 9])
    assert await engine.score_next_token([1, 2, 3], [5, 9], priority=-10) == direct
    factory.built[0].kill()
    with pytest.raises(EngineDeadError) as dead:
        await engine.score_next_token([1, 2, 3], [5, 9], priority=-10)
    assert dead.value.retry_after is not None
    await sleep.waiting.wait()
    assert engine.state == "restarting"
    sleep.open()
    await wait_state(engine, "ready")
    assert await engine.score_next_token([1, 2, 3], [5, 9]) == direct


async def test_a_dead_engine_is_shut_down_and_its_memory_released_before_the_next_starts() -> None:
    """Once per restart, after the dead engine's shutdown and before the next one is built: what it held is
    collected and the freed heap handed back (`engines.memory`, whose real function runs here too)."""
    events: list[str] = []
    built: list[SimulatedEngine] = []

    class Logged(SimulatedEngine):
        async def shutdown(self) -> None:
            events.append("shutdown")
            await super().shutdown()

    def factory() -> SimulatedEngine:
        events.append("built")
        built.append(Logged(FAST, model_name="m"))
        return built[-1]

    def release() -> None:
        events.append("release")
        release_freed_memory()  # must not fail wherever the suite runs

    gate = GatedSleep()
    engine = SupervisedEngine(factory, RestartPolicy(health_interval=0.01), sleep=gate, release=release)
    await engine.start()
    try:
        built[0].kill()  # seen by the health check (no stream in flight to fail)
        async with asyncio.timeout(10):
            await gate.waiting.wait()
        assert events == ["built", "shutdown", "release"]
        gate.open()
        await wait_state(engine, "ready")
        assert events == ["built", "shutdown", "release", "built"]
    finally:
        gate.open()
        await engine.shutdown()
