"""Running one planned generation request: engine call, streaming or whole response, outcome tracking.

The handlers in `routes.py` decode and plan; this module owns what happens after, so chat and legacy
completions share one path.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
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
from engines.supervisor import SupervisedEngine
from gateway.config import Config
from gateway.decoding import Decoder
from gateway.errors import (
    APIError,
    EngineFailedError,
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
)
from gateway.generation.flow import ClientDisconnectedError, TaskSet, collect, pump, race_disconnect
from gateway.generation.metering import charge_headers, reserve
from gateway.generation.planning import Limits, Plan
from gateway.generation.prompts import PromptRenderer
from gateway.generation.responses import Formatter, sse
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.generation.streaming import SSEResponse
from gateway.generation.tracking import Outcome, OutcomeSink, RequestTracker
from policy.auth import Authenticator, Clock, Principal
from policy.quota.meter import Charge, QuotaMeter
from policy.tenants.base import TenantStore
from registry.base import InvalidError as RegistryInvalidError
from registry.base import NotFoundError as RegistryNotFoundError
from registry.service import Registry
from registry.view import ResolvedModel

_encoder = msgspec.json.Encoder()

DEFAULT_POOL = "default"
# Names the exact model version (name@version) that served a response.
MODEL_HEADER = "x-lockgate-model"

# nginx's code for "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED = 499


def engine_api_error(exc: EngineError) -> APIError:
    """The HTTP error for an engine failure: capacity and death are 503 (retry later), the rest 502."""
    if isinstance(exc, EngineOverloadedError):
        return EngineUnavailableError(
            f"the engine is at capacity: {exc}",
            code="engine_overloaded",
            headers={"Retry-After": str(max(1, math.ceil(exc.retry_after or 1)))},
        )
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError(
            f"the engine is not available: {exc}",
            code="engine_unavailable",
            headers={"Retry-After": str(max(1, math.ceil(exc.retry_after or 1)))},
        )
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
        registry: Registry,
        clock: Clock,
    ) -> None:
        self.config = config
        self.engine = engine
        # Engine pools by name; a model version names the pool that serves it. One embedded engine: "default".
        self.pools: dict[str, Engine] = {DEFAULT_POOL: engine}
        self.renderer = renderer
        self.sink = sink
        self.tasks = tasks
        self.tenants = tenants
        self.auth = auth
        self.meter = meter
        self.registry = registry
        self.clock = clock
        self.chat_decoder = Decoder(ChatCompletionRequest)
        self.completion_decoder = Decoder(CompletionRequest)
        self.started = int(time.time())

    def unrecoverable(self) -> str:
        """Why this gateway cannot recover without a restart of its process ("" while it can)."""
        engine = self.engine
        if isinstance(engine, SupervisedEngine) and not engine.alive:
            return f"engine {engine.replica_id} could not be restarted: {engine.last_error}"
        return ""

    def target(self, model_name: str, request_id: str) -> tuple[ResolvedModel, Limits]:
        """The model version `model_name` means for this request (one registry view), and its limits."""
        try:
            model = self.registry.view.resolve_model(model_name, request_id)
        except RegistryNotFoundError as exc:
            raise NotFoundError(
                f"model `{model_name}` does not exist: {exc}", param="model", code="model_not_found"
            ) from exc
        except RegistryInvalidError as exc:
            raise InvalidRequestError(
                f"bad model reference: {exc}", param="model", code="invalid_value"
            ) from exc
        engine = self.pools.get(model.spec.engine_pool)
        if engine is None:
            raise EngineUnavailableError(
                f"no engine serves pool `{model.spec.engine_pool}` of {model.ref}", code="no_engine_for_pool"
            )
        limits = Limits(
            max_model_len=min(
                self.config.model.max_model_len, engine.max_model_len, model.spec.arch.max_context
            ),
            default_max_tokens=self.config.model.default_max_tokens,
            max_logprobs=self.config.engine.max_logprobs,
        )
        return model, limits

    def _settle_on_outcome(self, charge: Charge) -> OutcomeSink:
        """The sink for one request: report the outcome, then settle its quota with the usage it had."""

        def sink(outcome: Outcome) -> None:
            self.sink(outcome)
            used = outcome.usage.prompt_tokens + outcome.usage.completion_tokens
            # The meter's own task, not the request TaskSet: shutdown cancels those, and drains these.
            self.meter.settle_later(charge, used)

        return sink

    async def run(self, plan: Plan, request: Request[Any, Any, Any], principal: Principal) -> Response[Any]:
        """Reserve quota, generate for `plan`, and answer: one JSON body, or an SSE stream."""
        req = plan.engine_request
        charge = await reserve(self.meter, principal, plan)
        headers = charge_headers(charge)
        headers[MODEL_HEADER] = plan.model.ref
        tracker = RequestTracker(
            plan.request_id,
            plan.model.ref,
            len(req.prompt_token_ids),
            plan.stream,
            self._settle_on_outcome(charge),
            tokenizer=plan.model.tokenizer.ref,
            chat_template=plan.model.chat_template.ref,
        )
        prefix = "chatcmpl-" if plan.kind == "chat" else "cmpl-"
        formatter = Formatter(plan, prefix + plan.request_id, plan.model_name, int(time.time()))
        source = self.pools[plan.model.spec.engine_pool].generate(req)
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
