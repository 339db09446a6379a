"""What the gateway's own small Redis stores share (console sessions, idempotency): a client bounded by one
operation timeout that survives a Redis restart, and round trips whose failures become the store's own
"unavailable" error."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

T = TypeVar("T")


def bounded_client(url: str, op_timeout: float) -> redis.asyncio.Redis:
    """A client on the Redis at `url` (connects on first use) whose socket operations take at most
    `op_timeout`. After a Redis restart every pooled connection is dead: it reconnects and resends a command
    once rather than report an outage (the stores' commands are safe to resend: each says why)."""
    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=op_timeout,
        socket_connect_timeout=op_timeout,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
    )


async def round_trip(step: Awaitable[T], op_timeout: float, unavailable: type[Exception], what: str) -> T:
    """`step`, bounded by `op_timeout`; a Redis error or timeout becomes `unavailable` ("`what` is
    unavailable: ...")."""
    try:
        async with asyncio.timeout(op_timeout):
            return await step
    except (redis.exceptions.RedisError, TimeoutError) as exc:
        raise unavailable(f"{what} is unavailable: {exc!r}") from exc
