"""The `SessionStore` protocol: reviewer console sessions, by the random id that the console's cookie holds.

A session maps the id (`secrets.token_urlsafe(32)`, made by `open`) to the reviewer key's Authorization value
and the session's CSRF token until `expires_at` (the store's injected clock). The console authenticates the
Authorization value again on every request; the store only remembers it. Backends: `memory` (one gateway
process) and `redis` (shared by every gateway process; it stores ciphertext only a holder of the id can open).

Each reviewer key (its key id, the session's `owner`) holds at most `per_key` sessions: a new sign-in ends
that key's own oldest session, never another key's, so no reviewer can sign the others out by signing in
many times. A store with a global bound too (`memory`) refuses a sign-in when it is full rather than evict.

Exceptions::

    SessionStoreError                  base
    ├── SessionStoreUnavailableError   the store cannot be reached in time (the console answers 503)
    └── SessionStoreFullError          the store holds all the sessions it may (the console answers 503)
"""

from __future__ import annotations

import secrets
from typing import Protocol

import msgspec


class Session(msgspec.Struct, frozen=True, kw_only=True):
    """A signed-in reviewer: the key's Authorization value (server side only) and the CSRF token."""

    authorization: str
    csrf: str
    expires_at: float


class SessionStoreError(Exception):
    """Base of every session store failure."""


class SessionStoreUnavailableError(SessionStoreError):
    """The session store cannot be reached in time."""


class SessionStoreFullError(SessionStoreError):
    """The store is at its global bound: a new session would have to evict another key's."""


def new_session(authorization: str, expires_at: float) -> tuple[str, Session]:
    """A fresh random session id (the cookie value) and a session with a fresh CSRF token."""
    session = Session(authorization=authorization, csrf=secrets.token_urlsafe(32), expires_at=expires_at)
    return secrets.token_urlsafe(32), session


class SessionStore(Protocol):
    """Console sessions by random id, each expiring a fixed time after it was opened, at most `per_key` of
    them per owner."""

    async def open(self, authorization: str, owner: str) -> tuple[str, Session]:
        """A new session for the key whose id is `owner`; its id (the cookie value) and the session. Ends the
        owner's oldest sessions beyond its bound; SessionStoreFullError rather than end another owner's."""
        ...

    async def get(self, sid: str | None) -> Session | None:
        """The live session with this id, or None (no id, unknown, expired or unreadable)."""
        ...

    async def close(self, sid: str | None) -> None:
        """End the session (if any)."""
        ...

    async def aclose(self) -> None:
        """Release the store's connections (sessions in a shared store outlive it)."""
        ...
