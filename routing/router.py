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

from collections.abc import Collection, Sequence

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


def reserve(request: RouteRequest, replica: Replica) -> None:
    """Hold the request's KV on `replica` (its prompt and growth reserve) until `Replica.release`."""
    replica.reserve(
        request.request_id,
        len(request.prompt_token_ids),
        replica.growth_reserve(request.max_tokens),
        request.sequences,
    )


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
        prompt, max_tokens = len(request.prompt_token_ids), request.max_tokens
        roomy = [r for r in healthy if r.fits(prompt, max_tokens, request.sequences)]
        if not roomy:
            if all(r.kv_capacity_tokens > 0 and not r.fits_idle(prompt, max_tokens) for r in healthy):
                largest = max(r.kv_capacity_tokens for r in healthy)
                raise RequestTooLargeError(
                    f"{prompt} prompt tokens + {healthy[0].growth_reserve(max_tokens)} reserved for output "
                    f"exceed the KV cache of every replica (largest {largest} tokens)"
                )
            return None
        return self._pick(request, roomy, now)

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

    def forget(self, replica_id: str) -> None:
        """Drop what is remembered of a replica that left the pool."""
        self._prefixes.pop(replica_id, None)

    def _pick(self, request: RouteRequest, roomy: Sequence[Replica], now: float) -> Replica:
        cfg = self._config
        hashes = prefix_block_hashes(
            request.prompt_token_ids,
            block_size=cfg.block_size,
            depth=cfg.affinity_depth,
            salt=request.cache_salt,
        )
        bound = self._sessions.get(request.session, now) if request.session else None

        def score(r: Replica) -> tuple[float, int, str]:
            value = cfg.queue_weight * r.queue_depth + cfg.kv_weight * r.kv_utilisation
            memory = self._prefixes.get(r.replica_id)
            if hashes and memory is not None:
                value -= cfg.prefix_weight * memory.matched(hashes) / len(hashes)
            if r.replica_id == bound:
                value -= cfg.session_weight
            return value, r.queue_depth, r.replica_id

        if len(roomy) == 1:  # nothing to weigh (the usual pool of one): still remembered below
            chosen = roomy[0]
        else:
            preferred = min(roomy, key=score)
            least = min(roomy, key=lambda r: (r.queue_depth, r.kv_utilisation, r.replica_id))
            # Escape hatch: affinity must not outweigh a large imbalance of load.
            chosen = least if preferred.queue_depth - least.queue_depth > cfg.imbalance_margin else preferred
        if hashes:
            memory = self._prefixes.setdefault(chosen.replica_id, PrefixMemory(cfg.prefix_lru_size))
            memory.remember(hashes)
        if request.session:
            self._sessions.bind(request.session, chosen.replica_id, now)
        return chosen
