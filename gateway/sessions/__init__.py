"""Server-side sessions bound to the versions they started on: the `SessionStore` protocol, its in-process,
Redis and PostgreSQL backends, the session logic (`service.Sessions`), and the builder that picks a backend
from `[sessions]`. The routes are `gateway.api.sessions`; a step as a chat
completion (both routes') is `gateway.edge.sessions`."""

from gateway.config import Config
from gateway.sessions.base import SessionStore
from gateway.sessions.memory import MemorySessionStore
from gateway.sessions.postgres import PostgresSessionStore
from gateway.sessions.redis import RedisSessionStore
from gateway.sessions.service import Sessions
from policy.clock import Clock

__all__ = ["Sessions", "open_sessions"]


async def open_sessions(config: Config, clock: Clock) -> Sessions | None:
    """What `[sessions]` asks for (None: off): sessions kept in this process, or for every gateway process
    and replica to share: in Redis (at its `redis_url`, or the quota store's when that is empty), or in
    PostgreSQL (`[storage]`'s `postgres_dsn` and `postgres_schema`, opened and migrated here)."""
    settings = config.sessions
    if not settings.enabled:
        return None
    store: SessionStore
    if settings.backend == "redis":
        store = RedisSessionStore.from_url(
            settings.redis_url or config.quota.redis_url, op_timeout=settings.op_timeout
        )
    elif settings.backend == "postgres":
        storage = config.storage
        store = await PostgresSessionStore.open(
            storage.postgres_dsn,
            clock=clock,
            op_timeout=settings.op_timeout,
            schema=storage.postgres_schema,
            connect_timeout=storage.postgres_connect_timeout,
            command_timeout=storage.postgres_command_timeout,
        )
    else:
        store = MemorySessionStore(clock, max_entries=settings.max_entries)
    return Sessions(store, settings, clock)
