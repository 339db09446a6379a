"""`Services`: the stores, pools and settings the routes read, built once in the app lifespan and injected
into them; a plain bundle (what a request does with them lives in the packages that own each part: the
generation pipeline reads its own part, `Services.generation`)."""

from __future__ import annotations

from engines.base import Engine
from gateway.config import Config
from gateway.embeddings import Embedders
from gateway.generation.context import Generation, RouteCounts
from gateway.generation.flow import TaskSet
from gateway.generation.prompts import PromptRenderer
from gateway.generation.renderers import RendererCache
from gateway.generation.tracking import OutcomeSink
from gateway.guard_factory import GuardFactory
from gateway.idempotency.replay import Idempotency
from gateway.observe.observer import RequestObserver
from gateway.publish_check import PublishCheck
from gateway.readiness import ReadinessCheck
from gateway.result_cache.cache import ResultCache
from gateway.secret import ServerSecret
from gateway.sessions.service import Sessions
from policy.appeals.base import AppealStore
from policy.audit.base import AuditStore
from policy.audit.checkpoints import Checkpointer
from policy.audit.refusals import RefusalTally
from policy.audit.writer import AuditWriter
from policy.auth import Authenticator
from policy.clock import Clock
from policy.quota.meter import QuotaMeter
from policy.safety.gate import SafetyGate
from policy.tenants.base import TenantStore
from registry.service import Registry
from routing.scheduler import Scheduler

DEFAULT_POOL = "default"


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
        secret: ServerSecret,
        gate: SafetyGate,
        clock: Clock,
        guards: GuardFactory | None = None,
        scheduler: Scheduler,
        audit: AuditStore,
        audit_writer: AuditWriter,
        refusals: RefusalTally,
        audit_checkpoints: Checkpointer | None = None,
        appeals: AppealStore,
        pools: dict[str, Engine] | None = None,
        renderers: RendererCache | None = None,
        observer: RequestObserver,
        publish_check: PublishCheck | None = None,
        idempotency: Idempotency | None = None,
        result_cache: ResultCache | None = None,
        route_decisions: RouteCounts | None = None,
        sessions: Sessions | None = None,
        embedders: Embedders,
    ) -> None:
        self.config = config
        # The app's metrics registry and request log (each request's timeline ends there).
        self.observer = observer
        self.engine = engine
        # Fair admission and routing over the engine replicas (built in the lifespan).
        self.scheduler = scheduler
        # The audit trail: its store (the reviewer routes read it) and its writer (the gate feeds it).
        self.audit = audit
        self.audit_writer = audit_writer
        # Signed checkpoints of the chain heads, outside the database (None: [audit] checkpoint_interval 0).
        self.audit_checkpoints = audit_checkpoints
        # Repeated no-cost refusals (quota, admission) as counts per key, reason and interval.
        self.refusals = refusals
        # Appeals of recorded decisions and their review (the appeal routes), in the audit store's database.
        self.appeals = appeals
        # Engine pools by name; a model version names the pool that serves it. One embedded engine: "default".
        self.pools: dict[str, Engine] = pools or {DEFAULT_POOL: engine}
        # Pools that only guard models run on (every pool no generation replica serves).
        served = {r.pool for r in scheduler.replicas}
        self.guard_pools = frozenset(p for p in self.pools if p not in served)
        # The served model's renderer; `renderers` holds every version pair's (None: `renderer` serves all).
        self.renderer = renderer
        self.renderers = renderers
        self.sink = sink
        self.tasks = tasks
        self.tenants = tenants
        self.auth = auth
        self.meter = meter
        self.registry = registry
        # Measures policy and guard model versions before the admin API publishes them (None: off).
        self.publish_check = publish_check
        # Answers kept by `Idempotency-Key` on the generation routes (None: `[idempotency] enabled` false).
        self.idempotency = idempotency
        # Server-side sessions (`/v1/sessions`, `x-lockgate-session`; None: `[sessions] enabled` false).
        self.sessions = sessions
        # Encoders of embedding model versions (`POST /v1/embeddings`), loaded on first use.
        self.embedders = embedders
        # Keys canary picks and tenants' cache salts (`gateway.secret`): nothing a client chooses does.
        self.secret = secret
        self.gate = gate
        # Builds each guard version's classifier (the gate uses it; tools wait for a policy's guards with it).
        self.guards = guards
        self.clock = clock
        # What the generation pipeline reads (`gateway.generation`: it never imports this module).
        self.generation = Generation(
            config=config,
            clock=clock,
            registry=registry,
            secret=secret,
            pools=self.pools,
            guard_pools=self.guard_pools,
            renderer=renderer,
            renderers=renderers,
            scheduler=scheduler,
            meter=meter,
            gate=gate,
            refusals=refusals,
            sink=sink,
            tasks=tasks,
            traced=observer.tracer is not None,
            result_cache=result_cache,
            route_decisions=route_decisions,
        )
        # `/readyz`'s health checks, at most one round per `[server] readiness_cache` seconds.
        self.readiness = ReadinessCheck(self.generation, config.server.readiness_cache)
