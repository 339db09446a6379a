"""The flow pieces on the simulator: bounded buffering, outcome tracking, racing a disconnect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar, cast

import pytest
from litestar.types import Receive

from engines.base import EngineDelta, EngineRequest, SamplingSpec
from engines.simulated import SimulatedEngine
from gateway.generation.flow import (
    ClientDisconnectedError,
    ClientWatch,
    TaskSet,
    client_watch,
    close_client_watch,
    collect,
    pump,
)
from gateway.generation.tracking import RequestTracker
from gateway.observe.outcome import Outcome
from tests.conftest import eventually

T = TypeVar("T")


def request(max_tokens: int, request_id: str = "r1") -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(range(100, 120)),
        sampling=SamplingSpec(max_tokens=max_tokens),
    )


class Counting:
    """A tracker that also counts the deltas it observes, with the outcomes it reported."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.tracker = _CountingTracker("r1", "m", 20, True, self.outcomes.append)

    @property
    def seen(self) -> int:
        return self.tracker.seen


class _CountingTracker(RequestTracker):
    seen = 0

    def observe(self, delta: EngineDelta, choice: int = 0) -> None:
        self.seen += 1
        super().observe(delta, choice)


async def engine_steps(engine: SimulatedEngine, count: int) -> None:
    """Wait until `engine` has stepped `count` more times (time for a pump to overrun, if it would)."""
    start = (await engine.load()).steps

    async def stepped() -> bool:
        return (await engine.load()).steps >= start + count

    await eventually(stepped)


async def closed_early(
    stream: AsyncGenerator[EngineDelta, None],
    tasks: TaskSet,
    counting: Counting,
    engine: SimulatedEngine,
    tokens: int,
) -> None:
    """Close `stream` (and its tasks) and check it ended cancelled after `tokens` tokens, its engine
    capacity freed."""
    await stream.aclose()
    await tasks.cancel_all()
    [outcome] = counting.outcomes
    assert outcome.status == "cancelled"
    assert outcome.usage.completion_tokens == tokens
    load = await engine.load()
    assert (load.running, load.waiting, load.kv_tokens_used) == (0, 0, 0)


async def test_pump_holds_at_most_its_buffer_while_the_client_does_not_read(
    sim_engine: SimulatedEngine,
) -> None:
    counting = Counting()
    tasks = TaskSet()
    stream = pump(sim_engine.generate(request(1000)), counting.tracker, tasks, maxsize=3)
    first = await anext(stream)
    assert first.token_ids

    async def buffer_full() -> bool:
        return counting.seen >= 5

    # 1 delivered + 3 queued + 1 waiting to be queued: the producer then stops pulling the engine.
    await eventually(buffer_full)
    await engine_steps(sim_engine, 50)  # every chance to overrun
    assert counting.seen == 5
    await closed_early(stream, tasks, counting, sim_engine, 5)


async def test_pump_without_a_buffer_reads_the_engine_only_as_the_client_takes_it(
    sim_engine: SimulatedEngine,
) -> None:
    counting = Counting()
    tasks = TaskSet()
    stream = pump(sim_engine.generate(request(1000)), counting.tracker, tasks, maxsize=0)
    for _ in range(3):
        await anext(stream)
    await engine_steps(sim_engine, 50)  # nothing pulls what the engine generates meanwhile
    assert counting.seen == 3
    await closed_early(stream, tasks, counting, sim_engine, 3)


@pytest.mark.parametrize("maxsize", [0, 2])
async def test_pump_delivers_everything_and_reports_completion(
    sim_engine: SimulatedEngine, maxsize: int
) -> None:
    counting = Counting()
    tasks = TaskSet()
    stream = pump(sim_engine.generate(request(12)), counting.tracker, tasks, maxsize=maxsize)
    deltas = [d async for d in stream]
    assert sum(len(d.token_ids) for d in deltas) == 12
    assert deltas[-1].finish_reason == "length"
    await tasks.cancel_all()
    [outcome] = counting.outcomes
    assert (outcome.status, outcome.finish_reason, outcome.usage.completion_tokens) == (
        "completed",
        "length",
        12,
    )


async def test_tracker_reports_once_and_marks_stalls() -> None:
    seen: list[Outcome] = []
    tracker = RequestTracker("r", "m", 7, True, seen.append)
    tracker.mark_stalled()
    first = tracker.finish("cancelled")
    again = tracker.finish("completed")
    assert first is again
    assert [o.status for o in seen] == ["stalled"]
    assert seen[0].usage.prompt_tokens == 7


def receive_when(left: asyncio.Event) -> Callable[[], Awaitable[dict[str, str]]]:
    """An ASGI `receive` whose client disconnects once `left` is set."""

    async def receive() -> dict[str, str]:
        await left.wait()
        return {"type": "http.disconnect"}

    return receive


async def race_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """`work` raced against the client leaving, on a watch of its own (as one request's waits share one)."""
    watch = ClientWatch(receive)
    try:
        return await watch.race(work)
    finally:
        watch.close()


@pytest.mark.parametrize("ender", ["client", "shutdown"])
async def test_race_disconnect_cancels_the_work_and_aborts_the_engine_request(
    sim_engine: SimulatedEngine, ender: str
) -> None:
    # A client that leaves ends the race with ClientDisconnectedError; a shutdown that cancels the request's
    # task is a cancellation, not a client that left. Either way the engine request is aborted.
    counting = Counting()
    left = asyncio.Event()
    work = collect(sim_engine.generate(request(1000)), counting.tracker)
    racing = asyncio.create_task(race_disconnect(work, receive_when(left)))  # type: ignore[arg-type]

    async def generating() -> bool:
        return counting.seen > 0

    await eventually(generating)
    expected: type[BaseException] = ClientDisconnectedError
    if ender == "client":
        left.set()
    else:
        racing.cancel()
        expected = asyncio.CancelledError
    with pytest.raises(expected):
        await racing
    assert [o.status for o in counting.outcomes] == ["cancelled"]
    load = await sim_engine.load()
    assert (load.running, load.waiting) == (0, 0)


async def test_race_disconnect_returns_the_result_when_the_client_stays(sim_engine: SimulatedEngine) -> None:
    counting = Counting()
    receive = receive_when(asyncio.Event())
    deltas = await race_disconnect(collect(sim_engine.generate(request(4)), counting.tracker), receive)  # type: ignore[arg-type]
    assert sum(len(d.token_ids) for d in deltas) == 4
    assert [o.status for o in counting.outcomes] == ["completed"]


async def test_race_disconnect_reports_the_client_gone_even_if_the_work_swallows_the_cancel() -> None:
    gone = {"type": "http.disconnect"}

    async def receive() -> dict[str, str]:
        return gone

    async def stubborn() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "finished anyway"
        return "never"

    async def caller() -> int:
        with pytest.raises(ClientDisconnectedError):
            await race_disconnect(stubborn(), receive)  # type: ignore[arg-type]
        # No cancellation is left pending on the caller's task: it can go on awaiting (to record the end).
        await asyncio.sleep(0)
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()

    assert await asyncio.create_task(caller()) == 0


async def test_a_disconnect_after_the_work_finished_cancels_nothing() -> None:
    left = asyncio.Event()

    async def caller() -> str:
        result = await race_disconnect(asyncio.sleep(0, "done"), receive_when(left))  # type: ignore[arg-type]
        left.set()  # the client leaves once the work is over: the caller must not be cancelled for it
        for _ in range(5):
            await asyncio.sleep(0)
        return result

    assert await caller() == "done"


async def test_one_watch_serves_every_wait_of_a_request_and_ends_with_it() -> None:
    left = asyncio.Event()
    reads = 0

    async def receive() -> Any:
        nonlocal reads
        reads += 1
        await left.wait()
        return {"type": "http.disconnect"}

    scope: Any = {"type": "http", "state": {}}
    watch = client_watch(scope, receive)
    assert client_watch(scope, receive) is watch
    assert await watch.race(asyncio.sleep(0, "admitted")) == "admitted"
    assert await watch.race(asyncio.sleep(0, "first delta")) == "first delta"
    assert reads == 1  # one watcher for both waits, still reading
    waiting = asyncio.create_task(watch.race(asyncio.Event().wait()))
    await asyncio.sleep(0)
    left.set()
    with pytest.raises(ClientDisconnectedError):
        await waiting
    # Gone between waits: the next one is refused at once, its work never started.
    started = False

    async def work() -> None:
        nonlocal started
        started = True

    with pytest.raises(ClientDisconnectedError):
        await watch.race(work())
    assert not started
    assert reads == 1


async def test_closing_a_watch_stops_its_watcher_and_cancels_nobody() -> None:
    read = asyncio.Event()
    stopped = asyncio.Event()

    async def receive() -> Any:
        read.set()
        try:
            await asyncio.Event().wait()  # the client stays
        finally:
            stopped.set()

    scope: Any = {"type": "http", "state": {}}
    watch = client_watch(scope, receive)
    assert await watch.race(asyncio.sleep(0, 1)) == 1
    await read.wait()
    close_client_watch(scope)
    close_client_watch(cast(Any, {"type": "http"}))  # a request that never watched its client: nothing to end
    await asyncio.wait_for(stopped.wait(), 5)  # the watcher's read was cancelled
    assert not watch.gone
    for _ in range(3):
        await asyncio.sleep(0)  # and nobody was cancelled for it: this task goes on


@pytest.mark.parametrize("maxsize", [0, 3])
async def test_an_unexpected_error_between_engine_and_client_reaches_the_consumer(
    sim_engine: SimulatedEngine, maxsize: int
) -> None:
    # A transform (the output guard) that breaks must not leave the consumer waiting on a dead producer.
    async def broken(deltas: AsyncGenerator[EngineDelta, None]) -> AsyncGenerator[EngineDelta, None]:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta
                raise RuntimeError("moderator bug")

    counting = Counting()
    tasks = TaskSet()
    stream = pump(
        sim_engine.generate(request(100)), counting.tracker, tasks, maxsize=maxsize, transform=broken
    )
    await anext(stream)
    with pytest.raises(RuntimeError, match="moderator bug"):
        await anext(stream)
    await stream.aclose()
    await tasks.wait_all()
    # The engine request was closed (aborted) and its outcome recorded as an error.
    assert [o.status for o in counting.outcomes] == ["error"]
