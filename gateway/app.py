"""The Litestar application: built from a `Config`, with every backend created once in the lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide

from engines.base import Engine
from gateway.config import Config
from gateway.errors import exception_handlers
from gateway.flow import TaskSet
from gateway.prompts import PromptRenderer
from gateway.requestid import request_id_middleware
from gateway.routes import ROUTES
from gateway.service import Services
from gateway.tracking import OutcomeSink, log_outcome


class ModelNotPreparedError(Exception):
    """The model directory is missing or incomplete."""


def build_engine(config: Config) -> Engine:
    """The engine the configuration names (not started)."""
    if config.engine.kind == "simulated":
        from engines.simulated import SimulatedEngine

        return SimulatedEngine(config.engine.simulator, model_name=config.model.name)
    from engines.vllm_local import VllmLocalEngine

    model_dir = config.model.model_dir()
    if not (model_dir / "config.json").is_file():
        raise ModelNotPreparedError(
            f"no prepared model in {model_dir}; run `lockgate models prepare` (or `make serve`) first"
        )
    return VllmLocalEngine(
        model_dir,
        model_name=config.model.name,
        max_model_len=config.model.max_model_len,
        dtype=config.engine.dtype,
        kv_cache_bytes=config.engine.kv_cache_bytes,
        max_logprobs=config.engine.max_logprobs,
        enforce_eager=config.engine.enforce_eager,
    )


def _services(state: State) -> Services:
    services: Services = state.services
    return services


def create_app(
    config: Config,
    *,
    engine: Engine | None = None,
    renderer: PromptRenderer | None = None,
    sink: OutcomeSink = log_outcome,
) -> Litestar:
    """Build the app. An `engine` passed in is used as is (already started) and not shut down by the app."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lockgate-tokenize")
        tasks = TaskSet()
        own_engine = engine is None
        active = build_engine(config) if engine is None else engine
        try:
            prompts = renderer or await PromptRenderer.load(config.model.model_dir(), executor)
            if own_engine:
                await active.start()
            app.state.services = Services(config, active, prompts, sink, tasks)
            yield
        finally:
            # In-flight requests outlived the drain timeout: abort them, then stop the engine.
            await tasks.cancel_all()
            if own_engine:
                await active.shutdown()
            executor.shutdown(wait=False, cancel_futures=True)

    app = Litestar(
        route_handlers=ROUTES,
        lifespan=[lifespan],
        dependencies={"services": Provide(_services, sync_to_thread=False)},
        exception_handlers=exception_handlers(),
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=None,
    )
    # Around the whole app, not per route: Litestar's route middleware never sees the router's own errors
    # (unknown route, wrong method), and those responses need an `x-request-id` too.
    app.asgi_handler = request_id_middleware(app.asgi_handler)
    return app
