"""Sessions in this process (the embedded default: one gateway process).

Records are kept encoded (msgpack), as the Redis store keeps them, so that a caller never shares a record
with the store. A record is forgotten once its `keep` has passed (on the injected clock). At `max_entries`
records a new one first makes room by forgetting the lapsed, then the ended ones (oldest first); a store
full of live sessions refuses a new one (SessionStoreUnavailableError: 503), the per-tenant limits being
what keeps it from filling.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from gateway.sessions.base import IndexEntry, SessionRecord, SessionStoreUnavailableError, Versioned
from policy.clock import Clock

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SessionRecord)


@dataclass(slots=True)
class _Entry:
    body: bytes
    version: int
    forget_at: float
    tenant: str
    live: bool


class MemorySessionStore:
    """`SessionStore` in a dict of at most `max_entries` records."""

    def __init__(self, clock: Clock, *, max_entries: int) -> None:
        self._clock = clock
        self._max_entries = max_entries
        self._entries: dict[str, _Entry] = {}
        self._index: dict[str, dict[str, IndexEntry]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    async def load(self, session_id: str) -> Versioned | None:
        """See `SessionStore.load`."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if entry.forget_at <= self._clock():
            self._forget(session_id)
            return None
        return Versioned(_DECODER.decode(entry.body), entry.version)

    async def save(self, record: SessionRecord, version: int | None, keep: float) -> bool:
        """See `SessionStore.save`."""
        now = self._clock()
        entry = self._entries.get(record.id)
        if entry is not None and entry.forget_at <= now:
            self._forget(record.id)
            entry = None
        stored = None if entry is None else entry.version
        if stored != version:
            return False
        if entry is None:
            self._make_room(now)
        live = record.ended is None
        self._entries[record.id] = _Entry(
            _ENCODER.encode(record), (version or 0) + 1, now + keep, record.tenant, live
        )
        members = self._index.setdefault(record.tenant, {})
        if live:
            members[record.id] = IndexEntry(record.last_used, record.history_tokens)
        else:
            members.pop(record.id, None)
        return True

    async def index(self, tenant: str) -> dict[str, IndexEntry]:
        """See `SessionStore.index`."""
        now = self._clock()
        members = self._index.get(tenant, {})
        for session_id in [s for s in members if self._entries[s].forget_at <= now]:
            self._forget(session_id)
        return dict(members)

    async def aclose(self) -> None:
        """Nothing to release."""

    def _make_room(self, now: float) -> None:
        if len(self._entries) < self._max_entries:
            return
        for session_id in [s for s, e in self._entries.items() if e.forget_at <= now]:
            self._forget(session_id)
        ended = sorted((e.forget_at, s) for s, e in self._entries.items() if not e.live)
        while len(self._entries) >= self._max_entries and ended:
            self._forget(ended.pop(0)[1])
        if len(self._entries) >= self._max_entries:
            raise SessionStoreUnavailableError(
                f"the session store is full ({self._max_entries} live sessions)"
            )

    def _forget(self, session_id: str) -> None:
        entry = self._entries.pop(session_id)
        members = self._index.get(entry.tenant)
        if members is not None:
            members.pop(session_id, None)
            if not members:
                del self._index[entry.tenant]
