"""The Litestar application: built from a `Config`, with every backend created once in the lifespan."""

from __future__ import annotations

import asyncio
import gc
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.logging.config import LoggingConfig

from engines.base import Engine
from gateway import api, audit_keys
from gateway.api.openapi import openapi_config
from gateway.config import Config
from gateway.console import pages as console
from gateway.console.sessions import open_session_store
from gateway.edge.handlers import exception_handlers
from gateway.edge.security import provide_principal
from gateway.edge.stack import Gateway
from gateway.embeddings import Embedders, register_packaged_encoder
from gateway.fleet import (
    ModelNotPreparedError,
    build_engine,
    capacity_ledger,
    lease_holder,
    model_dir,
    shared_counters,
    start_fleet,
)
from gateway.generation import tools as tool_parsers
from gateway.generation.context import RouteCounts
from gateway.generation.flow import TaskSet
from gateway.generation.prompts import PromptRenderer
from gateway.generation.renderers import RendererCache, renderer_key
from gateway.generation.tracking import OutcomeSink, discard_outcome
from gateway.guard_factory import GuardFactory
from gateway.idempotency import open_idempotency
from gateway.observe.collectors import ServiceCollector
from gateway.observe.metrics import tenant_labels
from gateway.observe.multiproc import CollectorMirror, repeat
from gateway.observe.observer import RequestObserver
from gateway.overload import LoopLagMonitor, OverloadGate
from gateway.publish_check import PublishCheck
from gateway.result_cache import open_result_cache
from gateway.secret import load_secret
from gateway.services import Services
from gateway.sessions import open_sessions
from guard.default_guard import judge_spec
from policy.appeals import APPEAL_STORE
from policy.audit import AUDIT_STORE
from policy.audit.base import AuditStore
from policy.audit.keys import MacKey
from policy.audit.refusals import RefusalTally
from policy.audit.retention import RetainedAuditStore, run_retention
from policy.audit.writer import AuditWriter
from policy.auth import Authenticator
from policy.auth_limit import FailedAuthLimit
from policy.clock import Clock
from policy.quota.base import QuotaStore
from policy.quota.lease import LeasedQuotaStore
from policy.quota.meter import QuotaMeter
from policy.quota.settle import SettlePolicy
from policy.safety.decision import DurableSink, GuardRecord, RecordSink
from policy.safety.defaults import DEFAULT_POLICY, TrainedGuards, register_default_policy
from policy.safety.gate import SafetyGate
from policy.safety.records import audit_draft, log_record
from policy.tenants import TENANT_STORE
from policy.tenants.base import TenantStore
from registry.base import RegistryStore
from registry.db.stores import open_store
from registry.default_model import register_default_model
from registry.manifest import apply_manifest_file
from registry.service import Registry
from registry.store import REGISTRY_STORE
from registry.view import ResolvedPolicy
from routing.guard_calls import by_pool
from routing.router import Router
from routing.scheduler import Scheduler

if TYPE_CHECKING:  # the OpenTelemetry SDK is imported only when tracing or the OTLP metrics push is on
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.trace.export import SpanExporter

    from gateway.observe.otlp_metrics import MetricsPusher

# Guard model name of the zero-shot one-token judge on the served model (one version per served version).
ZERO_SHOT_JUDGE = "zero-shot-judge"


async def _guard_pools(
    config: Config, policy: ResolvedPolicy, pools: dict[str, Engine], owned: AsyncExitStack
) -> int:
    """Start an engine for every pool the policy's guards run on that nothing serves yet; how many."""
    started = 0
    for guard in policy.guards:
        model = guard.model
        if model is None or model.spec.engine_pool in pools:
            continue
        pool = model.spec.engine_pool
        engine = build_engine(config, model_dir(config, model), name=model.ref)
        await engine.start()
        owned.push_async_callback(engine.shutdown)
        pools[pool] = engine
        started += 1
    return started


def _cpu_is_requests_own(config: Config, guard_engines: int, *, given_engine: bool) -> bool:
    """Whether this process's CPU goes to its requests alone, which `overload.cpu_shedding = "auto"` turns the
    CPU signal on for: every engine a remote vLLM server or the simulator (whose tokens are made on the event
    loop, for the requests it serves), no guard engine given or started in this process, and no engine
    handed in by the caller (of unknown kind: a test's, sharing the loop with the test itself)."""
    if given_engine or guard_engines:
        return False
    if not config.engines:
        return config.engine.kind == "simulated"
    return all(s.kind in ("vllm_remote", "simulated") for s in config.engines)


async def _audit_writer(
    config: Config, store: AuditStore, key: MacKey, clock: Clock, owned: AsyncExitStack
) -> AuditWriter:
    """The write-behind writer of gate decisions (its spool replayed first), flushed at shutdown."""
    audit = config.audit
    writer = AuditWriter(
        store,
        audit.spool_path(config.storage),
        clock=clock,
        batch_size=audit.batch_size,
        flush_interval=audit.flush_interval,
        buffer_size=audit.buffer_size,
        spool_max_bytes=audit.spool_max_bytes,
        mac_key=key,
    )
    await writer.start()
    owned.push_async_callback(writer.close, audit.close_timeout)
    return writer


def _refusal_tally(config: Config, writer: AuditWriter, clock: Clock, owned: AsyncExitStack) -> RefusalTally:
    """Counts repeated no-cost refusals into the audit trail; flushed at each interval's end and at shutdown,
    before the writer closes."""
    tally = RefusalTally(
        writer.submit,
        clock,
        interval=config.audit.refusal_interval,
        max_keys=config.audit.refusal_max_keys,
    )
    owned.callback(tally.close)  # after the flushing task stops (the stack unwinds in reverse)
    owned.push_async_callback(_stop, asyncio.create_task(tally.run()))
    return tally


def _recording(writer: AuditWriter, sink: RecordSink) -> tuple[RecordSink, DurableSink]:
    """Gate records to `sink` (the log by default) and to the audit trail (AuditBackpressureError when it
    cannot take them: the gate applies the policy's fail mode): without waiting, and durably (returning
    once fsync'd in the spool or stored: for refusals, before they are answered)."""

    def record(guard_record: GuardRecord) -> None:
        sink(guard_record)
        writer.submit(audit_draft(guard_record))

    async def record_durably(guard_record: GuardRecord) -> None:
        sink(guard_record)
        await writer.record(audit_draft(guard_record))

    return record, record_durably


async def _trained_guards(config: Config, registry: Registry, served: str) -> TrainedGuards | None:
    """The guards `lockgate models prepare` trained, registered (None when the default policy needs none)."""
    if config.guard.default_policy not in ("trained", "embedding"):
        return None
    from registry.default_guards import register_guards

    guards_dir = config.model.data_path() / "guards"
    refs = await register_guards(registry, guards_dir, base_model_ref=served, actor="startup")
    if refs is None:
        raise ModelNotPreparedError(
            f"no trained guards in {guards_dir}; run `lockgate models prepare` (or `make serve`) first, or "
            "set guard.default_policy"
        )
    return TrainedGuards(
        embedding=refs.embedding,
        one_token=refs.one_token,
        ngram=refs.ngram,
        ngram_output_allow_below=refs.ngram_output_allow_below,
        ngram_output_block_above=refs.ngram_output_block_above,
        combine_weights=refs.combine_weights,
        combine_bias=refs.combine_bias,
        combine_threshold=refs.combine_threshold,
        categories=refs.categories,
    )


async def _start_registry(
    config: Config,
    store: RegistryStore,
    clock: Clock,
    renderers: RendererCache,
    renderer: PromptRenderer | None,
) -> tuple[Registry, PromptRenderer]:
    """Load the registry, register the served model directory, the guards and the default policy, apply the
    manifest. From then on every model version published or aliased must load in `renderers` (its files,
    tokenizer hash and chat template), which keeps what it loads. Returns the served model's renderer:
    `renderer` when given (a pre-loaded one for the served version), else loaded from the model directory."""
    registry = await Registry.load(
        store, clock, config.registry.refresh_interval, refresh_timeout=config.registry.refresh_timeout
    )
    served = await register_default_model(
        registry, config.model.model_dir(), public_name=config.model.name, actor="startup"
    )
    # Its versions were just derived from these very files; loaded from the configured directory, which
    # `model.path` may place outside the data directory the artifact is relative to.
    prompts = renderer or await PromptRenderer.load(
        config.model.model_dir(), renderers.executor, served.template.text
    )
    renderers.seed(renderer_key(served), prompts)
    registry.model_check = renderers.check
    # The zero-shot judge on the served model: weak (guard/default_guard.py), published so that policies and
    # evaluations can name it next to the trained guards.
    await registry.publish(
        "guard_model", ZERO_SHOT_JUDGE, served.model.version, judge_spec(served.ref), actor="startup"
    )
    guards = await _trained_guards(config, registry, served.ref)
    await register_default_policy(registry, config.guard.default_policy, guards)
    # The guard's MiniLM sentence encoder, served by `POST /v1/embeddings` (its weights hashed once per
    # process: `gateway.embeddings.packaged`).
    await register_packaged_encoder(registry, actor="startup")
    if config.registry.manifest:
        path = await asyncio.to_thread(lambda: Path(config.registry.manifest).expanduser())
        await apply_manifest_file(registry, path, actor="manifest")
    await registry.refresh()
    return registry, prompts


async def open_quota_store(config: Config, clock: Clock) -> QuotaStore:
    """The quota store the configuration names (in memory, or Redis shared by replicas, its connections
    opened; granting from leases where `quota.lease` is set)."""
    if config.quota.backend == "redis":
        from policy.quota.redis import RedisQuotaStore

        store = RedisQuotaStore.from_url(
            config.quota.redis_url,
            cluster=config.quota.redis_cluster,
            pool_size=config.quota.pool_size,
            pool_timeout=config.quota.pool_timeout,
            op_timeout=config.quota.op_timeout,
        )
        await store.warm()
        if config.quota.lease is None:
            return store
        return LeasedQuotaStore(store, clock, config.quota.lease, settle_policy=_settle_policy(config))
    from policy.quota.memory import MemoryQuotaStore

    return MemoryQuotaStore()


def _settle_policy(config: Config) -> SettlePolicy:
    return SettlePolicy(
        attempts=config.quota.settle_attempts,
        first_delay=config.quota.settle_backoff,
        max_delay=config.quota.settle_backoff_max,
    )


def quota_meter(config: Config, store: QuotaStore, clock: Clock) -> QuotaMeter:
    """The meter over `store`, with the configured settlement retries."""
    return QuotaMeter(store, clock, settle_policy=_settle_policy(config))


def _metrics_pusher(
    config: Config, observer: RequestObserver, exporter: MetricExporter | None
) -> MetricsPusher:
    """The OTLP push of the app's metrics: to `exporter`, or over OTLP/HTTP to `metrics.otlp_endpoint`."""
    from gateway.observe.otlp_metrics import MetricsPusher

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        exporter = OTLPMetricExporter(endpoint=config.metrics.otlp_endpoint)
    return MetricsPusher(
        observer.registry,
        exporter,
        config.metrics.otlp_interval,
        config.tracing.service_name,
        time.time_ns,
    )


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@asynccontextmanager
async def running(app: Litestar) -> AsyncIterator[Services]:
    """Run the app's ASGI lifespan in this event loop without serving HTTP (tools and tests that need the
    built services: evaluation scores a policy's cascade with the service's own guards and engines)."""
    inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}}
    task = asyncio.create_task(app(scope, inbox.get, outbox.put))  # type: ignore[arg-type]
    message = await outbox.get()
    if message["type"] != "lifespan.startup.complete":
        await task
        raise RuntimeError(f"the app did not start: {message.get('message', message)}")
    try:
        yield _services(app.state)
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task


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
    sink: OutcomeSink = discard_outcome,
    guard_pools: Mapping[str, Engine] | None = None,
    guard_sink: RecordSink = log_record,
    audit: AuditStore | None = None,
    span_exporter: SpanExporter | None = None,
    metric_exporter: MetricExporter | None = None,
    freeze_start_up: bool = False,
) -> Litestar:
    """Build the app. Backends passed in (engines already started) are used as they are and not closed by the
    app; the others are built from `config` in the lifespan and closed at shutdown. `guard_pools` are engines
    for the pools guard models run on (by pool name); missing ones the default policy needs are started.
    `span_exporter` replaces OTLP as where spans go when `tracing.enabled`, and `metric_exporter` turns on
    the OTLP metrics push (tests; otherwise `metrics.otlp_endpoint` does). `freeze_start_up` (the serving
    process, not tests that build many apps): once started, every object alive is moved out of the garbage
    collector's sight (`gc.freeze`); start-up built hundreds of thousands of objects (modules, tokenizer,
    registry) that live as long as the process, and a full collection that walks them stopped the event loop
    for about 350 ms under load, the p99 of every request in flight then. Stopping unfreezes them (all of
    the process's frozen objects: the serving process froze only these)."""

    tracer = None
    if config.tracing.enabled:
        from gateway.observe.tracing import Tracer

        tracer = Tracer(config.tracing, span_exporter)
    # Metrics, the request log and traces: the app's own registry and tracer (no process-global one).
    observer = RequestObserver(config, clock, tracer)
    overload = OverloadGate(
        config.overload,
        LoopLagMonitor(config.overload.lag_probe_interval, config.overload.lag_window, time.monotonic),
    )

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        executor = ThreadPoolExecutor(
            max_workers=config.model.tokenizer_threads, thread_name_prefix="lockgate-tokenize"
        )
        renderers = RendererCache(config.model.data_path(), executor, config.model.renderer_cache_size)
        tasks = TaskSet()
        async with AsyncExitStack() as owned:
            if tracer is not None:  # last out: after every request has ended and been traced
                owned.push_async_callback(asyncio.to_thread, tracer.shutdown)
            if metric_exporter is not None or config.metrics.otlp_endpoint:
                pusher = _metrics_pusher(config, observer, metric_exporter)
                owned.push_async_callback(asyncio.to_thread, pusher.shutdown)  # with a last push
                owned.push_async_callback(_stop, asyncio.create_task(pusher.run()))
            if observer.multiprocess_dir is not None:  # a worker: others read its counts from its files
                flushing = repeat(observer.metrics.flush, config.metrics.multiprocess_interval)
                owned.push_async_callback(_stop, asyncio.create_task(flushing))
            if config.overload.enabled:
                owned.push_async_callback(_stop, asyncio.create_task(overload.monitor.run()))
            owned.callback(executor.shutdown, wait=False, cancel_futures=True)
            # vLLM's tool parser takes seconds to import: never on the event loop of the first tool request.
            await asyncio.to_thread(tool_parsers.preload)
            store = tenants
            if store is None:
                store = await open_store(TENANT_STORE, config.storage)
                owned.push_async_callback(store.close)
            buckets = quota
            if buckets is None:
                buckets = await open_quota_store(config, clock)
                owned.push_async_callback(buckets.close)
            versions = registry
            if versions is None:
                versions = await open_store(REGISTRY_STORE, config.storage)
                owned.push_async_callback(versions.close)
            live_registry, prompts = await _start_registry(config, versions, clock, renderers, renderer)
            secret = await load_secret(config.registry.secret, versions)
            observer.metrics.tenant_label = tenant_labels(config.metrics.tenant_label, secret)
            owned.push_async_callback(_stop, asyncio.create_task(live_registry.run_refresher()))
            served = live_registry.view.resolve_model(config.model.name, key="")
            tokenizer = prompts.tokenizer
            replicas = await start_fleet(
                config,
                live_registry.view,
                served,
                engine,
                owned,
                token_text=lambda token_id: str(tokenizer.decode([token_id])),
                clock=clock,
            )
            active = replicas[0].engine
            router = Router(config.routing.router)
            ledger = capacity_ledger(config)
            if ledger is not None:
                owned.push_async_callback(ledger.close)
            counters = shared_counters(config)
            if counters is not None:
                owned.push_async_callback(counters.close)
            scheduler = Scheduler(
                replicas,
                router,
                config.admission,
                clock,
                refresh_interval=config.routing.replicas.refresh_interval,
                ledger=ledger,
                holder=lease_holder(),
                counters=counters,
            )
            if counters is not None:
                sync = scheduler.run_counter_sync(config.admission.fleet_sync_interval)
                owned.push_async_callback(_stop, asyncio.create_task(sync))
            # Leases go back before the ledger closes (the exit stack runs last in, first out).
            owned.push_async_callback(scheduler.release_leases)
            # Capacities and health known before the first request; then kept fresh in the background.
            await scheduler.refresh()
            owned.push_async_callback(_stop, asyncio.create_task(scheduler.run()))
            meter = quota_meter(config, buckets, clock)
            # The first replica of each pool answers for it where one engine is needed (limits, readiness).
            pools: dict[str, Engine] = {r.pool: r.engine for r in reversed(replicas)}
            pools.update(guard_pools or {})
            default_policy = live_registry.view.resolve_policy(DEFAULT_POLICY, key="")
            guard_engines = await _guard_pools(config, default_policy, pools, owned) + len(guard_pools or {})
            if config.overload.cpu_shedding == "auto" and _cpu_is_requests_own(
                config, guard_engines, given_engine=engine is not None
            ):
                overload.use_cpu_signal()  # the process's CPU is its requests' own
            # Guard calls on a pool of the generation fleet go where the router's score puts them.
            fleet = {
                pool: s
                for pool, s in by_pool(replicas, router, clock).items()
                if pool not in (guard_pools or {})
            }
            factory = GuardFactory(
                pools={**pools, **fleet},
                renderer=prompts,
                tokenizer_ref=served.tokenizer.ref,
                artifacts=config.model.data_path(),
                config=config.guard,
                clock=clock,
            )
            owned.callback(factory.close)
            # Encoders of embedding models, loaded on first use in the executor the guards' encoders use.
            embedders = Embedders(config.model.data_path(), prompts.executor)
            owned.callback(embedders.close)
            # The default policy's guards are loaded before the first request: it is served guarded.
            await factory.ready(default_policy.guards)
            audit_key = await audit_keys.mac_key(config)
            audit_store = audit
            if audit_store is None:
                audit_store = await open_store(AUDIT_STORE, config.storage, mac_key=audit_key)
                owned.push_async_callback(audit_store.close)
            writer = await _audit_writer(config, audit_store, audit_key, clock, owned)
            refusals = _refusal_tally(config, writer, clock, owned)
            checkpoints = None
            if config.audit.checkpoint_interval > 0:
                checkpoints = await audit_keys.checkpointer(config, audit_store, audit_key, clock)
                task = asyncio.create_task(checkpoints.run(config.audit.checkpoint_interval))
                owned.push_async_callback(_stop, task)
            appeals = await open_store(APPEAL_STORE, config.storage)
            owned.push_async_callback(appeals.close)
            console_sessions = open_session_store(config.console, clock, config.quota.redis_url)
            owned.push_async_callback(console_sessions.aclose)
            # The console's own state (`gateway.console.plumbing.sessions_of`), beside the services.
            app.state.console_sessions = console_sessions
            idempotency = open_idempotency(config, clock)
            if idempotency is not None:
                owned.push_async_callback(idempotency.store.aclose)
            result_cache = open_result_cache(config, clock)
            if result_cache is not None:
                owned.push_async_callback(result_cache.store.aclose)
            sessions = await open_sessions(config, clock)
            if sessions is not None:
                owned.push_async_callback(sessions.store.aclose)
            days = config.audit.content_retention_days
            retention = run_retention(
                audit_store, store, clock, days, config.audit.purge_interval, spool=writer, evidence=appeals
            )
            owned.push_async_callback(_stop, asyncio.create_task(retention))
            recording, recording_durably = _recording(writer, guard_sink)
            gate = SafetyGate(
                factory,
                recording,
                clock,
                config.guard.breaker,
                executor=prompts.executor,
                durable=recording_durably,
            )
            route_decisions: RouteCounts = Counter()
            # Engine, queue, quota and guard series, read from the live objects at scrape time.
            collector = ServiceCollector(
                scheduler.replicas,
                scheduler.depth,
                meter.counters,
                gate.counts,
                stage_failures=gate.stage_failures,
                guard_backlogs=factory.backlogs,
                overload=overload,
                leases=buckets if isinstance(buckets, LeasedQuotaStore) else None,
                idempotency=idempotency.counts if idempotency is not None else None,
                result_cache=result_cache,
                sessions=sessions.counts if sessions is not None else None,
                route_decisions=route_decisions,
            )
            owned.callback(observer.unwatch, observer.watch(collector))
            if observer.multiprocess_dir is not None:  # a worker of `serve --workers N`
                mirror = CollectorMirror(collector, config.metrics.multiprocess_interval)
                owned.push_async_callback(_stop, asyncio.create_task(mirror.run()))
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
                    failures=FailedAuthLimit(
                        clock,
                        burst=config.auth.failed_burst,
                        per_second=config.auth.failed_per_second,
                        max_sources=config.auth.failed_max_sources,
                    ),
                ),
                meter=meter,
                registry=live_registry,
                secret=secret,
                gate=gate,
                guards=factory,
                clock=clock,
                pools=pools,
                renderers=renderers,
                scheduler=scheduler,
                # Reads past a tenant's retention show no content, purged yet or not.
                audit=RetainedAuditStore(audit_store, store, clock, days),
                audit_writer=writer,
                refusals=refusals,
                audit_checkpoints=checkpoints,
                appeals=appeals,
                observer=observer,
                publish_check=(
                    PublishCheck(
                        registry=live_registry,
                        guards=factory,
                        config=config.guard,
                        clock=clock,
                        executor=prompts.executor,
                    )
                    if config.guard.publish_check
                    else None
                ),
                idempotency=idempotency,
                result_cache=result_cache,
                sessions=sessions,
                embedders=embedders,
                route_decisions=route_decisions,
            )
            if freeze_start_up:
                gc.collect()
                gc.freeze()
            try:
                yield
            finally:
                if freeze_start_up:
                    # Back in the collector's sight for the interpreter's exit: frozen objects outlive its
                    # finalization, and an extension module (triton's, under vLLM) then reports them as
                    # leaked, a screenful of lines on every stop.
                    gc.unfreeze()
                # In-flight requests outlived the drain timeout: abort them, let their quota settle, then the
                # exit stack stops the engine and closes the stores.
                await tasks.cancel_all()
                await tasks.wait_all()
                # Settlements run in the meter's own tasks (never cancelled with the requests): wait for
                # them, bounded, while the quota store is still open.
                await meter.drain(config.quota.settle_drain_timeout)

    # The edge in front of Litestar (overload gate, observer, fast path: `gateway.edge.stack`).
    app = Gateway(
        overload=overload,
        observer=observer,
        route_handlers=[*api.ROUTES, *console.ROUTES],
        lifespan=[lifespan],
        dependencies={
            "services": Provide(_services, sync_to_thread=False),
            "principal": Provide(provide_principal),
        },
        exception_handlers=exception_handlers(),
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=openapi_config(),
        # Litestar configures only its own logger: the process's logging (level, handlers) is the caller's
        # (`lockgate serve` sets it from server.log_level), so a level above INFO silences the request log.
        logging_config=LoggingConfig(configure_root_logger=False),
    )
    app.state.overload = overload
    return app
