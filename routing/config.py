"""Settings of replica bookkeeping (`ReplicaConfig`) and of the router (`RouterConfig`), grouped in
`RoutingConfig` for the gateway's config file."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engines.breaker import BreakerPolicy

_NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
_PosInt = Annotated[int, msgspec.Meta(ge=1)]
_NonNeg = Annotated[float, msgspec.Meta(ge=0)]
_Pos = Annotated[float, msgspec.Meta(gt=0)]


def _replica_breaker() -> BreakerPolicy:
    # An engine that died rarely comes back within seconds (a restart loads the weights again), so the
    # replica stays out for a while; three fatal errors in a row are enough to tell a death from bad luck.
    return BreakerPolicy(threshold=3, cooldown=15.0)


class ReplicaConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How each replica's KV budget, load and health are kept."""

    # Most tokens of output reserved per request on top of its prompt: reserve = prompt + min(max_tokens,
    # cap). Reserving all of max_tokens would under-use the cache (most requests stop far earlier than
    # max_tokens); a request that outgrows its reserve is counted as it grows (`Replica.grow`), and if the
    # engine runs out of blocks anyway vLLM preempts a sequence (recompute) instead of failing it.
    growth_reserve_cap: _NonNegInt = 512
    # Sequences sent to a replica beyond the most it runs at once (`EngineLoad.max_running`, vLLM's
    # `max_num_seqs`): they wait in the engine's own queue, so a slot that one step frees is filled in the
    # next without a round trip through the gateway. Everything beyond waits in the gateway's fair queue,
    # where tenant fairness and deadlines apply (in the engine's queue only the class priority does).
    engine_queue: _NonNegInt = 2
    # Consecutive failed health checks or fatal errors (EngineDeadError) that take a replica out, and the
    # seconds it stays out before one trial request or health probe may test it.
    breaker: BreakerPolicy = msgspec.field(default_factory=_replica_breaker)
    # Seconds a replica that refused a request for shutting down (EngineDrainingError: a vLLM server told to
    # stop drains what it runs and refuses the rest) stays out of routing, unless a health check fails first
    # (the process has left; the breaker and health checks take over until its successor answers). vLLM's
    # /health still answers 200 while it drains and tears down, and a request sent in its teardown hangs.
    drain_hold: _Pos = 120.0
    # Seconds between two `Replica.refresh()` calls (load and health) made by the replica's owner.
    refresh_interval: _Pos = 1.0
    # Seconds one refresh may take (health and load together); a slower engine counts as a failed check.
    refresh_timeout: _Pos = 2.0
    # Where gateway processes that share remote replicas lease each one's capacity (`routing.capacity`):
    # "redis" in the quota store's Redis (or `capacity_ledger_url`); "none": each process admits against
    # the replica's last load report less what the others used at it; "auto": "redis" when the quota store
    # is Redis and a replica is remote (an engine other gateways may reach), else "none".
    capacity_ledger: Literal["auto", "redis", "none"] = "auto"
    # Redis URL of the ledger; "" = `quota.redis_url` (required with a Redis Cluster quota store).
    capacity_ledger_url: str = ""


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Weights of the router's score and the sizes of its affinity memories."""

    # Score (lower wins) per request queued or running on the replica, as reported plus our own in-flight
    # requests dispatched since its last load report.
    queue_weight: _NonNeg = 1.0
    # Score per unit of KV utilisation (0 = empty cache, 1 = full): a full cache weighs like 4 queued
    # requests.
    kv_weight: _NonNeg = 4.0
    # Bonus (subtracted) for a replica that recently served the request's leading prompt blocks, times the
    # fraction of the request's hashed blocks it holds: the shared prefix is likely still in its cache.
    prefix_weight: _NonNeg = 2.0
    # Bonus (subtracted) for the replica the request's session was last routed to.
    session_weight: _NonNeg = 3.0
    # Tokens per hashed prompt block (vLLM's default KV block size is 16; the engine caches whole blocks).
    block_size: _PosInt = 16
    # Leading blocks hashed per request: longer shared prefixes are not told apart beyond this.
    affinity_depth: _NonNegInt = 32
    # Prefix block hashes remembered per replica (least recently routed forgotten first).
    prefix_lru_size: _NonNegInt = 4096
    # Sessions remembered (least recently seen forgotten first).
    session_lru_size: _NonNegInt = 65536
    # Seconds a session stays bound to its replica after its last request.
    session_ttl: _Pos = 900.0
    # Escape hatch: when the replica the score prefers has more than this many requests queued and running
    # beyond the least loaded candidate, the least loaded one is chosen and affinity is ignored.
    imbalance_margin: _NonNegInt = 8


class RoutingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the `routing` package is configured with."""

    # Replica bookkeeping: KV growth reserve, circuit breaker, load refresh.
    replicas: ReplicaConfig = msgspec.field(default_factory=ReplicaConfig)
    # Router score and affinity.
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
