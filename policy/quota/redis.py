"""Token buckets in Redis, shared by every gateway replica: one Lua script and one round trip per operation.

Keys (all under `prefix`)::

    bucket:<spec.key>         hash {level, ts}; expires once the bucket would be full again (a missing key is
                              a full bucket, so expiry loses nothing)
    res:{<tag>}:<id>          hash {s, lv}: the reservation record. s = "r" granted (lv: the levels after the
                              debit, replayed to a retried reserve; EX RECORD_TTL, an hour), s = "x" settled
                              or voided (a tombstone: reserve refuses the id, reconcile is a no-op; EX
                              TOMBSTONE_TTL, five minutes)

`<tag>` is the Redis Cluster hash tag of the first bucket key (the meter names every bucket of a tenant
`...{tenant}...`), so all keys one script touches live in one cluster slot.

Time: by default the scripts read the Redis server's clock (`TIME`), so gateway replicas with skewed clocks
cannot refill a bucket faster; `server_time=False` uses the caller's `now` (deterministic tests). Redis >= 5
replicates script effects, so `TIME` before writes is allowed.

Numbers cross the Lua boundary as strings formatted with %.17g: Redis would truncate a Lua number reply to an
integer, and Lua's own tostring keeps only 14 digits; 17 significant digits round-trip a double exactly.

Operations in flight: at most `pool_size`; the next waits up to `pool_timeout` for a free slot and then fails
as QuotaBusyError (our own load), never as QuotaBackendError (Redis unreachable), and `op_timeout` bounds only
the round trip itself, not the wait for a slot. On one server every script runs on one pipelined connection of
the store's own (`redis_direct.py`: commands written as they come, replies matched in order, without
redis-py's client layers); a Cluster client routes them itself, on up to `pool_size` connections per node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.commands.core import AsyncScript

from policy.quota.base import (
    BucketSpec,
    QuotaBackendError,
    QuotaBusyError,
    QuotaExceededError,
    Reservation,
    ReservationClosedError,
)
from policy.quota.memory import (
    RECORD_TTL,
    TOMBSTONE_TTL,
    check_actual,
    check_request,
    new_reservation_id,
)
from policy.quota.redis_direct import DirectConnections

# Shared by the scripts below: the clock, and refill one bucket to `now` and persist it with an expiry.
_LUA_COMMON = """
local function fmt(x) return string.format('%.17g', x) end
-- The caller's time, or (empty argument) the server's: one clock for every replica.
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
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

# KEYS = buckets, then the reservation record; ARGV = now ('' = server time), record ttl, then capacity,
# rate, amount per bucket. Returns {1, 0, '0', levels after debit...} (granted now), {2, 0, '0', levels...}
# (granted before: replayed, nothing debited), {-1, 0, '0'} (id closed), or {0, limiting bucket (1-based),
# wait, refilled levels...} (denied).
_RESERVE = (
    _LUA_COMMON
    + """
local n = #KEYS - 1
local rec = KEYS[n+1]
local seen = redis.call('HMGET', rec, 's', 'lv')
if seen[1] == 'x' then return {-1, 0, '0'} end
if seen[1] == 'r' then
  local out = {2, 0, '0'}
  for lv in string.gmatch(seen[2], '[^,]+') do out[#out+1] = lv end
  return out
end
local now = clock(ARGV[1])
local levels, stamps, out = {}, {}, {}
local worst, worst_wait = 0, -1
for i = 1, n do
  local cap, rate, amount = tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  levels[i], stamps[i] = refill(KEYS[i], cap, rate, now)
  if levels[i] < amount then
    local wait = math.huge
    -- A bucket whose clock is ahead of ours refills only once our clock catches up with it.
    if rate > 0 then wait = (amount - levels[i]) / rate + (stamps[i] - now) end
    if wait > worst_wait then worst, worst_wait = i, wait end
  end
end
if worst > 0 then
  -- Denied: nothing is written (not even the record), so every bucket is exactly as it was.
  for i = 1, n do out[i] = fmt(levels[i]) end
  return {0, worst, fmt(worst_wait), unpack(out)}
end
for i = 1, n do
  local cap, rate, amount = tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  -- Invariant: a debit only lowers the level, so level <= cap still holds.
  store(KEYS[i], cap, rate, levels[i] - amount, stamps[i])
  out[i] = fmt(levels[i] - amount)
end
redis.call('HSET', rec, 's', 'r', 'lv', table.concat(out, ','))
redis.call('EXPIRE', rec, ARGV[2])
return {1, 0, '0', unpack(out)}
"""
)

# KEYS = buckets, then the reservation record; ARGV = now ('' = server time), tombstone ttl, then capacity,
# rate, delta (reserved - actual) per bucket. Returns 1 if a granted reservation was settled now, 0 if it was
# settled before or never granted (the record becomes a tombstone either way).
_RECONCILE = (
    _LUA_COMMON
    + """
local n = #KEYS - 1
local rec = KEYS[n+1]
local state = redis.call('HGET', rec, 's')
if state == 'x' then return 0 end
redis.call('HSET', rec, 's', 'x')
redis.call('HDEL', rec, 'lv')
redis.call('EXPIRE', rec, ARGV[2])
-- Never granted (a reserve that timed out before it ran, or ran and was denied): nothing to refund, and the
-- tombstone makes a late arrival of that reserve a no-op.
if state ~= 'r' then return 0 end
local now = clock(ARGV[1])
for i = 1, n do
  local cap, rate, delta = tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  local level, ts = refill(KEYS[i], cap, rate, now)
  -- Invariant: a refund is capped at cap; an overrun may leave debt (a negative level).
  store(KEYS[i], cap, rate, math.min(cap, level + delta), ts)
end
return 1
"""
)

# KEYS = buckets; ARGV = now ('' = server time), then capacity, rate per bucket. Read-only.
_LEVELS = (
    _LUA_COMMON
    + """
local now, out = clock(ARGV[1]), {}
for i = 1, #KEYS do
  out[i] = fmt((refill(KEYS[i], tonumber(ARGV[2*i]), tonumber(ARGV[2*i+1]), now)))
end
return out
"""
)

# What a dead, unreachable or stalled Redis raises; anything else (a script bug) is not the backend's health.
log = logging.getLogger("lockgate.quota")
_BACKEND_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError)

Client = redis.asyncio.Redis | redis.asyncio.RedisCluster


def hash_tag(key: str) -> str | None:
    """The part of `key` Redis Cluster hashes when it has one: between the first `{` and the next `}`."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


class RedisQuotaStore:
    """`QuotaStore` in Redis (one server or a Redis Cluster); every round trip is bounded by `op_timeout`
    seconds and fails as QuotaBackendError.

    The store owns `client`: `close` closes it."""

    def __init__(
        self,
        client: Client,
        *,
        prefix: str = "lockgate:quota:",
        op_timeout: float = 0.25,
        pool_size: int | None = None,
        pool_timeout: float = 1.0,
        server_time: bool = True,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._op_timeout = op_timeout
        # At most `pool_size` scripts in flight, so the client's own pool never has to refuse or block: the
        # wait for a slot is ours, bounded by `pool_timeout` and separate from `op_timeout`.
        self._slots = asyncio.Semaphore(pool_size) if pool_size else None
        self._pool_size = pool_size or 0
        self._pool_timeout = pool_timeout
        self._server_time = server_time
        self._cluster = isinstance(client, redis.asyncio.RedisCluster)
        # One server: scripts run on connections of our own (redis_direct); a cluster's client routes them.
        self._direct = (
            DirectConnections(client.connection_pool, stale_after=op_timeout / 2)
            if isinstance(client, redis.asyncio.Redis)
            else None
        )
        self._reserve = client.register_script(_RESERVE)
        self._reconcile = client.register_script(_RECONCILE)
        self._levels = client.register_script(_LEVELS)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool = False,
        pool_size: int = 50,
        pool_timeout: float = 1.0,
        op_timeout: float = 0.25,
        prefix: str = "lockgate:quota:",
        server_time: bool = True,
    ) -> RedisQuotaStore:
        """A store with a client of its own: one pipelined connection to one server, or a Redis Cluster client
        (`cluster`, `url` naming any node) with up to `pool_size` connections per node; at most `pool_size`
        operations in flight either way."""
        # No socket_timeout: `_run` bounds each whole round trip by op_timeout already, and with one redis-py
        # sends every command from a task of its own (`asyncio.wait_for` on Python 3.11) and arms a timer per
        # reply read. A round trip cut off by `_run` disconnects its connection, as a socket timeout would.
        client: Client
        if cluster:
            client = redis.asyncio.RedisCluster.from_url(
                url,
                max_connections=pool_size,
                socket_timeout=None,
                socket_connect_timeout=op_timeout,
            )
        else:
            # The pool only makes the connection (its settings: URL, credentials, timeouts): the store keeps
            # it itself (redis_direct), and opens another after a restart.
            pool = redis.asyncio.ConnectionPool.from_url(
                url, socket_timeout=None, socket_connect_timeout=op_timeout
            )
            client = redis.asyncio.Redis.from_pool(pool)
        return cls(
            client,
            prefix=prefix,
            op_timeout=op_timeout,
            pool_size=pool_size,
            pool_timeout=pool_timeout,
            server_time=server_time,
        )

    def _key(self, spec: BucketSpec) -> str:
        return f"{self._prefix}bucket:{spec.key}"

    def _keys(self, buckets: Sequence[BucketSpec], reservation_id: str) -> list[str]:
        """The bucket keys and the reservation record's key, all under the first bucket's hash tag."""
        keys = [self._key(b) for b in buckets]
        tag = hash_tag(keys[0]) if keys else None
        if tag is None:
            keys.append(f"{self._prefix}res:{reservation_id}")
        else:
            keys.append(f"{self._prefix}res:{{{tag}}}:{reservation_id}")
        if self._cluster and (tag is None or any(hash_tag(k) != tag for k in keys)):
            # One script must stay in one cluster slot; Redis would refuse it with CROSSSLOT.
            raise ValueError(f"keys {keys} do not share one hash tag: they cannot run on Redis Cluster")
        return keys

    def _now(self, now: float) -> float | str:
        return "" if self._server_time else now

    async def _run(self, script: AsyncScript, keys: list[str], args: list[float | str]) -> Any:
        """Run one script: wait (bounded) for a connection slot, then one round trip bounded by `op_timeout`;
        a dead Redis must never hang a request, and our own pool must never look like a dead Redis."""
        slots = self._slots
        if slots is not None and not slots.locked():
            await slots.acquire()  # a slot is free: taken at once, no timer to arm
        elif slots is not None:
            try:
                async with asyncio.timeout(self._pool_timeout):
                    await slots.acquire()
            except TimeoutError:
                raise QuotaBusyError(
                    f"no Redis operation slot came free within {self._pool_timeout:g} s"
                ) from None
        try:
            async with asyncio.timeout(self._op_timeout):
                if self._direct is not None:
                    return await self._direct.evalsha(script, keys, args)
                return await script(keys=keys, args=args)
        except redis.exceptions.MaxConnectionsError as exc:
            # The client's own pool is full (shared beyond `pool_size`): our load, not Redis's health.
            raise QuotaBusyError(f"Redis connection pool exhausted: {exc!r}") from exc
        except _BACKEND_ERRORS as exc:
            raise QuotaBackendError(f"quota store unavailable: {exc!r}") from exc
        finally:
            if self._slots is not None:
                self._slots.release()

    async def reserve(
        self,
        buckets: Sequence[BucketSpec],
        amounts: Sequence[float],
        now: float,
        reservation_id: str | None = None,
    ) -> Reservation:
        """Debit `amounts` from `buckets`, all or nothing, idempotent by `reservation_id` (see
        `QuotaStore.reserve`); at Redis server time unless the store was made with `server_time=False`."""
        check_request(buckets, amounts)
        rid = reservation_id or new_reservation_id()
        args: list[float | str] = [self._now(now), str(int(RECORD_TTL))]
        for spec, amount in zip(buckets, amounts, strict=True):
            args += [spec.capacity, spec.rate, amount]
        code, worst, wait, *levels = await self._run(self._reserve, self._keys(buckets, rid), args)
        if int(code) == -1:
            raise ReservationClosedError(rid)
        if int(code) == 0:
            raise QuotaExceededError(buckets[int(worst) - 1].key, float(wait), [float(x) for x in levels])
        return Reservation(
            reservation_id=rid,
            buckets=tuple(buckets),
            amounts=tuple(amounts),
            levels=tuple(float(x) for x in levels),
        )

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        """Refund or charge the difference between reserved and actual; False if already settled or never
        granted (see `QuotaStore.reconcile`)."""
        check_actual(reservation, actual)
        keys = self._keys(reservation.buckets, reservation.reservation_id)
        args: list[float | str] = [self._now(now), str(int(TOMBSTONE_TTL))]
        for spec, reserved, used in zip(reservation.buckets, reservation.amounts, actual, strict=True):
            args += [spec.capacity, spec.rate, reserved - used]
        return bool(int(await self._run(self._reconcile, keys, args)))

    async def levels(self, buckets: Sequence[BucketSpec], now: float) -> tuple[float, ...]:
        """Each bucket's level refilled to now (server or caller time); nothing is written."""
        if not buckets:
            return ()
        args: list[float | str] = [self._now(now)]
        for spec in buckets:
            args += [spec.capacity, spec.rate]
        return tuple(float(x) for x in await self._run(self._levels, [self._key(b) for b in buckets], args))

    async def warm(self) -> int:
        """Open the connection now, so that the first requests do not wait while it is set up on the event
        loop (about a millisecond of the loop's CPU: handshake and client set-up). Best effort: a Redis that
        is down is the meter's outage to handle, not start-up's. How many are open (0 or 1); a Cluster
        client (one pool per node, found as keys are used) opens none."""
        if self._direct is None:
            return 0
        try:
            async with asyncio.timeout(self._op_timeout * 4):
                await self._direct.open()
        except (TimeoutError, *_BACKEND_ERRORS) as exc:
            log.warning("quota store: the Redis connection did not open at start: %r", exc)
        return len(self._direct)

    async def close(self) -> None:
        """Close the store's connections, the client and its connection pool."""
        if self._direct is not None:
            await self._direct.close()
        await self._client.aclose()
