"""`Generation`: what the generation pipeline reads, built once in the app lifespan (`Services.generation`).

The pipeline's stages take it instead of the whole `Services`, so this package never imports the assembly
that builds it (`gateway.services` imports `gateway.generation`, never the other way).
"""

from __future__ import annotations

from collections import Counter

from engines.base import Engine
from gateway.config import Config
from gateway.generation.flow import TaskSet
from gateway.generation.prompts import PromptRenderer
from gateway.generation.renderers import RendererCache
from gateway.generation.tracking import OutcomeSink
from gateway.result_cache.cache import ResultCache
from gateway.secret import ServerSecret
from policy.audit.refusals import RefusalTally
from policy.clock import Clock
from policy.quota.meter import QuotaMeter
from policy.safety.gate import SafetyGate
from registry.service import Registry
from routing.scheduler import Scheduler

# `lockgate:route_decisions_total` by (route, target, reason) (`gateway.generation.orchestration`).
RouteCounts = Counter[tuple[str, str, str]]


class Generation:
    """The stores, pools and settings one generation request reads, and nothing of the HTTP layer."""

    def __init__(
        self,
        *,
        config: Config,
        clock: Clock,
        registry: Registry,
        secret: ServerSecret,
        pools: dict[str, Engine],
        guard_pools: frozenset[str],
        renderer: PromptRenderer,
        renderers: RendererCache | None,
        scheduler: Scheduler,
        meter: QuotaMeter,
        gate: SafetyGate,
        refusals: RefusalTally,
        sink: OutcomeSink,
        tasks: TaskSet,
        traced: bool,
        result_cache: ResultCache | None = None,
        route_decisions: RouteCounts | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        # Model, policy and prompt versions, resolved per request (`resolution`).
        self.registry = registry
        # Keys canary picks and tenants' cache salts: nothing a client chooses does.
        self.secret = secret
        # Engine pools by name, and those only guard models run on (never served for generation).
        self.pools = pools
        self.guard_pools = guard_pools
        # The served model's renderer; `renderers` holds every version pair's (None: `renderer` serves all).
        self.renderer = renderer
        self.renderers = renderers
        # Fair admission and routing over the engine replicas.
        self.scheduler = scheduler
        self.meter = meter
        self.gate = gate
        # Repeated no-cost refusals (quota, admission) as counts per key, reason and interval.
        self.refusals = refusals
        # Where each request's `Outcome` goes (besides its timeline), and the tasks streams run in.
        self.sink = sink
        self.tasks = tasks
        # Whether requests are traced: engine requests then carry the request's traceparent.
        self.traced = traced
        # Answers to deterministic requests kept and served again (None: `[result_cache] enabled` false).
        self.result_cache = result_cache
        # Routed requests by (route, model, reason): `lockgate:route_decisions_total`.
        self.route_decisions: RouteCounts = route_decisions if route_decisions is not None else Counter()
