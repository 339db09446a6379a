"""Console sessions in this process: the embedded default, for one gateway process (a reviewer signed in on
one worker of `lockgate serve --workers N` would be unknown to the others; use the Redis store there)."""

from __future__ import annotations

from gateway.console.sessions.base import Session, SessionStoreFullError, new_session
from policy.clock import Clock


class MemorySessionStore:
    """`SessionStore` in a dict, bounded and expiring.

    Invariant: at most `per_key` sessions per owner and `max_sessions` in all; a sign-in past the owner's
    bound ends that owner's oldest session, one past the global bound is refused."""

    def __init__(self, clock: Clock, *, ttl: float, max_sessions: int, per_key: int) -> None:
        """Sessions that last `ttl` seconds of `clock`: at most `per_key` per owner, `max_sessions` in all."""
        self._clock = clock
        self._ttl = ttl
        self._max = max_sessions
        self._per_key = per_key
        # Session id -> (owner, session), in sign-in order.
        self._sessions: dict[str, tuple[str, Session]] = {}
        # Owner -> its session ids, oldest first.
        self._owned: dict[str, list[str]] = {}

    async def open(self, authorization: str, owner: str) -> tuple[str, Session]:
        """A new session for `owner`'s key (see `SessionStore.open`)."""
        now = self._clock()
        for sid in [s for s, (_, v) in self._sessions.items() if v.expires_at <= now]:
            self._drop(sid)
        owned = self._owned.get(owner, [])
        while len(owned) >= self._per_key:
            self._drop(owned[0])
        if len(self._sessions) >= self._max:
            raise SessionStoreFullError(f"the console holds its most sessions ({self._max})")
        sid, session = new_session(authorization, now + self._ttl)
        self._sessions[sid] = (owner, session)
        self._owned.setdefault(owner, []).append(sid)
        return sid, session

    async def get(self, sid: str | None) -> Session | None:
        """The live session with this id, or None."""
        entry = self._sessions.get(sid or "")
        if entry is not None and entry[1].expires_at <= self._clock():
            await self.close(sid)
            return None
        return None if entry is None else entry[1]

    async def close(self, sid: str | None) -> None:
        """End the session (if any)."""
        self._drop(sid or "")

    def _drop(self, sid: str) -> None:
        entry = self._sessions.pop(sid, None)
        if entry is None:
            return
        owned = self._owned[entry[0]]
        owned.remove(sid)
        if not owned:
            del self._owned[entry[0]]

    async def aclose(self) -> None:
        """Forget every session (they live in this process only)."""
        self._sessions.clear()
        self._owned.clear()
