"""Answers in Redis, shared by every gateway process: `<prefix><key>` = the value, PX the TTL. Redis' own
memory limit and eviction policy bound what it keeps (set `maxmemory-policy allkeys-lru` on a Redis used as a
cache). Every round trip is bounded by `op_timeout`; a failure is ResultStoreUnavailableError."""

from __future__ import annotations

import math

import redis.asyncio

from gateway.redis_client import bounded_client, round_trip
from gateway.result_cache.base import ResultStoreUnavailableError

PREFIX = "lockgate:result:"


class RedisResultStore:
    """`ResultStore` in Redis. The store owns `client`: `aclose` closes it."""

    def __init__(
        self, client: redis.asyncio.Redis, *, ttl: float, op_timeout: float = 0.1, prefix: str = PREFIX
    ) -> None:
        self._client = client
        self._px = max(1, math.ceil(ttl * 1000))
        self._op_timeout = op_timeout
        self._prefix = prefix

    @classmethod
    def from_url(
        cls, url: str, *, ttl: float, op_timeout: float = 0.1, prefix: str = PREFIX
    ) -> RedisResultStore:
        """A store with a client of its own on the Redis at `url` (GET and SET are safe to resend)."""
        return cls(bounded_client(url, op_timeout), ttl=ttl, op_timeout=op_timeout, prefix=prefix)

    async def get(self, key: str) -> bytes | None:
        """See `ResultStore.get`."""
        value = await round_trip(
            self._client.get(self._prefix + key),
            self._op_timeout,
            ResultStoreUnavailableError,
            "the result cache",
        )
        return value if isinstance(value, bytes) else None

    async def put(self, key: str, value: bytes) -> None:
        """See `ResultStore.put`."""
        step = self._client.set(self._prefix + key, value, px=self._px)
        await round_trip(step, self._op_timeout, ResultStoreUnavailableError, "the result cache")

    async def aclose(self) -> None:
        """Close the client's connections (answers stay in Redis for the other processes)."""
        await self._client.aclose()
