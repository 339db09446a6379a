"""`Replica`: one engine replica as the router sees it — the weights it serves, its KV budget, its last
reported load and its health behind a circuit breaker.

KV budget. Two sources give a replica's KV capacity in tokens: the engine's report
(`EngineLoad.kv_tokens_capacity`: vLLM's blocks x block size) and, when the operator gives the replica's KV
memory in bytes (`[[engines]] kv_cache_bytes`, or `engine.kv_cache_bytes` for a local vLLM replica), that
budget divided by the registry's bytes per token of the version it serves (`kv_tokens_for_bytes`). With
both, the smaller holds (they disagree when the engine stores KV in another dtype than the registry's figure
assumes, e.g. float32 on a CPU; the replica logs both once); with one, that one; with neither, nothing fits
until the engine reports. The gateway holds, per in-flight request, its prompt plus a growth reserve of
min(max_tokens, growth_reserve_cap) output tokens, and more once its output outgrows that reserve (`grow`).
A request fits when capacity - held - (prompt + reserve) >= 0. Reservations change synchronously on
dispatch and on release, so the budget is exact on the gateway side between two load reports.

Sequences. An engine runs at most `EngineLoad.max_running` sequences at once (vLLM's `max_num_seqs`); the
rest wait in its own queue, ordered by class priority and arrival, where tenant fairness no longer holds. So
a replica takes a request only while the sequences the gateway has in flight there (one per choice), plus
the request's, stay within that limit plus `engine_queue`; an idle replica takes any request. Unknown (0),
no limit applies beyond the KV budget.

Shared by several gateway processes (`lockgate serve --workers N`: `shared_by` = N, every engine remote).
Each process holds only what it dispatched itself, so N processes that each filled the KV budget and the
sequence limit would put N times both on the engine. A process therefore counts what the others use from
the engine's load report: at each report, the sequences running and waiting beyond its own, and the KV
tokens used beyond what its own requests hold there (their prompts and output so far, not the growth
reserve, which the engine does not allocate ahead), both measured when the report was asked for. It may use
the whole budget less the others' part, and never less than an even share (budget // N), so that no process
is starved by peers that filled the engine. Reports are up to `refresh_interval` old: processes that take
load at once each count the others as last reported, so the engine may hold more than its budget until the
next report shows it; from then on each takes nothing new until it is back within what it may use, and the
total settles at the budget (tested). A process with nothing in flight there still takes any one request
that fits the whole budget. With one process nothing of this applies (what others send to the engine is not
counted). With a capacity ledger (`routing.capacity`: gateway processes or pods that share remote replicas
through Redis) none of that estimate applies either: the process admits within its lease of the replica's
KV tokens and sequences, which the ledger keeps, with the other processes' leases, within the budget.

Health. A breaker (`engines.breaker.CircuitBreaker`, with the injected clock) counts consecutive failures:
failed health checks in `refresh()` and fatal errors the pipeline reports (`record_failure`). At the
threshold the replica is out (open) for the cooldown; then one trial (a dispatched request, or the next
health probe, whichever comes first) is let through (half-open): success closes the breaker, failure opens
it again. A health check that says "not ready" takes the replica out of routing at once, until a later
check says ready, even before the breaker opens.

Exceptions::

    RoutingError                 base of routing failures; `status` is the HTTP status
    ├── ReplicaUnavailableError  the replica refuses a dispatch (breaker open or its trial taken, no room)
    ├── NoHealthyReplicaError    (router) no healthy replica serves the request's weights
    └── RequestTooLargeError     (router) the request cannot fit any healthy replica, even idle
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from engines.base import Engine, EngineDrainingError, EngineError, EngineLoad
from engines.breaker import BreakerState, CircuitBreaker, CircuitOpenError
from registry.view import ResolvedModel
from routing.capacity.base import Capacity, CapacityLedger, LedgerUnavailableError
from routing.config import ReplicaConfig

log = logging.getLogger("lockgate.routing")

# A lease asks for this fraction of the budget beyond what its holder uses and has waiting (a standby share).
_STANDBY = 32

# Holder of the half-open trial slot while `refresh()` probes health (request ids never look like this).
_HEALTH_PROBE = "<health-probe>"


class RoutingError(Exception):
    """Base of routing failures; `retry_after` (seconds) when it is known when to try again."""

    status = 503
    code = "routing_error"
    retry_after: float | None = None


class ReplicaUnavailableError(RoutingError):
    """A dispatch to a replica that cannot take it now."""

    code = "replica_unavailable"


def kv_tokens_for_bytes(budget_bytes: int, kv_bytes_per_token: int | ResolvedModel) -> int:
    """Tokens a KV cache of `budget_bytes` holds for a model of `kv_bytes_per_token` (or a resolved model
    version: the registry's `2 * layers * kv_heads * head_dim * kv_dtype_bytes`)."""
    per_token = (
        kv_bytes_per_token if isinstance(kv_bytes_per_token, int) else kv_bytes_per_token.kv_bytes_per_token
    )
    if per_token <= 0:
        raise ValueError(f"KV bytes per token must be positive, got {per_token}")
    return max(0, budget_bytes) // per_token


class _Held:
    """What one in-flight request holds of a replica's KV cache."""

    __slots__ = ("output", "prompt", "reserve", "sequences")

    def __init__(self, prompt: int, reserve: int, sequences: int) -> None:
        self.prompt = prompt
        self.reserve = reserve
        self.sequences = sequences  # sequences the engine runs for it (its choices)
        self.output = 0  # output tokens generated so far (`Replica.grow`)

    @property
    def tokens(self) -> int:
        return self.prompt + max(self.reserve, self.output)


class Replica:
    """One engine replica: its engine, pool and weights, KV accounting, last load and circuit breaker."""

    def __init__(
        self,
        engine: Engine,
        *,
        pool: str,
        weights_sha256: str,
        config: ReplicaConfig,
        clock: Callable[[], float],
        kv_budget_tokens: int | None = None,
        shared_by: int = 1,
    ) -> None:
        """`kv_budget_tokens`: the capacity the replica's KV byte budget gives at the registry's bytes per
        token (`kv_tokens_for_bytes`), None when no budget is configured; `shared_by`: the gateway processes
        (this one included) that dispatch to the engine (module docstring)."""
        if shared_by < 1:
            raise ValueError(f"shared_by must be >= 1, got {shared_by}")
        self.engine = engine
        self.pool = pool
        self.weights_sha256 = weights_sha256
        self._config = config
        self.kv_budget_tokens = kv_budget_tokens
        self._told_disagreement = False
        self.breaker = CircuitBreaker(f"replica {engine.replica_id}", config.breaker, clock)
        # Last load the engine reported (None before the first refresh) and whether its last health check
        # said ready (assumed until a check says otherwise: replicas are registered once started).
        self.last_load: EngineLoad | None = None
        self.health_ready = True
        self.health_detail = ""
        self._held: dict[str, _Held] = {}
        # Invariants: _held_tokens == sum(h.tokens for h in _held.values()) >= 0, and _sequences ==
        # sum(h.sequences for h in _held.values()).
        self._held_tokens = 0
        self._sequences = 0
        self._trial: str | None = None  # holder of the half-open trial slot
        self.shared_by = shared_by
        # What the engine's last load report counted beyond this process's own requests then: other gateway
        # processes' (with `shared_by` > 1) or other clients' work.
        self._others_sequences = 0
        self._others_tokens = 0
        # This process's lease of the engine's capacity from a shared ledger (`routing.capacity`), and when
        # it lapses on this process's clock; None: no ledger, or none renewed in time (then the load report
        # estimate above applies).
        self.lease: Capacity | None = None
        self._lease_until = 0.0
        # While a renewal is on its way: what this process told the ledger it holds, which it must not pass
        # until the grant is back (the ledger grants the others room on that figure).
        self._renewing: Capacity | None = None
        self._clock = clock
        # Out of routing until then: the engine refused work for shutting down (`judge_failure`).
        self._draining_until = 0.0

    @property
    def replica_id(self) -> str:
        """The engine replica's id."""
        return self.engine.replica_id

    # -- KV budget -------------------------------------------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        """KV cache size in tokens: the smaller of the engine's last report and the byte budget's tokens,
        whichever are known (0 when neither is)."""
        reported = self.last_load.kv_tokens_capacity if self.last_load is not None else 0
        if self.kv_budget_tokens is None:
            return reported
        return min(reported, self.kv_budget_tokens) if reported > 0 else self.kv_budget_tokens

    @property
    def held_tokens(self) -> int:
        """KV tokens the gateway's in-flight requests hold on this replica (prompt + growth reserve each)."""
        return self._held_tokens

    @property
    def in_flight(self) -> int:
        """Requests the gateway has in flight on this replica."""
        return len(self._held)

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` holds a reservation here."""
        return request_id in self._held

    def growth_reserve(self, max_tokens: int) -> int:
        """Output tokens reserved for a request of `max_tokens`: min(max_tokens, growth_reserve_cap)."""
        return max(0, min(max_tokens, self._config.growth_reserve_cap))

    @property
    def sequences(self) -> int:
        """Sequences the gateway's in-flight requests run on this replica."""
        return self._sequences

    @property
    def sequence_limit(self) -> int:
        """The most sequences the gateway has in flight here at once: the engine's reported `max_running`
        plus `engine_queue`; 0 while the engine has not reported one (no limit)."""
        reported = self.last_load.max_running if self.last_load is not None else 0
        return reported + self._config.engine_queue if reported > 0 else 0

    def fits(self, prompt_tokens: int, max_tokens: int, sequences: int = 1) -> bool:
        """Whether a request fits now: the KV budget (capacity - held - (prompt + reserve) >= 0) and, on a
        replica with requests in flight, the sequence limit (each less the other processes' part, when
        shared: module docstring)."""
        return self._has_room(prompt_tokens, self.growth_reserve(max_tokens), sequences)

    def _has_room(self, prompt_tokens: int, growth_reserve: int, sequences: int) -> bool:
        capacity = self.kv_capacity_tokens
        need = prompt_tokens + growth_reserve
        lease = self.current_lease()
        if lease is not None:
            # A lease of the shared ledger: what the other gateways may use is outside it.
            limit = self.sequence_limit
            tokens, seqs = lease.tokens, lease.sequences
            if self._renewing is not None:
                tokens, seqs = min(tokens, self._renewing.tokens), min(seqs, self._renewing.sequences)
            return (
                need <= capacity
                and self._held_tokens + need <= tokens
                and (not limit or self._sequences + sequences <= seqs)
            )
        if not self._held:
            return need <= capacity
        if self._held_tokens + need > self._share(capacity, self._others_tokens):
            return False
        limit = self.sequence_limit
        return not limit or self._sequences + sequences <= self._share(limit, self._others_sequences)

    def _share(self, budget: int, others: int) -> int:
        """What of `budget` this process may use: all of it less what the other processes used at the last
        report, and never less than an even share."""
        return max(budget // self.shared_by, budget - others)

    # -- capacity lease ------------------------------------------------------------------------------

    @property
    def budget(self) -> Capacity:
        """The engine's whole capacity: KV tokens and sequences (its limit plus `engine_queue`; with no
        limit known, as many sequences as KV tokens)."""
        capacity = self.kv_capacity_tokens
        return Capacity(capacity, self.sequence_limit or capacity)

    @property
    def used(self) -> Capacity:
        """What this process has in flight here."""
        return Capacity(self._held_tokens, self._sequences)

    def current_lease(self) -> Capacity | None:
        """The lease in force: the last one granted, until it lapses."""
        if self.lease is not None and self._clock() >= self._lease_until:
            self.lease = None
        return self.lease

    async def renew_lease(
        self, ledger: CapacityLedger, holder: str, demand: Capacity, ttl: float
    ) -> Capacity | None:
        """Renew this process's lease from `ledger` (`holder`: this process), asking for what it holds plus
        `demand` (what waits for the replica's weights) plus a small standby share, so that the first
        request after a quiet spell need not wait for a renewal. None when the engine's capacity is not
        known yet; the last lease stays in force until it lapses when the ledger cannot be reached."""
        budget = self.budget
        if budget.tokens <= 0:
            return None
        if self._renewing is not None:  # one renewal at a time: grants must apply in the ledger's order
            return self.current_lease()
        used = self.used
        want = Capacity(
            min(budget.tokens, used.tokens + demand.tokens + max(1, budget.tokens // _STANDBY)),
            min(budget.sequences, used.sequences + demand.sequences + max(1, budget.sequences // _STANDBY)),
        )
        now = self._clock()
        # Until the grant is back, take nothing beyond `used`: the ledger may give the others what the old
        # lease held above it.
        self._renewing = used
        try:
            grant = await ledger.renew(
                self.replica_id, holder, want=want, used=used, budget=budget, now=now, ttl=ttl
            )
        except LedgerUnavailableError as exc:
            log.warning("replica %s: lease not renewed: %s", self.replica_id, exc)
            return self.current_lease()
        finally:
            self._renewing = None
        self.lease, self._lease_until = grant, now + ttl
        return grant

    def fits_idle(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether the request would fit this replica with nothing else in flight."""
        return prompt_tokens + self.growth_reserve(max_tokens) <= self.kv_capacity_tokens

    def reserve(self, request_id: str, prompt_tokens: int, growth_reserve: int, sequences: int = 1) -> None:
        """Hold prompt + growth reserve and `sequences` for a request dispatched here (call it in the same
        event-loop step as `Router.choose`). Takes the half-open trial slot if the breaker is half-open.

        Raises ReplicaUnavailableError when the breaker refuses or the request does not fit, ValueError when
        `request_id` already holds a reservation here.
        """
        if request_id in self._held:
            raise ValueError(f"request {request_id} already holds KV on replica {self.replica_id}")
        if prompt_tokens < 0 or growth_reserve < 0 or sequences < 1:
            raise ValueError("prompt tokens and growth reserve cannot be negative, sequences must be >= 1")
        if not self._has_room(prompt_tokens, growth_reserve, sequences):
            raise ReplicaUnavailableError(f"replica {self.replica_id} has no room for {request_id}")
        self._take_trial(request_id)
        held = _Held(prompt_tokens, growth_reserve, sequences)
        self._held[request_id] = held
        self._held_tokens += held.tokens
        self._sequences += sequences

    def grow(self, request_id: str, tokens: int) -> None:
        """Count `tokens` more output tokens of a request; it holds more only past its growth reserve."""
        held = self._held.get(request_id)
        if held is None or tokens <= 0:
            return
        before = held.tokens
        held.output += tokens
        self._held_tokens += held.tokens - before

    def release(self, request_id: str) -> bool:
        """Free what a request holds (on completion, error or cancellation alike; a second call is a no-op).
        Returns whether it held anything.

        The trial request of a half-open breaker that ends without `record_failure` closes the breaker:
        the engine served it, or at least did not fail it, which is what the trial tests."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._held_tokens -= held.tokens
        self._sequences -= held.sequences
        if self._trial == request_id:
            self.record_success()
        return True

    # -- load --------------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Sequences running and waiting on the engine: the others' part of the last report (what it counted
        beyond this gateway's own sequences then) plus this gateway's own now. Own requests that ended since
        the report no longer count, and those dispatched since it already do."""
        return self._others_sequences + self._sequences

    @property
    def kv_utilisation(self) -> float:
        """Fraction of the KV cache in use: the others' part of the last report plus what this gateway's
        requests hold now (prompt and growth reserve each); 1.0 when the capacity is unknown."""
        capacity = self.kv_capacity_tokens
        if capacity <= 0:
            return 1.0
        return min(1.0, (self._others_tokens + self._held_tokens) / capacity)

    async def refresh(self) -> None:
        """Ask the engine for its health and load, within `refresh_timeout`; the owner calls it every
        `refresh_interval`. While the breaker is open nothing is asked; half-open, the check is the trial
        (unless a trial request holds the slot: then only the load is asked). A check that fails (an error,
        a timeout) counts toward the breaker; a "not ready" answer only keeps the replica out until ready."""
        state = self.breaker.state
        if state == "open":
            return
        probing = state == "half_open" and self._trial is None
        if probing:
            self._take_trial(_HEALTH_PROBE)
        own_sequences = self._sequences
        own_tokens = sum(h.prompt + h.output for h in self._held.values())
        check_health = state == "closed" or probing
        try:
            async with asyncio.timeout(self._config.refresh_timeout):
                if check_health:
                    health = await self.engine.health()
                    self.health_ready, self.health_detail = health.ready, health.detail
                load = await self.engine.load() if self.health_ready else None
        except asyncio.CancelledError:
            if self._trial == _HEALTH_PROBE:
                # An unfinished probe must not hold the trial slot forever: count it as failed (one more
                # cooldown) rather than as passed.
                self.record_failure()
            raise
        # What a failed check may raise: the engine's own errors, our timeout, a broken connection.
        except (EngineError, TimeoutError, OSError) as exc:
            self.health_ready, self.health_detail = False, f"{type(exc).__name__}: {exc}"
            self._draining_until = 0.0  # a draining engine has left: its successor is judged afresh
            log.warning("replica %s: check failed: %s", self.replica_id, self.health_detail)
            self.record_failure()
            return
        if load is not None:
            self.last_load = load
            self._others_sequences = max(0, load.running + load.waiting - own_sequences)
            self._others_tokens = max(0, load.kv_tokens_used - own_tokens)
            self._check_capacity(load.kv_tokens_capacity)
        if not check_health or not probing:
            # A replica that answers "not ready" (an engine restarting) is out of routing until it answers
            # ready again, at once: an honest answer is not a fault, so it does not count toward the breaker.
            return
        if self.health_ready:
            self.record_success()
        else:
            self.record_failure()

    @property
    def refresh_interval(self) -> float:
        """Seconds between two refreshes of this replica by its owner (`ReplicaConfig.refresh_interval`)."""
        return self._config.refresh_interval

    @property
    def draining(self) -> bool:
        """Whether the engine refused work for shutting down within `drain_hold` seconds (and no health check
        failed since)."""
        return self._clock() < self._draining_until

    async def judge_failure(self, exc: BaseException | None = None) -> None:
        """The replica failed a request before its first token (or a guard call) with `exc`. One that refused
        it for shutting down (EngineDrainingError) is out of routing for `drain_hold` seconds, or until a
        health check fails (its process has left). Otherwise ask its health now: one that says it is not
        ready (an engine restarting) is out of routing until it is ready again; one that says it is ready
        but fails requests counts a failure toward its circuit breaker. (A death mid-stream is one event for
        all its streams: the supervisor and the next health check deal with it.)"""
        if isinstance(exc, EngineDrainingError):
            if not self.draining:
                log.warning("replica %s: shutting down, out of routing until it has left", self.replica_id)
            self._draining_until = self._clock() + self._config.drain_hold
            return
        try:
            await self.refresh()
        except Exception:  # the original failure is what the caller reports; this one only counts against it
            log.exception("replica %s: health check after a failure raised", self.replica_id)
            self.health_ready = False
        if self.health_ready:
            self.record_failure()

    def _check_capacity(self, reported: int) -> None:
        """Say once when the engine's capacity and the byte budget's disagree by more than a tenth."""
        budget = self.kv_budget_tokens
        if budget is None or reported <= 0 or self._told_disagreement:
            return
        if abs(reported - budget) > max(reported, budget) / 10:
            self._told_disagreement = True
            log.warning(
                "replica %s reports %d KV tokens; its byte budget at the registry's bytes per token gives "
                "%d; routing counts %d (the engine's KV dtype may differ from the registry's)",
                self.replica_id,
                reported,
                budget,
                min(reported, budget),
            )

    # -- breaker -----------------------------------------------------------------------------------

    @property
    def breaker_state(self) -> BreakerState:
        """closed, open (out for the cooldown) or half_open (one trial may pass)."""
        return self.breaker.state

    @property
    def routable(self) -> bool:
        """Whether the router may send a request here now: ready at the last check, not draining, and the
        breaker closed or half-open with its trial slot free."""
        if not self.health_ready or self.draining:
            return False
        state = self.breaker.state
        return state == "closed" or (state == "half_open" and self._trial is None)

    def _take_trial(self, holder: str) -> None:
        state = self.breaker.state
        if state == "closed":
            return
        if state == "half_open" and self._trial is None:
            try:
                self.breaker.before_call()
            except CircuitOpenError as exc:  # pragma: no cover - our slot tracking mirrors the breaker's
                raise ReplicaUnavailableError(str(exc)) from exc
            self._trial = holder
            return
        raise ReplicaUnavailableError(f"replica {self.replica_id} is out of service ({state}, trial taken)")

    def record_success(self) -> None:
        """The replica served a request (or passed a probe): close the breaker."""
        self._trial = None
        self.breaker.success()

    def record_failure(self) -> None:
        """A fatal error from the replica (EngineDeadError, a broken connection) or a failed health check:
        count it; the breaker opens at the threshold, or at once after a failed trial. A request's own
        failure (EngineRequestError) or a refusal for load (EngineOverloadedError) is not the replica's."""
        self._trial = None
        self.breaker.failure()
