"""The Litestar application: built from a `Config`, with every backend created once in the lifespan."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide

from engines.base import Engine
from engines.supervisor import SupervisedEngine
from gateway.admin import ADMIN_ROUTES
from gateway.admin_registry import REGISTRY_ROUTES
from gateway.config import Config
from gateway.errors import exception_handlers
from gateway.generation.flow import TaskSet
from gateway.generation.prompts import PromptRenderer
from gateway.requestid import request_id_middleware
from gateway.routes import ROUTES
from gateway.security import provide_principal
from gateway.service import Services
from gateway.generation.tracking import OutcomeSink, log_outcome
from policy.auth import Authenticator, Clock
from policy.quota.base import QuotaStore
from policy.quota.meter import QuotaMeter
from policy.quota.settle import SettlePolicy
from policy.tenants.base import TenantStore
from registry.base import RegistryStore
from registry.default_model import register_default_model
from registry.default_policy import register_default_policy
from registry.manifest import apply_manifest_file
from registry.service import Registry


class ModelNotPreparedError(Exception):
    """The model directory is missing or incomplete."""


def build_engine(config: Config) -> SupervisedEngine:
    """The engine the configuration names (not started), under a supervisor that restarts it if it dies."""
    if config.engine.kind == "simulated":
        from engines.simulated import SimulatedEngine

        return SupervisedEngine(
            lambda: SimulatedEngine(config.engine.simulator, model_name=config.model.name),
            config.engine.supervisor,
        )
    from engines.vllm_local import VllmLocalEngine

    model_dir = config.model.model_dir()
    if not (model_dir / "config.json").is_file():
        raise ModelNotPreparedError(
            f"no prepared model in {model_dir}; run `lockgate models prepare` (or `make serve`) first"
        )
    engine = config.engine
    return SupervisedEngine(
        lambda: VllmLocalEngine(
            model_dir,
            model_name=config.model.name,
            max_model_len=config.model.max_model_len,
            dtype=engine.dtype,
            kv_cache_bytes=engine.kv_cache_bytes,
            max_logprobs=engine.max_logprobs,
            enforce_eager=engine.enforce_eager,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            step_target_s=engine.step_target,
        ),
        engine.supervisor,
    )


async def open_tenant_store(config: Config) -> TenantStore:
    """The tenant store the configuration names (SQLite file or PostgreSQL)."""
    if config.storage.backend == "postgres":
        from policy.tenants.postgres import PostgresTenantStore

        return await PostgresTenantStore.open(
            config.storage.postgres_dsn,
            schema=config.storage.postgres_schema,
            connect_timeout=config.storage.postgres_connect_timeout,
            command_timeout=config.storage.postgres_command_timeout,
        )
    from policy.tenants.sqlite import SqliteTenantStore

    return await SqliteTenantStore.open(await asyncio.to_thread(_sqlite_file, config.storage.sqlite_path))


def _sqlite_file(raw: str) -> Path:
    path = Path(raw).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


async def open_registry_store(config: Config) -> RegistryStore:
    """The registry store, in the same database as the tenant store."""
    if config.storage.backend == "postgres":
        from registry.postgres import PostgresRegistryStore

        return await PostgresRegistryStore.open(
            config.storage.postgres_dsn,
            schema=config.storage.postgres_schema,
            connect_timeout=config.storage.postgres_connect_timeout,
            command_timeout=config.storage.postgres_command_timeout,
        )
    from registry.sqlite import SqliteRegistryStore

    return await SqliteRegistryStore.open(await asyncio.to_thread(_sqlite_file, config.storage.sqlite_path))


async def _start_registry(config: Config, store: RegistryStore, clock: Clock) -> Registry:
    """Load the registry, register the served model directory and the default policy, apply the manifest."""
    registry = await Registry.load(
        store, clock, config.registry.refresh_interval, refresh_timeout=config.registry.refresh_timeout
    )
    await register_default_model(
        registry, config.model.model_dir(), public_name=config.model.name, actor="startup"
    )
    await register_default_policy(registry, actor="startup")
    if config.registry.manifest:
        path = await asyncio.to_thread(lambda: Path(config.registry.manifest).expanduser())
        await apply_manifest_file(registry, path, actor="manifest")
    await registry.refresh()
    return registry


def open_quota_store(config: Config) -> QuotaStore:
    """The quota store the configuration names (in memory, or Redis shared by replicas)."""
    if config.quota.backend == "redis":
        from policy.quota.redis import RedisQuotaStore

        return RedisQuotaStore.from_url(
            config.quota.redis_url,
            cluster=config.quota.redis_cluster,
            pool_size=config.quota.pool_size,
            pool_timeout=config.quota.pool_timeout,
            op_timeout=config.quota.op_timeout,
        )
    from policy.quota.memory import MemoryQuotaStore

    return MemoryQuotaStore()


def quota_meter(config: Config, store: QuotaStore, clock: Clock) -> QuotaMeter:
    """The meter over `store`, with the configured settlement retries."""
    policy = SettlePolicy(
        attempts=config.quota.settle_attempts,
        first_delay=config.quota.settle_backoff,
        max_delay=config.quota.settle_backoff_max,
    )
    return QuotaMeter(store, clock, settle_policy=policy)


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _services(state: State) -> Services:
    services: Services = state.services
    return services


def create_app(
    config: Config,
    *,
    engine: Engine | None = None,
    renderer: PromptRenderer | None = None,
    tenants: TenantStore | None = None,
    quota: QuotaStore | None = None,
    registry: RegistryStore | None = None,
    clock: Clock = time.time,
    sink: OutcomeSink = log_outcome,
) -> Litestar:
    """Build the app. Backends passed in (engine already started) are used as they are and not closed by the
    app; the others are built from `config` in the lifespan and closed at shutdown."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lockgate-tokenize")
        tasks = TaskSet()
        async with AsyncExitStack() as owned:
            owned.callback(executor.shutdown, wait=False, cancel_futures=True)
            store = tenants
            if store is None:
                store = await open_tenant_store(config)
                owned.push_async_callback(store.close)
            buckets = quota
            if buckets is None:
                buckets = open_quota_store(config)
                owned.push_async_callback(buckets.close)
            versions = registry
            if versions is None:
                versions = await open_registry_store(config)
                owned.push_async_callback(versions.close)
            live_registry = await _start_registry(config, versions, clock)
            owned.push_async_callback(_stop, asyncio.create_task(live_registry.run_refresher()))
            active = engine
            if active is None:
                active = build_engine(config)
                await active.start()
                owned.push_async_callback(active.shutdown)
            prompts = renderer or await PromptRenderer.load(config.model.model_dir(), executor)
            meter = quota_meter(config, buckets, clock)
            app.state.services = Services(
                config=config,
                engine=active,
                renderer=prompts,
                sink=sink,
                tasks=tasks,
                tenants=store,
                auth=Authenticator(
                    store,
                    clock,
                    config.auth.cache_ttl,
                    store_timeout=config.auth.store_timeout,
                    stale_grace=config.auth.stale_grace,
                    negative_ttl=config.auth.negative_ttl,
                ),
                meter=meter,
                registry=live_registry,
                clock=clock,
            )
            try:
                yield
            finally:
                # In-flight requests outlived the drain timeout: abort them, let their quota settle, then the
                # exit stack stops the engine and closes the stores.
                await tasks.cancel_all()
                await tasks.wait_all()
                # Settlements run in the meter's own tasks (never cancelled with the requests): wait for
                # them, bounded, while the quota store is still open.
                await meter.drain(config.quota.settle_drain_timeout)

    app = Litestar(
        route_handlers=[*ROUTES, *ADMIN_ROUTES, *REGISTRY_ROUTES],
        lifespan=[lifespan],
        dependencies={
            "services": Provide(_services, sync_to_thread=False),
            "principal": Provide(provide_principal),
        },
        exception_handlers=exception_handlers(),
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=None,
    )
    # Around the whole app, not per route: Litestar's route middleware never sees the router's own errors
    # (unknown route, wrong method), and those responses need an `x-request-id` too.
    app.asgi_handler = request_id_middleware(app.asgi_handler)
    return app
