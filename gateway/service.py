"""Running one planned generation request: engine call, streaming or whole response, outcome tracking.

The handlers in `routes.py` decode and plan; this module owns what happens after, so chat and legacy
completions share one path.
"""

from __future__ import annotations

import asyncio
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
from gateway.metering import charge_headers, reserve
from gateway.planning import Limits, Plan
from gateway.prompts import PromptRenderer
from gateway.responses import Formatter, sse
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.streaming import SSEResponse
from gateway.tracking import Outcome, OutcomeSink, RequestTracker
from policy.auth import Authenticator, Clock, Principal
from policy.quota.meter import Charge, QuotaMeter
from policy.tenants.base import TenantStore

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
        self,
        *,
        config: Config,
        engine: Engine,
        renderer: PromptRenderer,
        sink: OutcomeSink,
        tasks: TaskSet,
        tenants: TenantStore,
        auth: Authenticator,
        meter: QuotaMeter,
        clock: Clock,
    ) -> None:
        self.config = config
        self.engine = engine
        self.renderer = renderer
        self.sink = sink
        self.tasks = tasks
        self.tenants = tenants
        self.auth = auth
        self.meter = meter
        self.clock = clock
        self.limits = Limits(
            model_name=config.model.name,
            max_model_len=min(config.model.max_model_len, engine.max_model_len),
            default_max_tokens=config.model.default_max_tokens,
            max_logprobs=config.engine.max_logprobs,
        )
        self.chat_decoder = Decoder(ChatCompletionRequest)
        self.completion_decoder = Decoder(CompletionRequest)
        self.started = int(time.time())

    def _settle_on_outcome(self, charge: Charge) -> OutcomeSink:
        """The sink for one request: report the outcome, then settle its quota with the usage it had."""

        def sink(outcome: Outcome) -> None:
            self.sink(outcome)
            used = outcome.usage.prompt_tokens + outcome.usage.completion_tokens
            self.tasks.spawn(self.meter.settle(charge, used))

        return sink

    async def run(self, plan: Plan, request: Request[Any, Any, Any], principal: Principal) -> Response[Any]:
        """Reserve quota, generate for `plan`, and answer: one JSON body, or an SSE stream."""
        req = plan.engine_request
        charge = await reserve(self.meter, principal, plan)
        headers = charge_headers(charge)
        tracker = RequestTracker(
            req.request_id,
            self.limits.model_name,
            len(req.prompt_token_ids),
            plan.stream,
            self._settle_on_outcome(charge),
        )
        prefix = "chatcmpl-" if plan.kind == "chat" else "cmpl-"
        formatter = Formatter(plan, prefix + req.request_id, self.limits.model_name, int(time.time()))
        source = self.engine.generate(req)
        try:
            if not plan.stream:
                deltas = await race_disconnect(collect(source, tracker), request.receive)
                body = formatter.whole(deltas, tracker.usage())
                return Response(content=body, media_type=MediaType.JSON, headers=headers)
            stream = pump(source, tracker, self.tasks, self.config.server.stream_buffer)
            # Wait for the first delta before answering, so that an engine refusal is still an HTTP error.
            try:
                first = await race_disconnect(anext(stream), request.receive)
            except BaseException:
                await stream.aclose()
                raise
        except ClientDisconnectedError:
            # Idempotent: the tracked stream has normally recorded it already.
            tracker.finish("cancelled")
            return Response(content=b"", status_code=CLIENT_CLOSED)
        except asyncio.CancelledError:
            tracker.finish("cancelled")
            raise
        except BaseException as exc:
            # However it failed, the outcome is recorded and the reservation settled (first call wins).
            tracker.finish("error")
            if isinstance(exc, EngineError):
                raise engine_api_error(exc) from exc
            if isinstance(exc, StopAsyncIteration):
                raise EngineFailedError(
                    "the engine ended the request without output", code="engine_error"
                ) from exc
            raise
        return SSEResponse(
            _events(formatter, first, stream, tracker),
            stall_timeout=self.config.server.stream_stall_timeout,
            on_stall=tracker.mark_stalled,
            headers=headers,
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
