"""Engine output on its way to the client: tracking, bounded buffering, and racing client disconnects.

Every path ends the engine stream with `aclose()`, which aborts the engine request if it has not finished, and
reports the request's outcome (with the usage it had by then) exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from litestar.types import Receive

from engines.base import EngineDelta, EngineError
from gateway.generation.tracking import RequestTracker

T = TypeVar("T")
_END = object()
# What stands between the tracked engine stream and the client (the output guard), if anything.
Transform = Callable[[AsyncGenerator[EngineDelta, None]], AsyncGenerator[EngineDelta, None]]


def _through(
    source: AsyncGenerator[EngineDelta, None], tracker: RequestTracker, transform: Transform | None
) -> AsyncGenerator[EngineDelta, None]:
    deltas = tracked(source, tracker)
    return deltas if transform is None else transform(deltas)


class ClientDisconnectedError(Exception):
    """The client went away before the response could be sent."""


class TaskSet:
    """Background tasks that must stay referenced until they finish (asyncio keeps only weak references)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Start `coro` as a task and keep it until it is done."""
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_all(self) -> None:
        """Cancel every task and wait for them to finish."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait_all(self) -> None:
        """Wait for every task, including those started while waiting (each must bound its own time)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def tracked(
    source: AsyncGenerator[EngineDelta, None], tracker: RequestTracker
) -> AsyncGenerator[EngineDelta, None]:
    """Pass deltas through, counting them; record how the stream ended; abort the engine request if early."""
    try:
        async for delta in source:
            tracker.observe(delta)
            yield delta
    except EngineError:
        tracker.finish("error")
        raise
    except (asyncio.CancelledError, GeneratorExit):
        tracker.finish("cancelled")
        raise
    finally:
        await source.aclose()
    tracker.finish("completed")


async def collect(
    source: AsyncGenerator[EngineDelta, None], tracker: RequestTracker, transform: Transform | None = None
) -> list[EngineDelta]:
    """All deltas of a request (non-streaming responses)."""
    async with contextlib.aclosing(_through(source, tracker, transform)) as deltas:
        return [delta async for delta in deltas]


async def _produce(deltas: AsyncGenerator[EngineDelta, None], queue: asyncio.Queue[object]) -> None:
    try:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                await queue.put(delta)
        await queue.put(_END)
    except Exception as exc:
        # Handed to the consumer, which raises it: a producer that died silently would leave it waiting.
        await queue.put(exc)


async def pump(
    source: AsyncGenerator[EngineDelta, None],
    tracker: RequestTracker,
    tasks: TaskSet,
    maxsize: int,
    transform: Transform | None = None,
) -> AsyncGenerator[EngineDelta, None]:
    """Yield the engine's deltas through a queue of at most `maxsize` items, filled by a producer task.

    When the queue is full the producer stops pulling the engine stream, so memory per stream stays bounded
    whatever the client does. Closing this generator cancels the producer, which aborts the engine request.
    """
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize)
    producer = tasks.spawn(_produce(_through(source, tracker, transform), queue))
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            assert isinstance(item, EngineDelta)
            yield item
    finally:
        # Not awaited: this may run inside a cancelled scope; the producer records the outcome itself.
        producer.cancel()


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Await `work` unless the client disconnects first; then cancel it and raise ClientDisconnectedError."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnectedError
    return task.result()
