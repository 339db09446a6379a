"""Answers by `Idempotency-Key` in Redis, shared by every gateway process (`lockgate serve --workers N`).

One hash per entry, named `<prefix><entry name>` (the name is already a digest, `replay.entry_name`)::

    fp      the fingerprint of the request that claimed it
    token   the claim's token (only its holder completes or releases it)
    answer  msgpack(StoredAnswer), once completed

with PX `pending_timeout` while claimed and `window` once answered. Claim, complete and release are one Lua
script each, so two processes claiming one key at once get one Fresh claim between them. Every round trip is
bounded by `op_timeout`; a Redis error or timeout is IdempotencyStoreUnavailableError.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
import redis.asyncio
import redis.exceptions

from gateway.idempotency.base import (
    Claim,
    Fresh,
    IdempotencyStoreUnavailableError,
    InFlight,
    Mismatch,
    Replay,
    StoredAnswer,
)
from gateway.redis_client import bounded_client, round_trip

T = TypeVar("T")
PREFIX = "lockgate:idempotency:"
# KEYS: the entry. ARGV: fingerprint, token, PX. Nil when claimed now, else {fp, answer or false}.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then
    return redis.call('HMGET', KEYS[1], 'fp', 'answer')
end
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'token', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return false
"""
# KEYS: the entry. ARGV: token, answer, PX.
_COMPLETE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] and redis.call('HEXISTS', KEYS[1], 'answer') == 0 then
    redis.call('HSET', KEYS[1], 'answer', ARGV[2])
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return 1
end
return 0
"""
# KEYS: the entry. ARGV: token.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] and redis.call('HEXISTS', KEYS[1], 'answer') == 0 then
    return redis.call('DEL', KEYS[1])
end
return 0
"""
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StoredAnswer)


def _px(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


class RedisIdempotencyStore:
    """`IdempotencyStore` in Redis. The store owns `client`: `aclose` closes it."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        window: float,
        pending_timeout: float,
        op_timeout: float = 0.5,
        prefix: str = PREFIX,
    ) -> None:
        self._client = client
        self._claim = client.register_script(_CLAIM)
        self._complete = client.register_script(_COMPLETE)
        self._release = client.register_script(_RELEASE)
        self._window = window
        self._pending_timeout = pending_timeout
        self._op_timeout = op_timeout
        self._prefix = prefix

    @classmethod
    def from_url(
        cls, url: str, *, window: float, pending_timeout: float, op_timeout: float = 0.5, prefix: str = PREFIX
    ) -> RedisIdempotencyStore:
        """A store with a client of its own on the Redis at `url` (connects on first use)."""
        # Resent once after a Redis restart (`bounded_client`): a claim that did land answers the resend as
        # held by someone (the request gets 409 and its SDK retries; the claim lapses after pending_timeout),
        # never as two Fresh claims; complete and release check the token.
        client = bounded_client(url, op_timeout)
        return cls(
            client, window=window, pending_timeout=pending_timeout, op_timeout=op_timeout, prefix=prefix
        )

    async def _call(self, step: Awaitable[T]) -> T:
        return await round_trip(
            step, self._op_timeout, IdempotencyStoreUnavailableError, "the idempotency store"
        )

    async def claim(self, name: str, fingerprint: str) -> Claim:
        """See `IdempotencyStore.claim`."""
        token = secrets.token_hex(16)
        found: Any = await self._call(
            self._claim(keys=[self._prefix + name], args=[fingerprint, token, _px(self._pending_timeout)])
        )
        if found is None:
            return Fresh(token)
        stored_fp, answer = found
        if stored_fp is None or stored_fp.decode() != fingerprint:
            return Mismatch()
        if answer is None:
            return InFlight()
        try:
            return Replay(_DECODER.decode(answer))
        except msgspec.DecodeError:
            # Not written by this store: never replayed, and never run twice either.
            return Mismatch()

    async def complete(self, name: str, token: str, answer: StoredAnswer) -> None:
        """See `IdempotencyStore.complete`."""
        args: list[str | bytes | int] = [token, _ENCODER.encode(answer), _px(self._window)]
        await self._call(self._complete(keys=[self._prefix + name], args=args))

    async def release(self, name: str, token: str) -> None:
        """See `IdempotencyStore.release`."""
        await self._call(self._release(keys=[self._prefix + name], args=[token]))

    async def aclose(self) -> None:
        """Close the client's connections (answers stay in Redis for the other processes)."""
        await self._client.aclose()
