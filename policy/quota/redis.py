"""Token buckets in Redis, shared by every gateway replica: one Lua script and one round trip per operation.

Keys (all under `prefix`)::

    bucket:<spec.key>        hash {level, ts}; expires once the bucket would be full again (a missing key is
                             a full bucket, so expiry loses nothing)
    settled:<reservation id> string; SET NX EX 3600 makes reconcile exactly-once

Numbers cross the Lua boundary as strings formatted with %.17g: Redis would truncate a Lua number reply to an
integer, and Lua's own tostring keeps only 14 digits; 17 significant digits round-trip a double exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.commands.core import AsyncScript

from policy.quota.base import (
    BucketSpec,
    QuotaBackendError,
    QuotaExceededError,
    Reservation,
)
from policy.quota.memory import SETTLED_TTL, check_actual, check_request, new_reservation_id

# Shared by the scripts below: refill one bucket to `now` and persist it with an expiry.
_LUA_COMMON = """
local function fmt(x) return string.format('%.17g', x) end
-- Returns level, ts of KEYS[i] refilled to now. A missing key is a full bucket.
local function refill(key, cap, rate, now)
  local state = redis.call('HMGET', key, 'level', 'ts')
  if not state[1] then return cap, now end
  local level, ts = tonumber(state[1]), tonumber(state[2])
  -- Time never goes backwards for a bucket: a lagging clock must not mint tokens.
  local t = math.max(now, ts)
  -- Invariant: level <= cap after every refill.
  return math.min(cap, level + rate * (t - ts)), t
end
local function store(key, cap, rate, level, ts)
  redis.call('HSET', key, 'level', fmt(level), 'ts', fmt(ts))
  if rate > 0 then
    -- Keep the key until it would be full again (longer when in debt), then a missing key says the same.
    redis.call('EXPIRE', key, math.min(math.ceil((cap - level) / rate) + 60, 1e9))
  else
    redis.call('PERSIST', key)
  end
end
"""

# KEYS = buckets; ARGV = now, then capacity, rate, amount per bucket.
# Returns {1, 0, '0', levels after debit...} or {0, limiting bucket (1-based), wait, refilled levels...}.
_RESERVE = (
    _LUA_COMMON
    + """
local now = tonumber(ARGV[1])
local levels, stamps, out = {}, {}, {}
local worst, worst_wait = 0, -1
for i = 1, #KEYS do
  local cap, rate, amount = tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1])
  levels[i], stamps[i] = refill(KEYS[i], cap, rate, now)
  if levels[i] < amount then
    local wait = math.huge
    -- A bucket whose clock is ahead of ours refills only once our clock catches up with it.
    if rate > 0 then wait = (amount - levels[i]) / rate + (stamps[i] - now) end
    if wait > worst_wait then worst, worst_wait = i, wait end
  end
end
if worst > 0 then
  -- Denied: nothing is written, so every bucket is exactly as it was.
  for i = 1, #KEYS do out[i] = fmt(levels[i]) end
  return {0, worst, fmt(worst_wait), unpack(out)}
end
for i = 1, #KEYS do
  local cap, rate, amount = tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1])
  -- Invariant: a debit only lowers the level, so level <= cap still holds.
  store(KEYS[i], cap, rate, levels[i] - amount, stamps[i])
  out[i] = fmt(levels[i] - amount)
end
return {1, 0, '0', unpack(out)}
"""
)

# KEYS = buckets + settled marker; ARGV = now, marker ttl, then capacity, rate, delta (reserved - actual).
# Returns 1 if settled now, 0 if it was settled before.
_RECONCILE = (
    _LUA_COMMON
    + """
local n = #KEYS - 1
local now = tonumber(ARGV[1])
if not redis.call('SET', KEYS[n+1], '1', 'NX', 'EX', ARGV[2]) then return 0 end
for i = 1, n do
  local cap, rate, delta = tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  local level, ts = refill(KEYS[i], cap, rate, now)
  -- Invariant: a refund is capped at cap; an overrun may leave debt (a negative level).
  store(KEYS[i], cap, rate, math.min(cap, level + delta), ts)
end
return 1
"""
)

# KEYS = buckets; ARGV = now, then capacity, rate per bucket. Read-only.
_LEVELS = (
    _LUA_COMMON
    + """
local now, out = tonumber(ARGV[1]), {}
for i = 1, #KEYS do
  out[i] = fmt((refill(KEYS[i], tonumber(ARGV[2*i]), tonumber(ARGV[2*i+1]), now)))
end
return out
"""
)

# What a dead, unreachable or stalled Redis raises; anything else (a script bug) is not the backend's health.
_BACKEND_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError)


class RedisQuotaStore:
    """`QuotaStore` in Redis; every call is bounded by `op_timeout` seconds and fails as QuotaBackendError.

    The store owns `client`: `close` closes it."""

    def __init__(
        self, client: redis.asyncio.Redis, *, prefix: str = "lockgate:quota:", op_timeout: float = 0.25
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._op_timeout = op_timeout
        self._reserve = client.register_script(_RESERVE)
        self._reconcile = client.register_script(_RECONCILE)
        self._levels = client.register_script(_LEVELS)

    def _key(self, spec: BucketSpec) -> str:
        return f"{self._prefix}bucket:{spec.key}"

    async def _run(self, script: AsyncScript, keys: list[str], args: list[float | str]) -> Any:
        """Run one script, bounded by `op_timeout`; a dead Redis must never hang a request."""
        try:
            async with asyncio.timeout(self._op_timeout):
                return await script(keys=keys, args=args)
        except _BACKEND_ERRORS as exc:
            raise QuotaBackendError(f"quota store unavailable: {exc!r}") from exc

    async def reserve(
        self, buckets: Sequence[BucketSpec], amounts: Sequence[float], now: float
    ) -> Reservation:
        """Debit `amounts` from `buckets` at `now`, all or nothing (see `QuotaStore.reserve`)."""
        check_request(buckets, amounts)
        args: list[float | str] = [now]
        for spec, amount in zip(buckets, amounts, strict=True):
            args += [spec.capacity, spec.rate, amount]
        granted, worst, wait, *levels = await self._run(self._reserve, [self._key(b) for b in buckets], args)
        if not int(granted):
            raise QuotaExceededError(buckets[int(worst) - 1].key, float(wait), [float(x) for x in levels])
        return Reservation(
            reservation_id=new_reservation_id(),
            buckets=tuple(buckets),
            amounts=tuple(amounts),
            levels=tuple(float(x) for x in levels),
        )

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        """Refund or charge the difference between reserved and actual; False if already settled."""
        check_actual(reservation, actual)
        keys = [self._key(b) for b in reservation.buckets]
        keys.append(f"{self._prefix}settled:{reservation.reservation_id}")
        args: list[float | str] = [now, str(int(SETTLED_TTL))]
        for spec, reserved, used in zip(reservation.buckets, reservation.amounts, actual, strict=True):
            args += [spec.capacity, spec.rate, reserved - used]
        return bool(int(await self._run(self._reconcile, keys, args)))

    async def levels(self, buckets: Sequence[BucketSpec], now: float) -> tuple[float, ...]:
        """Each bucket's level refilled to `now`; nothing is written."""
        if not buckets:
            return ()
        args: list[float | str] = [now]
        for spec in buckets:
            args += [spec.capacity, spec.rate]
        return tuple(float(x) for x in await self._run(self._levels, [self._key(b) for b in buckets], args))

    async def close(self) -> None:
        """Close the client and its connection pool."""
        await self._client.aclose()
