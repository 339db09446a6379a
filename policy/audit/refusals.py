"""`RefusalTally`: repeated no-cost refusals (quota denials, `quota_exceeds_capacity`, admission refusals) in
the audit trail as counts, not one record each, so a client refused at line rate cannot flood the trail.

The refusals of one key for one reason (tenant, key, stage, decision, source) in one interval (`interval`
seconds of the injected clock, aligned to multiples of it) are recorded as:

- the first one, at once, as any decision is (count 1): a refusal shows in the trail without delay;
- the rest, once the interval has ended, as one record with `count` (how many), `at` (the first of them) and
  `last_at` (the last), the request id and detail of the first of them.

So N refusals of one key for one reason leave at most 2 records per interval, with counts summing to N.
Blocks by the guard and allows never pass through here: they are recorded one by one by the gate.

Memory is bounded: at most `max_keys` tallies. Past that, a new key's refusals are counted in its tenant's
overflow tally (key id `OVERFLOW_KEY_ID`, recorded only as a count), and once `max_keys` plus a reserve of an
eighth is reached, every tally is written at once, whatever its interval. Nothing is dropped: a record the
writer cannot take now (`AuditBackpressureError`) keeps its tally for the next flush, and a first refusal the
writer refused is counted in its tally instead.

Flushes: `flush()` writes the tallies whose interval has ended; `run()` (a task of the app's lifespan) calls
it at each interval's end; `add` calls it too once one is due; `close()` writes every tally (shutdown; call it
before the writer closes).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from policy.audit.records import AuditDraft
from policy.audit.writer import AuditBackpressureError
from policy.clock import Clock, Sleep

log = logging.getLogger("lockgate.audit")

Submit = Callable[[AuditDraft], None]
# The key id of a tenant's overflow tally (refusals of keys past `max_keys`).
OVERFLOW_KEY_ID = "*"


class _Key(NamedTuple):
    tenant: str
    key_id: str
    stage: str
    decision: str
    source: str
    window: float  # start of the interval


class _Tally:
    """The refusals of one key for one reason in one interval, past the first (recorded at once)."""

    __slots__ = ("count", "draft", "last_at")

    def __init__(self) -> None:
        self.count = 0
        self.draft: AuditDraft | None = None  # the first counted refusal (its request id and detail)
        self.last_at = 0.0

    def add(self, draft: AuditDraft) -> None:
        if self.draft is None:
            self.draft = draft
        self.count += 1
        self.last_at = max(self.last_at, draft.at)


class RefusalTally:
    """Counts no-cost refusals per key, reason and interval, and submits them to the audit writer (module
    docstring)."""

    def __init__(
        self,
        submit: Submit,
        clock: Clock,
        *,
        interval: float = 60.0,
        max_keys: int = 10_000,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        """Submit records with `submit` (the writer's; raises `AuditBackpressureError` when full)."""
        if interval <= 0 or max_keys < 1:
            raise ValueError("interval must be > 0 and max_keys >= 1")
        self._submit = submit
        self._clock = clock
        self._interval = interval
        self._max_keys = max_keys
        self._hard_max = max_keys + max(1, max_keys // 8)
        self._sleep = sleep
        # Invariant: len(_tallies) <= _hard_max after every `add`.
        self._tallies: dict[_Key, _Tally] = {}
        self._next_due = math.inf  # the earliest end of an interval with a tally
        self.counters: dict[str, int] = {"refusals": 0, "recorded": 0, "early_flushes": 0}

    @property
    def pending(self) -> int:
        """Tallies held (bounded by `max_keys` and its reserve)."""
        return len(self._tallies)

    def _window(self, at: float) -> float:
        return math.floor(at / self._interval) * self._interval

    def add(self, draft: AuditDraft) -> None:
        """Count the refusal `draft` (recorded at once if it is the first of its key and reason in its
        interval). Never raises for a full trail: what cannot be written now waits in its tally."""
        self.counters["refusals"] += 1
        now = self._clock()
        if now >= self._next_due:
            self.flush(now)
        window = self._window(draft.at)
        key = _Key(draft.tenant, draft.key_id, draft.stage, draft.decision, draft.source, window)
        tally = self._tallies.get(key)
        if tally is None and len(self._tallies) >= self._max_keys:
            key = key._replace(key_id=OVERFLOW_KEY_ID)
            tally = self._tallies.get(key)
            if tally is None and len(self._tallies) >= self._hard_max:
                self.counters["early_flushes"] += 1
                log.warning(
                    "%d refusal tallies held: writing them all before their intervals end", self.pending
                )
                self.flush(math.inf)
        if tally is None:
            tally = self._tallies[key] = _Tally()
            self._next_due = min(self._next_due, window + self._interval)
            if key.key_id != OVERFLOW_KEY_ID and self._write(draft):
                return
        tally.add(draft)

    def _write(self, draft: AuditDraft) -> bool:
        """Submit `draft`; False when the trail cannot take it now."""
        try:
            self._submit(draft)
        except AuditBackpressureError as exc:
            log.error(
                "audit trail full: %s refusal of %s kept in its tally: %s", draft.stage, draft.key_id, exc
            )
            return False
        self.counters["recorded"] += 1
        return True

    def flush(self, now: float | None = None) -> int:
        """Write the tallies whose interval ended by `now` (the clock's time if None; math.inf: all of
        them); the number of records written. A tally the writer cannot take stays for the next flush."""
        now = self._clock() if now is None else now
        written = 0
        next_due = math.inf
        for key, tally in list(self._tallies.items()):
            end = key.window + self._interval
            if end > now:
                next_due = min(next_due, end)
                continue
            if tally.draft is not None:
                if not self._write(self._record(key, tally)):
                    # The trail is full: the rest would be refused too. Try again a little later, not on
                    # every refusal (each flush walks every tally).
                    self._next_due = self._clock() + min(1.0, self._interval)
                    return written
                written += 1
            del self._tallies[key]
        self._next_due = next_due
        return written

    def _record(self, key: _Key, tally: _Tally) -> AuditDraft:
        first = tally.draft
        assert first is not None
        keys = "keys past the tally's limit" if key.key_id == OVERFLOW_KEY_ID else "this key"
        detail = (
            f"{tally.count} refusals of {keys} for {key.source} in {self._interval:g} s from "
            f"{key.window:.0f}; the first: {first.detail}"
        )
        return msgspec.structs.replace(
            first, key_id=key.key_id, count=tally.count, last_at=tally.last_at, detail=detail, draft_id=""
        )

    async def run(self) -> None:
        """Flush at each interval's end, until cancelled."""
        while True:
            now = self._clock()
            await self._sleep(max(0.0, self._window(now) + self._interval - now))
            self.flush()

    def close(self) -> int:
        """Write every tally, whatever its interval (shutdown, before the writer closes); the number of
        records written. Those the writer cannot take are logged with their counts."""
        written = self.flush(math.inf)
        for key, tally in self._tallies.items():
            log.error("audit trail full at shutdown: %d refusals of %s not recorded", tally.count, key)
        self._tallies.clear()
        return written
