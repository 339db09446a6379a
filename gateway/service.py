"""`Services`: everything a request needs, built once in the app lifespan and injected into the routes."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from engines.base import Engine
from engines.supervisor import SupervisedEngine
from gateway.config import Config
from gateway.console.sessions.base import SessionStore
from gateway.edge.decoding import Decoder
from gateway.errors import EngineUnavailableError, InvalidRequestError, NotFoundError
from gateway.generation.flow import TaskSet
from gateway.generation.planning import Limits
from gateway.generation.prompts import PromptRenderer
from gateway.generation.renderers import RendererCache
from gateway.generation.tracking import Outcome, OutcomeSink
from gateway.guards import GuardFactory
from gateway.observe.observer import RequestObserver
from gateway.observe.timeline import RequestTimeline
from gateway.publish_check import PublishCheck
from gateway.readiness import ReadinessCheck
from gateway.schemas import ChatCompletionRequest, CompletionRequest, ModerationRequest
from gateway.secret import ServerSecret
from policy.appeals.base import AppealStore
from policy.audit.base import AuditStore
from policy.audit.checkpoints import Checkpointer
from policy.audit.refusals import RefusalTally
from policy.audit.writer import AuditWriter
from policy.auth import Authenticator, Principal
from policy.clock import Clock
from policy.quota.meter import Charge, QuotaMeter
from policy.safety.gate import SafetyGate
from policy.tenants.base import TenantStore
from registry.errors import InvalidError as RegistryInvalidError
from registry.errors import NotFoundError as RegistryNotFoundError
from registry.service import Registry
from registry.view import ResolvedModel, ResolvedPolicy, ResolvedPrompt
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
        console_sessions: SessionStore,
        pools: dict[str, Engine] | None = None,
        renderers: RendererCache | None = None,
        observer: RequestObserver,
        publish_check: PublishCheck | None = None,
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
        # The reviewer console's sessions ([console] session_store: this process's, or shared in Redis).
        self.console_sessions = console_sessions
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
        # Keys canary picks and tenants' cache salts (`gateway.secret`): nothing a client chooses does.
        self.secret = secret
        self.gate = gate
        # Builds each guard version's classifier (the gate uses it; tools wait for a policy's guards with it).
        self.guards = guards
        self.clock = clock
        # `/readyz`'s health checks, at most one round per `[server] readiness_cache` seconds.
        self.readiness = ReadinessCheck(self, config.server.readiness_cache)
        self.chat_decoder = Decoder(ChatCompletionRequest)
        self.completion_decoder = Decoder(CompletionRequest)
        self.moderation_decoder = Decoder(ModerationRequest)
        self.started = int(time.time())

    def report(self, outcome: Outcome, timeline: RequestTimeline) -> None:
        """The outcome of a request that no tracker follows (no engine saw it): to the outcome sink and to its
        timeline."""
        self.sink(outcome)
        timeline.record_outcome(outcome)

    def unrecoverable(self) -> str:
        """Why this gateway cannot recover without a restart of its process ("" while it can): an engine in
        this process (any generation replica, or a guard pool's) whose supervisor gave up restarting it."""
        engines = [r.engine for r in self.scheduler.replicas]
        engines += [self.pools[pool] for pool in sorted(self.guard_pools)]
        dead = {
            id(e): f"engine {e.replica_id} could not be restarted: {e.last_error}"
            for e in engines
            if isinstance(e, SupervisedEngine) and not e.alive
        }
        return "; ".join(dead.values())

    def target(self, model_name: str, principal: Principal) -> tuple[ResolvedModel, Limits]:
        """The model version `model_name` means for the caller's API key (one registry view: an alias in
        canary serves one key from one version), and its limits."""
        key = self.secret.model_key(principal.tenant.tenant_id, principal.key.key_id)
        try:
            model = self.registry.view.resolve_model(model_name, key)
        except RegistryNotFoundError as exc:
            raise NotFoundError(
                f"model `{model_name}` does not exist: {exc}", param="model", code="model_not_found"
            ) from exc
        except RegistryInvalidError as exc:
            raise InvalidRequestError(
                f"bad model reference: {exc}", param="model", code="invalid_value"
            ) from exc
        if model.spec.engine_pool in self.guard_pools:
            # A guard pool's capacity is the guards': generation there would queue ahead of safety checks.
            raise NotFoundError(
                f"model `{model_name}` ({model.ref}) is a guard model and is not served for generation",
                param="model",
                code="model_not_found",
            )
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
            max_choices=self.config.server.max_choices,
            max_tool_calls=self.config.server.max_tool_calls,
        )
        return model, limits

    async def renderer_for(self, model: ResolvedModel) -> PromptRenderer:
        """The renderer of `model`'s tokenizer and chat template versions."""
        if self.renderers is None:
            return self.renderer
        try:
            return await self.renderers.get(model)
        except RegistryInvalidError as exc:
            # Checked when published: files that changed or vanished since are the operator's to fix.
            raise EngineUnavailableError(
                f"the tokenizer or chat template of {model.ref} cannot be loaded: {exc}",
                code="renderer_unavailable",
            ) from exc

    def policy_for(self, principal: Principal) -> ResolvedPolicy:
        """The safety policy version the caller's tenant is bound to, from the current registry view: while
        its alias splits, one version for all of the tenant's requests, whatever their id or API key (a
        blocked request retried is decided under the same version)."""
        key = self.secret.policy_key(principal.tenant.tenant_id)
        try:
            return self.registry.view.resolve_policy(principal.tenant.policy, key)
        except (RegistryNotFoundError, RegistryInvalidError) as exc:
            # A binding that does not resolve is an operator error; no request goes unguarded because of it.
            raise EngineUnavailableError(
                f"the safety policy `{principal.tenant.policy}` of this tenant cannot be resolved: {exc}",
                code="policy_unavailable",
            ) from exc

    def prompt_for(self, principal: Principal) -> ResolvedPrompt | None:
        """The system prompt the caller's key, or else its tenant, is bound to (None: none); while its alias
        splits, one version per API key, as for models."""
        binding = principal.key.system_prompt or principal.tenant.system_prompt
        if binding is None:
            return None
        key = self.secret.model_key(principal.tenant.tenant_id, principal.key.key_id)
        try:
            return self.registry.view.resolve_prompt(binding, key)
        except (RegistryNotFoundError, RegistryInvalidError) as exc:
            # Serving without the tenant's instructions would change what the model is told: refuse instead.
            raise EngineUnavailableError(
                f"the system prompt `{binding}` of this key or tenant cannot be resolved: {exc}",
                code="prompt_unavailable",
            ) from exc

    def settle_on_outcome(self, charge: Charge, release: Callable[[], None] | None = None) -> OutcomeSink:
        """The sink for one request: free its engine capacity (`release`), report the outcome, then settle
        its quota with the usage it had; in the event loop's next pass, so that what the request still has
        to send (a whole answer's body, a stream's last events) leaves first: the client does not wait for
        the bookkeeping. Nothing else can run before it: a request that arrives meanwhile is read in a later
        pass, after it."""

        price = self.config.quota.guard_token_price

        def settle(outcome: Outcome) -> None:
            if release is not None:
                release()
            self.sink(outcome)
            usage = outcome.usage
            # The output guard's tokens are the tenant's line too: a long answer costs guard work. Charged
            # past the reservation if need be (it covers prompt and max_tokens only): the bucket may go into
            # debt, which later requests wait out, rather than the work going unbilled.
            used = usage.prompt_tokens + usage.completion_tokens + math.ceil(usage.guard_tokens * price)
            # The meter's own task, not the request TaskSet: shutdown cancels those, and drains these.
            self.meter.settle_later(charge, used)

        def sink(outcome: Outcome) -> None:
            asyncio.get_running_loop().call_soon(settle, outcome)

        return sink
