"""`RedisLedger`: capacity leases in Redis, shared by every gateway process on it (`routing.capacity.base`).

One hash per engine replica, `lockgate:capacity:{<replica>}` (its own hash tag: a Redis Cluster keeps each
replica's leases on one node), a field per holder: "lease_tokens lease_sequences want_tokens want_sequences
expires". One script renews a lease atomically: it drops lapsed leases, sums the others, grants, stores.
Expiry is on the callers' clock (`now`): gateway hosts are assumed to keep time within a fraction of `ttl`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio
import redis.exceptions

from routing.capacity.base import Capacity, LedgerUnavailableError

_RENEW = """
local key, holder = KEYS[1], ARGV[1]
local want_t, want_s = tonumber(ARGV[2]), tonumber(ARGV[3])
local used_t, used_s = tonumber(ARGV[4]), tonumber(ARGV[5])
local budget_t, budget_s = tonumber(ARGV[6]), tonumber(ARGV[7])
local now, ttl = tonumber(ARGV[8]), tonumber(ARGV[9])
local entries = redis.call('HGETALL', key)
local others_t, others_s, wants_t, wants_s = 0, 0, want_t, want_s
for i = 1, #entries, 2 do
  local name = entries[i]
  local lt, ls, wt, ws, exp = string.match(entries[i + 1], '(%S+) (%S+) (%S+) (%S+) (%S+)')
  if tonumber(exp) <= now then
    redis.call('HDEL', key, name)
  elseif name ~= holder then
    others_t, others_s = others_t + tonumber(lt), others_s + tonumber(ls)
    wants_t, wants_s = wants_t + tonumber(wt), wants_s + tonumber(ws)
  end
end
local function grant(want, used, others, wants, budget)
  local target = want
  if wants > budget then target = math.floor(budget * want / math.max(wants, 1)) end
  return math.max(used, math.max(0, math.min(want, target, budget - others)))
end
local gt = grant(want_t, used_t, others_t, wants_t, budget_t)
local gs = grant(want_s, used_s, others_s, wants_s, budget_s)
redis.call('HSET', key, holder, string.format('%d %d %d %d %.6f', gt, gs, want_t, want_s, now + ttl))
redis.call('PEXPIRE', key, math.ceil(ttl * 2000))
return {gt, gs}
"""


T = TypeVar("T")


def ledger_key(replica: str) -> str:
    """The hash of `replica`'s leases."""
    return f"lockgate:capacity:{{{replica}}}"


class RedisLedger:
    """Capacity leases in Redis (module docstring); each operation bounded by `op_timeout` seconds."""

    def __init__(self, client: redis.asyncio.Redis, op_timeout: float) -> None:
        self._client = client
        self._op_timeout = op_timeout
        self._renew = client.register_script(_RENEW)

    async def renew(
        self,
        replica: str,
        holder: str,
        *,
        want: Capacity,
        used: Capacity,
        budget: Capacity,
        now: float,
        ttl: float,
    ) -> Capacity:
        args: list[str | int | float] = [holder, want.tokens, want.sequences, used.tokens, used.sequences]
        args += [budget.tokens, budget.sequences, repr(now), repr(ttl)]
        reply = await self._bounded(self._renew(keys=[ledger_key(replica)], args=args))
        tokens, sequences = reply
        return Capacity(int(tokens), int(sequences))

    async def release(self, replica: str, holder: str) -> None:
        await self._bounded(self._client.hdel(ledger_key(replica), holder))

    async def close(self) -> None:
        await self._client.aclose()

    async def _bounded(self, step: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self._op_timeout):
                return await step
        except (redis.exceptions.RedisError, TimeoutError, OSError) as exc:
            raise LedgerUnavailableError(f"the capacity ledger is unavailable: {exc!r}") from exc
