"""Running one planned generation request: engine call, streaming or whole response, outcome tracking.

The handlers in `routes.py` decode and plan; this module owns what happens after, so chat and legacy
completions share one path.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
from litestar import MediaType, Request, Response

from engines.base import (
    Engine,
    EngineDeadError,
    EngineDelta,
    EngineError,
    EngineOverloadedError,
    EngineRequestError,
)
from gateway.config import Config
from gateway.decoding import Decoder
from gateway.errors import APIError, EngineFailedError, EngineUnavailableError
from gateway.flow import ClientDisconnectedError, TaskSet, collect, pump, race_disconnect
from gateway.planning import Limits, Plan
from gateway.prompts import PromptRenderer
from gateway.responses import Formatter, sse
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.streaming import SSEResponse
from gateway.tracking import OutcomeSink, RequestTracker

_encoder = msgspec.json.Encoder()

# nginx's code for "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED = 499


def engine_api_error(exc: EngineError) -> APIError:
    """The HTTP error for an engine failure: capacity and death are 503 (retry later), the rest 502."""
    if isinstance(exc, EngineOverloadedError):
        return EngineUnavailableError(f"the engine is at capacity: {exc}", code="engine_overloaded")
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError("the engine is not available", code="engine_unavailable")
    if isinstance(exc, EngineRequestError):
        return EngineFailedError(f"the engine failed this request: {exc}", code="engine_error")
    return EngineFailedError(f"engine error: {exc}", code="engine_error")


class Services:
    """Everything a request needs, built once in the app lifespan."""

    def __init__(
        self, config: Config, engine: Engine, renderer: PromptRenderer, sink: OutcomeSink, tasks: TaskSet
    ) -> None:
        self.config = config
        self.engine = engine
        self.renderer = renderer
        self.sink = sink
        self.tasks = tasks
        self.limits = Limits(
            model_name=config.model.name,
            max_model_len=min(config.model.max_model_len, engine.max_model_len),
            default_max_tokens=config.model.default_max_tokens,
            max_logprobs=config.engine.max_logprobs,
        )
        self.chat_decoder = Decoder(ChatCompletionRequest)
        self.completion_decoder = Decoder(CompletionRequest)
        self.started = int(time.time())

    async def run(self, plan: Plan, request: Request[Any, Any, Any]) -> Response[Any]:
        """Generate for `plan` and answer: one JSON body, or an SSE stream."""
        req = plan.engine_request
        tracker = RequestTracker(
            req.request_id, self.limits.model_name, len(req.prompt_token_ids), plan.stream, self.sink
        )
        prefix = "chatcmpl-" if plan.kind == "chat" else "cmpl-"
        formatter = Formatter(plan, prefix + req.request_id, self.limits.model_name, int(time.time()))
        source = self.engine.generate(req)
        try:
            if not plan.stream:
                deltas = await race_disconnect(collect(source, tracker), request.receive)
                return Response(content=formatter.whole(deltas, tracker.usage()), media_type=MediaType.JSON)
            stream = pump(source, tracker, self.tasks, self.config.server.stream_buffer)
            # Wait for the first delta before answering, so that an engine refusal is still an HTTP error.
            try:
                first = await race_disconnect(anext(stream), request.receive)
            except BaseException:
                await stream.aclose()
                raise
        except EngineError as exc:
            raise engine_api_error(exc) from exc
        except StopAsyncIteration as exc:
            raise EngineFailedError(
                "the engine ended the request without output", code="engine_error"
            ) from exc
        except ClientDisconnectedError:
            # Idempotent: the tracked stream has normally recorded it already.
            tracker.finish("cancelled")
            return Response(content=b"", status_code=CLIENT_CLOSED)
        return SSEResponse(
            _events(formatter, first, stream, tracker),
            stall_timeout=self.config.server.stream_stall_timeout,
            on_stall=tracker.mark_stalled,
        )


async def _events(
    formatter: Formatter, first: EngineDelta, rest: AsyncGenerator[EngineDelta, None], tracker: RequestTracker
) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(rest):
        for event in formatter.opening():
            yield event
        for event in formatter.chunk(first):
            yield event
        try:
            async for delta in rest:
                for event in formatter.chunk(delta):
                    yield event
        except EngineError as exc:
            # The status line is long gone: report the error in the stream, as OpenAI does, and stop.
            yield sse(engine_api_error(exc).body())
            return
        for event in formatter.closing(tracker.usage()):
            yield event
