"""`Router`: which replica a request is dispatched to, and the failover rule.

Candidates are the replicas that serve the request's weights (the resolved model version's
`weights_sha256`), are routable (last health check ready; breaker closed, or half-open with its trial slot
free) and have room for the request (its KV and its sequences, `routing.replicas`). Among them the lowest
score wins::

    score = queue_weight * queue_depth + kv_weight * kv_utilisation
            - prefix_weight * (leading prompt blocks the replica was recently sent / blocks hashed)
            - session_weight * (the request's session is bound to the replica)

ties broken by queue depth, then replica id. Escape hatch: when the winner's queue depth exceeds the least
loaded candidate's by more than `imbalance_margin`, the least loaded one is taken instead, so affinity
never piles requests onto one replica. The outcomes are distinct: a replica (dispatch), None (every healthy
replica is full now: keep the request queued and try again when a request ends),
`NoHealthyReplicaError` (none is healthy at all: answer 503 `no_healthy_replica`) and
`RequestTooLargeError` (it would not fit any healthy replica even idle: waiting cannot help).

Failover: a request that fails before its first token with EngineDeadError, EngineOverloadedError or a
connection error is retried once on another replica: `choose(..., exclude={failed replica id})`. After
the first token it is not (the client has seen output; a retry would repeat or contradict it).
`may_fail_over` states the rule; `is_replica_failure` says which errors the pipeline reports to the
replica's breaker with `Replica.record_failure`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import msgspec

from engines.base import EngineDeadError, EngineOverloadedError
from routing.affinity import PrefixMemory, SessionMemory, prefix_block_hashes
from routing.config import RouterConfig
from routing.replicas import Replica, RoutingError

# Attempts a request may make in all: the first and one failover.
MAX_ATTEMPTS = 2


class NoHealthyReplicaError(RoutingError):
    """No healthy replica (outside those excluded) serves the request's weights."""

    code = "no_healthy_replica"


class RequestTooLargeError(RoutingError):
    """The request's prompt and growth reserve exceed the KV capacity of every healthy replica."""

    status = 400
    code = "context_length_exceeded"


class RouteRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What the router needs to know of a request."""

    request_id: str
    # sha256 of the weights of the resolved model version: only replicas serving them are candidates.
    weights_sha256: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    # Session key (`session_key`); None = no session affinity.
    session: str | None = None
    # The tenant's prefix-cache salt: prefixes of different salts never attract each other.
    cache_salt: str | None = None
    # Only replicas of this pool; None = any pool.
    pool: str | None = None
    # Sequences the engine runs for it: one per choice (`n`).
    sequences: int = 1


def session_key(session_id: str | None, user: str | None, *, tenant: str = "") -> str | None:
    """The session of a request: its `x-session-id` header (`session_id`), else the body's `user` field,
    scoped to the tenant; None when it has neither."""
    key = session_id or user
    return f"{tenant}\x00{key}" if key else None


def reserve(request: RouteRequest, replica: Replica, choices: int | None = None) -> None:
    """Hold the request's KV on `replica` until `Replica.release`: its prompt and the growth reserve of
    `choices` of its choices (default all), one sequence each. Choices placed on one replica share the prompt
    (the engine's prefix cache computes it once)."""
    count = request.sequences if choices is None else choices
    output = (
        request.max_tokens if count == request.sequences else request.max_tokens // request.sequences * count
    )
    replica.reserve(request.request_id, len(request.prompt_token_ids), replica.growth_reserve(output), count)


def placed_on(placement: Sequence[Replica]) -> dict[Replica, int]:
    """How many choices of a placement (one replica per choice) each replica runs, in first-use order."""
    counts: dict[Replica, int] = {}
    for replica in placement:
        counts[replica] = counts.get(replica, 0) + 1
    return counts


def may_fail_over(exc: BaseException, *, first_token_sent: bool, attempt: int) -> bool:
    """Whether a request that failed with `exc` on attempt `attempt` (1 = first) is retried on another
    replica: only before its first token, only for the replica's fault (dead, overloaded, connection
    lost), and only once."""
    if first_token_sent or attempt >= MAX_ATTEMPTS:
        return False
    return isinstance(exc, EngineDeadError | EngineOverloadedError | ConnectionError)


def is_replica_failure(exc: BaseException) -> bool:
    """Whether `exc` counts against the replica's breaker (`Replica.record_failure`): a dead engine or a
    lost connection. Overload is load, not ill health; a request's own error is the request's."""
    return isinstance(exc, EngineDeadError | ConnectionError)


def _check_fits_idle(healthy: Sequence[Replica], prompt: int, max_tokens: int) -> None:
    """RequestTooLargeError when `prompt` + the growth reserve of `max_tokens` fits no replica even idle
    (waiting cannot help)."""
    if all(r.kv_capacity_tokens > 0 and not r.fits_idle(prompt, max_tokens) for r in healthy):
        largest = max(r.kv_capacity_tokens for r in healthy)
        raise RequestTooLargeError(
            f"{prompt} prompt tokens + {healthy[0].growth_reserve(max_tokens)} reserved for output "
            f"exceed the KV cache of every replica (largest {largest} tokens)"
        )


class Router:
    """Chooses a replica per request; remembers recent prefixes per replica and sessions."""

    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        self._prefixes: dict[str, PrefixMemory] = {}
        self._sessions = SessionMemory(config.session_lru_size, config.session_ttl)

    def choose(
        self,
        request: RouteRequest,
        replicas: Sequence[Replica],
        now: float,
        *,
        exclude: Collection[str] = (),
    ) -> Replica | None:
        """The replica to dispatch `request` to, or None if every healthy one is full now (keep it queued).
        `exclude` names replica ids not to use (failover: the one that failed). Remembers the choice for
        prefix and session affinity; the caller reserves KV on it (`Replica.reserve`) at once, or uses
        `dispatch`.

        Raises NoHealthyReplicaError when no healthy replica serves the weights, RequestTooLargeError when
        the request would not fit any of them even idle.
        """
        healthy = self._healthy(request, replicas, exclude)
        prompt, max_tokens = len(request.prompt_token_ids), request.max_tokens
        roomy = [r for r in healthy if r.fits(prompt, max_tokens, request.sequences)]
        if not roomy:
            _check_fits_idle(healthy, prompt, max_tokens)
            return None
        hashes = self._hashes(request)
        chosen = self._pick(request, roomy, now, hashes)
        self._remember(request, [chosen], now, hashes)
        return chosen

    def place(
        self,
        request: RouteRequest,
        replicas: Sequence[Replica],
        now: float,
        *,
        exclude: Collection[str] = (),
    ) -> list[Replica] | None:
        """A replica for each choice of `request` (index i runs on the i-th), or None if they do not all
        have room now. One choice: `choose`. Several: each goes where the same score puts it, counting the
        choices placed before it as load there (a sequence and its KV), so that the choices of one request
        spread over replicas with room, while choices on one replica share its prompt. Raises as `choose`
        does; RequestTooLargeError only when one choice fits no healthy replica even idle."""
        if request.sequences == 1:
            chosen = self.choose(request, replicas, now, exclude=exclude)
            return None if chosen is None else [chosen]
        healthy = self._healthy(request, replicas, exclude)
        prompt = len(request.prompt_token_ids)
        per_choice = request.max_tokens // request.sequences
        hashes = self._hashes(request)
        placement: list[Replica] = []
        added: dict[str, int] = {}
        for _ in range(request.sequences):
            roomy = [
                r
                for r in healthy
                if r.fits(
                    prompt, per_choice * (added.get(r.replica_id, 0) + 1), added.get(r.replica_id, 0) + 1
                )
            ]
            if not roomy:
                _check_fits_idle(healthy, prompt, per_choice)
                return None
            chosen = self._pick(request, roomy, now, hashes, added)
            added[chosen.replica_id] = added.get(chosen.replica_id, 0) + 1
            placement.append(chosen)
        self._remember(request, placement, now, hashes)
        return placement

    def dispatch(
        self,
        request: RouteRequest,
        replicas: Sequence[Replica],
        now: float,
        *,
        exclude: Collection[str] = (),
    ) -> Replica | None:
        """`choose`, then reserve the request's KV on the chosen replica (released with
        `Replica.release(request.request_id)` when the request ends)."""
        replica = self.choose(request, replicas, now, exclude=exclude)
        if replica is not None:
            reserve(request, replica)
        return replica

    def dispatch_choices(
        self,
        request: RouteRequest,
        replicas: Sequence[Replica],
        now: float,
        *,
        exclude: Collection[str] = (),
    ) -> list[Replica] | None:
        """`place`, then reserve on each replica of the placement what its choices need (released with
        `Replica.release(request.request_id)` on each)."""
        placement = self.place(request, replicas, now, exclude=exclude)
        if placement is not None:
            for replica, count in placed_on(placement).items():
                reserve(request, replica, count)
        return placement

    def prefer(
        self, request: RouteRequest, candidates: Sequence[Replica], now: float, added: Mapping[str, int]
    ) -> Replica:
        """The replica of `candidates` that the score puts first for work that holds no KV reservation (a
        guard call's one-token forward pass), with `added` (that work in flight, per replica id) counted as
        load as `place` counts choices; remembered for prefix affinity like a dispatch."""
        hashes = self._hashes(request)
        chosen = self._pick(request, candidates, now, hashes, added)
        self._remember(request, [chosen], now, hashes)
        return chosen

    def forget(self, replica_id: str) -> None:
        """Drop what is remembered of a replica that left the pool."""
        self._prefixes.pop(replica_id, None)

    def _healthy(
        self, request: RouteRequest, replicas: Sequence[Replica], exclude: Collection[str]
    ) -> list[Replica]:
        healthy = [
            r
            for r in replicas
            if r.weights_sha256 == request.weights_sha256
            and (request.pool is None or r.pool == request.pool)
            and r.replica_id not in exclude
            and r.routable
        ]
        if not healthy:
            raise NoHealthyReplicaError(
                f"no healthy replica serves weights {request.weights_sha256[:12]}"
                + (f" (excluding {', '.join(sorted(exclude))})" if exclude else "")
            )
        return healthy

    def _hashes(self, request: RouteRequest) -> tuple[int, ...]:
        cfg = self._config
        return prefix_block_hashes(
            request.prompt_token_ids,
            block_size=cfg.block_size,
            depth=cfg.affinity_depth,
            salt=request.cache_salt,
        )

    def _pick(
        self,
        request: RouteRequest,
        roomy: Sequence[Replica],
        now: float,
        hashes: tuple[int, ...],
        added: Mapping[str, int] | None = None,
    ) -> Replica:
        """The lowest score among `roomy` (module docstring); `added`: choices of this request already
        placed on a replica, counted as load there (one queued sequence and its growth reserve each)."""
        if len(roomy) == 1:  # nothing to weigh (the usual pool of one)
            return roomy[0]
        cfg = self._config
        bound = self._sessions.get(request.session, now) if request.session else None
        per_choice = request.max_tokens // request.sequences

        def depth(r: Replica) -> int:
            return r.queue_depth + (added.get(r.replica_id, 0) if added else 0)

        def kv(r: Replica) -> float:
            more = added.get(r.replica_id, 0) if added else 0
            capacity = r.kv_capacity_tokens
            if not more or capacity <= 0:
                return r.kv_utilisation
            return min(1.0, r.kv_utilisation + more * r.growth_reserve(per_choice) / capacity)

        def score(r: Replica) -> tuple[float, int, str]:
            value = cfg.queue_weight * depth(r) + cfg.kv_weight * kv(r)
            memory = self._prefixes.get(r.replica_id)
            if hashes and memory is not None:
                value -= cfg.prefix_weight * memory.matched(hashes) / len(hashes)
            if r.replica_id == bound:
                value -= cfg.session_weight
            return value, depth(r), r.replica_id

        preferred = min(roomy, key=score)
        least = min(roomy, key=lambda r: (depth(r), kv(r), r.replica_id))
        # Escape hatch: affinity must not outweigh a large imbalance of load.
        return least if depth(preferred) - depth(least) > cfg.imbalance_margin else preferred

    def _remember(
        self, request: RouteRequest, placement: Sequence[Replica], now: float, hashes: tuple[int, ...]
    ) -> None:
        """Remember the prompt's prefix on each replica of the placement, and bind the request's session to
        its first (the one the next request of the session is drawn to)."""
        if hashes:
            for replica in dict.fromkeys(placement):
                memory = self._prefixes.setdefault(
                    replica.replica_id, PrefixMemory(self._config.prefix_lru_size)
                )
                memory.remember(hashes)
        if request.session:
            self._sessions.bind(request.session, placement[0].replica_id, now)
