"""Console sessions in this process: the embedded default, for one gateway process (a reviewer signed in on
one worker of `lockgate serve --workers N` would be unknown to the others; use the Redis store there)."""

from __future__ import annotations

from gateway.sessions.base import Session, new_session
from policy.auth import Clock


class MemorySessionStore:
    """`SessionStore` in a dict, bounded and expiring.

    Invariant: at most `max_sessions` entries, in sign-in order (the oldest is dropped first)."""

    def __init__(self, clock: Clock, *, ttl: float, max_sessions: int) -> None:
        """Sessions that last `ttl` seconds of `clock`, at most `max_sessions` of them."""
        self._clock = clock
        self._ttl = ttl
        self._max = max_sessions
        self._sessions: dict[str, Session] = {}

    async def open(self, authorization: str) -> tuple[str, Session]:
        """A new session for the key; its id (the cookie value) and the session."""
        now = self._clock()
        for sid in [s for s, v in self._sessions.items() if v.expires_at <= now]:
            del self._sessions[sid]
        while len(self._sessions) >= self._max:
            del self._sessions[next(iter(self._sessions))]
        sid, session = new_session(authorization, now + self._ttl)
        self._sessions[sid] = session
        return sid, session

    async def get(self, sid: str | None) -> Session | None:
        """The live session with this id, or None."""
        session = self._sessions.get(sid or "")
        if session is not None and session.expires_at <= self._clock():
            await self.close(sid)
            return None
        return session

    async def close(self, sid: str | None) -> None:
        """End the session (if any)."""
        self._sessions.pop(sid or "", None)

    async def aclose(self) -> None:
        """Forget every session (they live in this process only)."""
        self._sessions.clear()
