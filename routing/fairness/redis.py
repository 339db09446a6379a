"""`RedisCounters`: the fleet's virtual token counters in Redis (`routing.fairness.base`).

One hash per tenant, `lockgate:fair:{<tenant>}` (the tenant's hash tag, as its quota buckets have), a field
per fair queue (model weights). A sync is one pipeline of one script call per tenant. A tenant's counters
expire `ttl` seconds after its last sync (a tenant idle that long restarts from the virtual time anyway).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio
import redis.exceptions

from routing.fairness.base import CountersUnavailableError, CounterUpdate

_SYNC = """
local value = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') + tonumber(ARGV[2])
value = math.max(value, tonumber(ARGV[3]))
local text = string.format('%.17g', value)
redis.call('HSET', KEYS[1], ARGV[1], text)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return text
"""


def counters_key(tenant: str) -> str:
    """The hash of `tenant`'s counters."""
    return f"lockgate:fair:{{{tenant}}}"


class RedisCounters:
    """Shared counters in Redis (module docstring), each sync bounded by `op_timeout` seconds."""

    def __init__(
        self, client: redis.asyncio.Redis | redis.asyncio.RedisCluster, op_timeout: float, ttl: float = 3600.0
    ) -> None:
        self._client = client
        self._op_timeout = op_timeout
        self._ttl_ms = str(int(ttl * 1000))
        self._script = client.register_script(_SYNC)

    async def sync(self, queue: str, updates: Sequence[CounterUpdate]) -> list[float]:
        if not updates:
            return []
        calls = [
            ([counters_key(u.tenant)], [queue, repr(u.delta), repr(u.floor), self._ttl_ms]) for u in updates
        ]
        try:
            async with asyncio.timeout(self._op_timeout):
                if isinstance(self._client, redis.asyncio.RedisCluster):
                    # Each tenant's hash on its own node: one call each, routed by its key.
                    replies = await asyncio.gather(*(self._script(keys=k, args=a) for k, a in calls))
                else:
                    pipe = self._client.pipeline(transaction=False)
                    for keys, args in calls:
                        await self._script(keys=keys, args=args, client=pipe)
                    replies = await pipe.execute()
        except (redis.exceptions.RedisError, TimeoutError, OSError) as exc:
            raise CountersUnavailableError(f"the shared fairness counters are unavailable: {exc!r}") from exc
        return [float(r) for r in replies]

    async def close(self) -> None:
        await self._client.aclose()
