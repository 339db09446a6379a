"""`Idempotency-Key` on the generation routes: the `IdempotencyStore` protocol, its in-process and Redis
backends, the request side (`replay.Idempotency`), and the builder that picks a backend from
`[idempotency]`."""

from gateway.config import Config
from gateway.idempotency.base import IdempotencyStore
from gateway.idempotency.memory import MemoryIdempotencyStore
from gateway.idempotency.redis import RedisIdempotencyStore
from gateway.idempotency.replay import Idempotency
from policy.clock import Clock

__all__ = ["Idempotency", "open_idempotency"]


def open_idempotency(config: Config, clock: Clock) -> Idempotency | None:
    """What `[idempotency]` asks for (None: off): answers kept in this process, or in Redis (at its
    `redis_url`, or the quota store's when that is empty) for every gateway process to share."""
    settings = config.idempotency
    if not settings.enabled:
        return None
    store: IdempotencyStore
    if settings.backend == "redis":
        store = RedisIdempotencyStore.from_url(
            settings.redis_url or config.quota.redis_url,
            window=settings.window,
            pending_timeout=settings.pending_timeout,
            op_timeout=settings.op_timeout,
        )
    else:
        store = MemoryIdempotencyStore(
            clock,
            window=settings.window,
            pending_timeout=settings.pending_timeout,
            max_entries=settings.max_entries,
            max_bytes=settings.max_bytes,
        )
    return Idempotency(store, max_answer_bytes=settings.max_answer_bytes)
