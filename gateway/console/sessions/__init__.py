"""Reviewer console sessions: the `SessionStore` protocol, its in-process and Redis backends, and the builder
that picks one from `[console]`."""

from gateway.config import ConsoleConfig
from gateway.console.sessions.base import (
    Session,
    SessionStore,
    SessionStoreError,
    SessionStoreFullError,
    SessionStoreUnavailableError,
)
from gateway.console.sessions.memory import MemorySessionStore
from gateway.console.sessions.redis import RedisSessionStore
from policy.clock import Clock

__all__ = [
    "MemorySessionStore",
    "RedisSessionStore",
    "Session",
    "SessionStore",
    "SessionStoreError",
    "SessionStoreFullError",
    "SessionStoreUnavailableError",
    "open_session_store",
]


def open_session_store(config: ConsoleConfig, clock: Clock, quota_redis_url: str) -> SessionStore:
    """The session store `config` names: in this process, or in Redis (at `config.redis_url`, or the quota
    store's `quota_redis_url` when that is empty) for every gateway process to share."""
    if config.session_store == "redis":
        return RedisSessionStore.from_url(
            config.redis_url or quota_redis_url,
            clock,
            ttl=config.session_ttl,
            per_key=config.sessions_per_key,
            op_timeout=config.op_timeout,
        )
    return MemorySessionStore(
        clock, ttl=config.session_ttl, max_sessions=config.max_sessions, per_key=config.sessions_per_key
    )
