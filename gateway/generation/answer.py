"""The generation stage of an admitted request: the engine's output, through the output guard, to the client
as one JSON answer or as a stream of SSE events.

Output is released to the client only after the output guard checked it, as generated and with its JSON
escapes resolved (as the client's decoder reads tool-call arguments and structured output); a block ends the
stream with `finish_reason: content_filter` and an error event, and aborts the engine request. An engine
failure before the status line is an HTTP error (`engine_api_error`); after it, an error event.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from litestar import MediaType, Response

from engines.base import (
    EngineDeadError,
    EngineDelta,
    EngineError,
    EngineOverloadedError,
    EngineRequestError,
)
from gateway.errors import APIError, EngineFailedError, EngineUnavailableError, retry_after_headers
from gateway.generation.context import Generation
from gateway.generation.flow import ClientWatch, Source, collect, pump
from gateway.generation.guarding import GUARD_HEADER, output_error
from gateway.generation.responses import Formatter, sse
from gateway.generation.streaming import SSEResponse
from gateway.generation.tracking import RequestTracker
from gateway.observe.timeline import RequestTimeline
from guard.moderator import OutputBlocked
from policy.safety.decision import GuardDecision
from policy.safety.output import OutputGuard, Transform


def engine_api_error(exc: EngineError) -> APIError:
    """The HTTP error for an engine failure: capacity and death are 503 (retry later), the rest 502."""
    if isinstance(exc, EngineOverloadedError):
        return EngineUnavailableError(
            f"the engine is at capacity: {exc}",
            code="engine_overloaded",
            headers=retry_after_headers(exc.retry_after or 1),
        )
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError(
            f"the engine is not available: {exc}",
            code="engine_unavailable",
            headers=retry_after_headers(exc.retry_after or 1),
        )
    if isinstance(exc, EngineRequestError):
        return EngineFailedError(f"the engine failed this request: {exc}", code="engine_error")
    return EngineFailedError(f"engine error: {exc}", code="engine_error")


async def answer(
    gen: Generation,
    source: Source,
    tracker: RequestTracker,
    output: OutputGuard | None,
    watch: ClientWatch,
    formatter: Formatter,
    headers: dict[str, str],
    labels: list[str],
    timeline: RequestTimeline,
    *,
    stream: bool,
    gate: Transform | None = None,
) -> Response[Any]:
    """The response to an admitted request: a whole answer, or a stream once its first delta is released.
    `labels`: the guard header's input part. `gate`: a route's confidence gate, before the output guard."""
    try:
        transform = _transform(gate, output, whole=not stream)
        if not stream:
            return await _whole(source, tracker, output, transform, watch, formatter, headers, labels)
        return await _streamed(
            gen, source, tracker, output, transform, watch, formatter, headers, labels, timeline
        )
    except EngineError as exc:
        raise engine_api_error(exc) from exc
    except StopAsyncIteration as exc:
        raise EngineFailedError("the engine ended the request without output", code="engine_error") from exc


def _transform(gate: Transform | None, output: OutputGuard | None, *, whole: bool) -> Transform | None:
    """The output guard's transform, after `gate` when there is one."""
    guard = output.transform(whole=whole) if output else None
    if gate is None or guard is None:
        return gate or guard

    def gated(deltas: AsyncGenerator[EngineDelta, None]) -> AsyncGenerator[EngineDelta, None]:
        return guard(gate(deltas))

    return gated


async def _whole(
    source: Source,
    tracker: RequestTracker,
    output: OutputGuard | None,
    transform: Transform | None,
    watch: ClientWatch,
    formatter: Formatter,
    headers: dict[str, str],
    labels: list[str],
) -> Response[Any]:
    try:
        deltas = await watch.race(collect(source, tracker, transform))
        filtered = False
    except OutputBlocked as blocked:
        deltas, filtered = [], True
        if blocked.decision.action == "refuse":
            raise output_error(blocked.decision) from None
    if output is not None and output.decision is not None:
        labels = [*labels, output.decision.label]
    headers[GUARD_HEADER] = "; ".join(labels)
    body = formatter.whole(deltas, tracker.usage(), filtered=filtered)
    return Response(content=body, media_type=MediaType.JSON, headers=headers)


async def _streamed(
    gen: Generation,
    source: Source,
    tracker: RequestTracker,
    output: OutputGuard | None,
    transform: Transform | None,
    watch: ClientWatch,
    formatter: Formatter,
    headers: dict[str, str],
    labels: list[str],
    timeline: RequestTimeline,
) -> Response[Any]:
    headers[GUARD_HEADER] = "; ".join([*labels, "output=stream" if output else "output=off"])
    server = gen.config.server
    stream = pump(source, tracker, gen.tasks, server.stream_buffer, transform)
    # Wait for the first released delta before answering: an engine refusal is still an HTTP error.
    first: EngineDelta | OutputBlocked[GuardDecision]
    try:
        first = await watch.race(anext(stream))
        timeline.released()
    except OutputBlocked as blocked:
        first = blocked
    except BaseException:
        await stream.aclose()
        raise
    return SSEResponse(
        _events(formatter, first, stream, tracker),
        watch=watch,
        stall_timeout=server.stream_stall_timeout,
        on_stall=tracker.mark_stalled,
        headers=headers,
    )


async def _events(
    formatter: Formatter,
    first: EngineDelta | OutputBlocked[GuardDecision],
    rest: AsyncGenerator[EngineDelta, None],
    tracker: RequestTracker,
) -> AsyncIterator[bytes]:
    """The stream's SSE events. Those ready at one moment leave in one write: the opening with the first
    delta's, each delta's (a last token and its finish), the closing ones (usage and `[DONE]`)."""
    async with contextlib.aclosing(rest):
        pending = formatter.opening()  # ready, not yet sent
        try:
            if isinstance(first, OutputBlocked):
                raise first
            if ready := b"".join([*pending, *formatter.chunk(first)]):
                yield ready
            pending = []
            async for delta in rest:
                if events := formatter.chunk(delta):
                    yield b"".join(events)
            pending += formatter.closing(tracker.usage())
        except OutputBlocked as blocked:
            # Nothing of the blocked text was released; say why the stream ends, as OpenAI's filters do.
            pending += [*formatter.filtered(), sse(output_error(blocked.decision).body())]
        except EngineError as exc:
            # The status line is long gone: report the error in the stream, as OpenAI does, and stop.
            pending.append(sse(engine_api_error(exc).body()))
        yield b"".join(pending)
