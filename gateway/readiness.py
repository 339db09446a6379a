"""`/readyz`'s report: every pool has a ready engine and the registry view is fresh, checked at most once per
`[server] readiness_cache` seconds of the injected clock however many probes come (a flood of anonymous
probes must not become a flood of health calls to every replica)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgspec

from engines.supervisor import SupervisedEngine
from gateway.generation.context import Generation


class Readiness(msgspec.Struct, frozen=True, kw_only=True):
    """One round of health checks: whether the gateway is ready, and the operator's detailed body."""

    ready: bool
    # `status`, `engines` (replica id: ready), `pools`, `registry`, and `detail` naming the engines down.
    body: dict[str, Any]


class ReadinessCheck:
    """The last `Readiness`, checked again once it is `ttl` seconds old."""

    def __init__(self, gen: Generation, ttl: float) -> None:
        self._gen = gen
        self._ttl = ttl
        # Probes that arrive while a round runs wait for it instead of starting their own.
        self._lock = asyncio.Lock()
        self._last: Readiness | None = None
        self._expires = -math.inf

    async def check(self) -> Readiness:
        """The readiness of at most `ttl` seconds ago (with ttl 0, of now)."""
        async with self._lock:
            now = self._gen.clock()
            if self._last is None or now >= self._expires:
                self._last = await _check(self._gen)
                self._expires = now + self._ttl
            return self._last


def unrecoverable(gen: Generation) -> str:
    """Why this gateway cannot recover without a restart of its process ("" while it can): an engine in this
    process (any generation replica, or a guard pool's) whose supervisor gave up restarting it."""
    engines = [r.engine for r in gen.scheduler.replicas]
    engines += [gen.pools[pool] for pool in sorted(gen.guard_pools)]
    dead = {
        id(e): f"engine {e.replica_id} could not be restarted: {e.last_error}"
        for e in engines
        if isinstance(e, SupervisedEngine) and not e.alive
    }
    return "; ".join(dead.values())


async def _check(gen: Generation) -> Readiness:
    """Every pool has a ready engine (the generation replicas and the guards' pools), and the registry view is
    fresh (refreshed within `registry.max_staleness` seconds, its refresher running)."""
    engines = [(r.pool, r.engine) for r in gen.scheduler.replicas]
    engines += [(pool, gen.pools[pool]) for pool in sorted(gen.guard_pools)]
    healths = [(pool, engine.replica_id, await engine.health()) for pool, engine in engines]
    pools: dict[str, bool] = {}
    for pool, _, health in healths:
        pools[pool] = pools.get(pool, False) or health.ready
    # The registry part: "stale" with the view's age while refreshes keep failing (the last view is still
    # served, but a replica that cannot see rollouts should leave the load balancer's rotation).
    registry = gen.registry.health(gen.config.registry.max_staleness)
    ready = all(pools.values()) and registry.ready
    body: dict[str, Any] = {
        "status": "ready" if ready else "not_ready",
        "engines": {replica_id: health.ready for _, replica_id, health in healths},
        "pools": pools,
        # Measured step times (seconds) of the engines that have them: how fast this host runs each model.
        "step_seconds": {
            replica_id: round(health.step_seconds, 4)
            for _, replica_id, health in healths
            if health.step_seconds is not None
        },
        "registry": {
            "status": "fresh" if registry.ready else "stale",
            "age_s": round(registry.age_s, 3),
            "generation": registry.generation,
            "refresher": registry.refresher,
            "consecutive_failures": registry.consecutive_failures,
            "last_error": registry.last_error,
        },
    }
    down = [f"{pool} {replica_id}: {h.detail}" for pool, replica_id, h in healths if not h.ready]
    if down:
        body["detail"] = "; ".join(down)
    return Readiness(ready=ready, body=body)
