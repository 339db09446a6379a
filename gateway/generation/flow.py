"""Engine output on its way to the client: tracking, bounded buffering, and racing client disconnects.

Every path ends the engine stream with `aclose()`, which aborts the engine request if it has not finished, and
reports the request's outcome (with the usage it had by then) exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, TypeVar

import msgspec
from litestar.types import Receive, Scope

from engines.base import EngineDelta
from gateway.generation.confidence import LowConfidence
from gateway.generation.tracking import RequestTracker

# What stands between the tracked engine stream and the client (the output guard), if anything.
from policy.safety.output import Transform

T = TypeVar("T")
_END = object()


# One request's engine output: one stream, or one per choice (n > 1).
Source = AsyncGenerator[EngineDelta, None] | Sequence[AsyncGenerator[EngineDelta, None]]


def _through(
    source: Source, tracker: RequestTracker, transform: Transform | None
) -> AsyncGenerator[EngineDelta, None]:
    """Each choice counted as the engine produced it, then through `transform` (the output guard, which
    judges each choice on its own text), tagged with its index and merged; the request's outcome recorded
    once, however the merged stream ends."""
    streams = [source] if isinstance(source, AsyncGenerator) else list(source)
    if len(streams) == 1 and transform is None:
        return _ended(streams[0], tracker, counted=True)  # one layer fewer for each delta to pass
    choices = [
        _choice(stream, i, tracker, transform, tag=len(streams) > 1) for i, stream in enumerate(streams)
    ]
    return _ended(choices[0] if len(choices) == 1 else merged(choices), tracker)


def _choice(
    source: AsyncGenerator[EngineDelta, None],
    index: int,
    tracker: RequestTracker,
    transform: Transform | None,
    *,
    tag: bool,
) -> AsyncGenerator[EngineDelta, None]:
    deltas = _counted(source, tracker, index)
    if transform is not None:
        deltas = transform(deltas)
    return _tagged(deltas, index) if tag else deltas


async def _counted(
    source: AsyncGenerator[EngineDelta, None], tracker: RequestTracker, choice: int
) -> AsyncGenerator[EngineDelta, None]:
    """Count each delta of choice `choice` as the engine sent it (every choice's engine request is one of
    a single choice: its deltas say index 0 until they are tagged)."""
    async with contextlib.aclosing(source):
        async for delta in source:
            tracker.observe(delta, choice)
            yield delta


async def _tagged(source: AsyncGenerator[EngineDelta, None], index: int) -> AsyncGenerator[EngineDelta, None]:
    async with contextlib.aclosing(source):
        async for delta in source:
            yield msgspec.structs.replace(delta, index=index)


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


async def _ended(
    source: AsyncGenerator[EngineDelta, None], tracker: RequestTracker, *, counted: bool = False
) -> AsyncGenerator[EngineDelta, None]:
    """Pass deltas through (counting each one with `counted`, as `_counted` does); record how the stream
    ended; closing it early aborts the engine request(s)."""
    async with _Recorded(source, tracker):
        async for delta in source:
            if counted:
                tracker.observe(delta)
            yield delta


class _Recorded:
    """Around the reading of a tracked engine stream: records how it ended on the tracker (cancelled, error,
    completed) and closes the stream (which aborts the engine request if it has not finished)."""

    __slots__ = ("_source", "_tracker")

    def __init__(self, source: AsyncGenerator[EngineDelta, None], tracker: RequestTracker) -> None:
        self._source = source
        self._tracker = tracker

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        if kind is not None:
            if issubclass(kind, (asyncio.CancelledError, GeneratorExit)):
                self._tracker.finish("cancelled")
            elif issubclass(kind, LowConfidence):
                # A route's cascade ended it unreleased: the strong model answers the request.
                self._tracker.finish("escalated")
            elif issubclass(kind, Exception):
                # An engine error, or a failure between engine and client (an output block recorded itself).
                self._tracker.finish("error")
        await self._source.aclose()
        if kind is None:
            self._tracker.finish("completed")


async def merged(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
    """The items of all `streams` as they come (one task per stream). The first exception of any stream
    ends the merge; closing it closes every stream."""
    queue: asyncio.Queue[object] = asyncio.Queue(len(streams))

    async def drain(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put(item)
            await queue.put(_END)
        except Exception as exc:
            await queue.put(_Failed(exc))

    tasks = [asyncio.ensure_future(drain(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Failed:
    """An exception one merged stream ended with (a stream may yield exceptions as items)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


async def collect(
    source: Source, tracker: RequestTracker, transform: Transform | None = None
) -> list[EngineDelta]:
    """All deltas of a request (non-streaming responses)."""
    deltas: list[EngineDelta] = []
    if isinstance(source, AsyncGenerator) and transform is None:
        # One choice as the engine sent it: read here, as `_ended` would (one generator fewer per delta).
        async with _Recorded(source, tracker):
            async for delta in source:
                tracker.observe(delta)
                deltas.append(delta)
        return deltas
    async with contextlib.aclosing(_through(source, tracker, transform)) as through:
        async for delta in through:
            deltas.append(delta)
    return deltas


async def _produce(deltas: AsyncGenerator[EngineDelta, None], queue: asyncio.Queue[object]) -> None:
    try:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                await queue.put(delta)
        await queue.put(_END)
    except Exception as exc:
        # Handed to the consumer, which raises it: a producer that died silently would leave it waiting.
        await queue.put(exc)


def pump(
    source: Source,
    tracker: RequestTracker,
    tasks: TaskSet,
    maxsize: int,
    transform: Transform | None = None,
) -> AsyncGenerator[EngineDelta, None]:
    """The engine's deltas for a stream, read at most `maxsize` ahead of the consumer.

    0: none; the consumer pulls the tracked engine stream itself, so the engine is read only as fast as the
    client takes what it sends (no task, no queue: each delta wakes one task, not two). Over 0: a producer
    task fills a queue of `maxsize` deltas and stops pulling the engine stream while it is full. Either way
    memory per stream stays bounded whatever the client does, and closing the stream aborts the engine
    request (over 0, by cancelling the producer).
    """
    tracked = _through(source, tracker, transform)
    return tracked if maxsize == 0 else _buffered(tracked, tasks, maxsize)


async def _buffered(
    tracked: AsyncGenerator[EngineDelta, None], tasks: TaskSet, maxsize: int
) -> AsyncGenerator[EngineDelta, None]:
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize)
    producer = tasks.spawn(_produce(tracked, queue))
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


_WATCH_KEY = "lockgate_client_watch"


class ClientWatch:
    """Whether one request's client has left: one watcher task reading `receive` for the whole request
    (started by the first `race`, ended by `close`), however many waits race it (admission, the engine,
    the stream's first delta, the stream's body)."""

    __slots__ = ("_cut", "_racer", "_receive", "_task", "gone")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[None] | None = None
        # The task inside `race` now, and whether the watcher cancelled it.
        self._racer: asyncio.Task[Any] | None = None
        self._cut = False
        self.gone = False

    async def race(self, work: Awaitable[T]) -> T:
        """Await `work` unless the client leaves first; then cancel it and raise ClientDisconnectedError.

        `work` runs in the calling task (no task of its own); a client that left before is reported at once
        (`work` is not run). A cancellation from elsewhere (shutdown) still propagates as such.
        """
        caller = asyncio.current_task()
        assert caller is not None, "a race runs in a task"
        assert self._racer is None, "races of one request do not nest"
        if self.gone:
            if inspect.iscoroutine(work):
                work.close()
            raise ClientDisconnectedError
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(_until_disconnected(self._receive))
            self._task.add_done_callback(self._watched)
        self._racer, self._cut = caller, False
        try:
            result = await work
        except asyncio.CancelledError:
            if self._cut and caller.uncancel() == 0:
                raise ClientDisconnectedError from None
            raise
        finally:
            self._racer = None
        if self._cut:  # `work` swallowed the cancellation and finished anyway
            caller.uncancel()
            raise ClientDisconnectedError
        return result

    def _watched(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        task.exception()  # retrieved: a `receive` that fails counts as the client gone, as a disconnect
        self.gone = True
        if self._racer is not None:
            self._cut = True
            self._racer.cancel()

    def close(self) -> None:
        """The request is over: stop watching."""
        if self._task is not None:
            self._task.cancel()


def client_watch(scope: Scope, receive: Receive) -> ClientWatch:
    """The watch of the request of this scope (made at the first call; `close_client_watch` ends it)."""
    state = scope.setdefault("state", {})
    watch = state.get(_WATCH_KEY)
    if watch is None:
        watch = state[_WATCH_KEY] = ClientWatch(receive)
    assert isinstance(watch, ClientWatch)
    return watch


def close_client_watch(scope: Scope) -> None:
    """End the watch of the request of this scope, if it has one (its response has been sent)."""
    watch = scope.get("state", {}).get(_WATCH_KEY)
    if watch is not None:
        watch.close()
