"""Answers by `Idempotency-Key` in this process (the embedded default; one gateway process).

Entries live in insertion order; at `max_entries` entries, or `max_bytes` of kept answer bodies, the oldest
answer is forgotten first (its key then runs afresh), and a claim still running only when every entry is one.
Expiry reads the injected clock.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from gateway.idempotency.base import Claim, Fresh, InFlight, Mismatch, Replay, StoredAnswer
from policy.clock import Clock


@dataclass(slots=True)
class _Entry:
    fingerprint: str
    token: str
    expires_at: float
    answer: StoredAnswer | None = None


class MemoryIdempotencyStore:
    """`IdempotencyStore` in a dict: claims lapse after `pending_timeout`, answers after `window` seconds of
    `clock`; at most `max_entries` entries."""

    def __init__(
        self, clock: Clock, *, window: float, pending_timeout: float, max_entries: int, max_bytes: int
    ) -> None:
        self._clock = clock
        self._window = window
        self._pending_timeout = pending_timeout
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._entries: dict[str, _Entry] = {}
        self.bytes = 0  # of the kept answers' bodies

    def __len__(self) -> int:
        return len(self._entries)

    async def claim(self, name: str, fingerprint: str) -> Claim:
        """See `IdempotencyStore.claim`."""
        now = self._clock()
        entry = self._entries.get(name)
        if entry is not None and entry.expires_at <= now:
            self._drop(name)
            entry = None
        if entry is not None:
            if entry.fingerprint != fingerprint:
                return Mismatch()
            return InFlight() if entry.answer is None else Replay(entry.answer)
        self._make_room(now, entries=1, size=0)
        token = secrets.token_hex(16)
        self._entries[name] = _Entry(fingerprint, token, now + self._pending_timeout)
        return Fresh(token)

    def _make_room(self, now: float, *, entries: int, size: int) -> None:
        """Drop expired entries, then the oldest answers (claims only if nothing else is left) until
        `entries` more entries and `size` more bytes fit."""

        def full() -> bool:
            return len(self._entries) + entries > self._max_entries or self.bytes + size > self._max_bytes

        if not full():
            return
        for name in [n for n, e in self._entries.items() if e.expires_at <= now]:
            self._drop(name)
        answered = [n for n, e in self._entries.items() if e.answer is not None]
        running = [n for n, e in self._entries.items() if e.answer is None]
        for name in answered + running:
            if not full():
                return
            self._drop(name)

    def _drop(self, name: str) -> None:
        entry = self._entries.pop(name)
        if entry.answer is not None:
            self.bytes -= len(entry.answer.body)

    async def complete(self, name: str, token: str, answer: StoredAnswer) -> None:
        """See `IdempotencyStore.complete`."""
        entry = self._entries.get(name)
        if entry is None or entry.token != token or entry.answer is not None:
            return
        if len(answer.body) > self._max_bytes:
            self._drop(name)  # never kept: a retry runs afresh
            return
        self._make_room(self._clock(), entries=0, size=len(answer.body))
        if self._entries.get(name) is entry:  # room was made without forgetting this claim
            entry.answer = answer
            entry.expires_at = self._clock() + self._window
            self.bytes += len(answer.body)

    async def release(self, name: str, token: str) -> None:
        """See `IdempotencyStore.release`."""
        entry = self._entries.get(name)
        if entry is not None and entry.token == token and entry.answer is None:
            self._drop(name)

    async def aclose(self) -> None:
        """Nothing to release."""
