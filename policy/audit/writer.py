"""Every gate decision recorded, never lost, and the request path never waits on the database.

`AuditWriter.submit(draft)` only puts the draft in a bounded in-memory buffer; the writer's own task appends
batches to the `AuditStore` (every `flush_interval`, or at once when `batch_size` drafts wait). Drafts leave
the buffer in submission order, so each tenant's chain gets its records in the order they were submitted.

When an append fails, that batch and everything behind it go to the durable spool (`policy.audit.spool`:
fsync'd before they are dropped from memory), and so do new submissions while the spool is not empty. The
task probes the store with backoff by replaying the spool, oldest line first, in batches; only once the
spool is empty does it append the buffer directly again, so order holds across store -> spool -> store. On
`start()` leftover spool files (a restart) are replayed before anything submitted since. An append failing
with an unexpected exception (a bug, not an outage) is handled the same way, logged and counted: the task
never dies of it and the drafts are kept.

Guarantees: a draft is durable once it is in the store or fsync'd in the spool. `record(draft)` returns only
then (for decisions that must be durable before the answer is sent); `submit` returns at once, and what a
crash of the process catches in the buffer (at most `buffer_size` drafts, at most about `flush_interval` old)
is lost; `close()` flushes the buffer (to the store, else the spool) so a shutdown loses nothing. Each
accepted draft gets a `draft_id` (this writer's random prefix and a count) unless it has one, and a store
records a draft id once: a batch appended again (a crash between a replayed batch's append and its spool
cursor write, an append reported failed that did commit (lost reply), one cut off by `close`'s timeout that
committed) is not recorded twice, so delivery is exactly once for what is durable.

Contract with the caller (the gateway): `submit` and `record` raise `AuditBackpressureError` instead of ever
dropping a draft, `AuditSpoolFullError` when the spool holds `spool_max_bytes` (the store is down, or replay
has not caught up) and `AuditBufferFullError` when `buffer_size` drafts wait; `InvalidDraftError` (from
`policy.audit.records`) for a draft that could never be stored. The caller decides by the policy's fail mode:
`closed` refuses the request (503), `open` serves it unaudited, logged and counted. `spool_max_bytes` is
checked at submission: what was accepted before it was reached is still spooled, so the spool can exceed it
by at most the buffered drafts.

The gate's refusals keep a reserve: a draft of the safety gate that refuses a request (`block`, or a
guard's fail-closed `refuse`, at the input or the output: `holds_reserve`) is accepted past both bounds by
an eighth more of each (`REFUSAL_RESERVE`). Nothing else draws on it: not allows, not quota denials nor
admission refusals (which cost their client nothing), not the refusals a full trail itself causes. While the
trail is full, allows are refused or served unaudited by their fail mode and stop filling it, and the gate's
blocks are still recorded until the reserve too is full; past that the gateway refuses the request (503)
rather than block it unrecorded (`policy.safety.gate`).

    AuditWriterError
     ├── AuditBackpressureError
     │    ├── AuditSpoolFullError
     │    └── AuditBufferFullError
     └── AuditWriterClosedError

A record the store refuses for what it holds (`AuditRecordError`: the same append fails again, however long
it waits) never stops the trail: the batch is appended draft by draft, the refused draft is recorded without
its content (its content_hash stays, `detail` says why), and if the store refuses that too, the draft is
written without its content to `quarantine.jsonl` beside the spool (fsync'd, 0600) and logged critically.
The stores escape the content they cannot hold as text (`policy.audit.migrations.stored_content`), so this
is for what no escaping foresaw.

Counters (`counters`): `appended` (drafts appended from the buffer), `spooled`, `replayed` (drafts appended
from the spool), `flush_failures` (failed appends and spool writes), `refused_records` (drafts the store
refused), `quarantined` (of those, the ones it refused without content too), `spool_quarantined` (spooled
lines that did not parse or whose MAC did not verify: moved to `quarantine.jsonl`, never replayed),
`spool_keys_shredded` (spool content keys deleted by the retention pass: `shred_content`),
`spool_content_unreadable` and `spool_keys_unreadable` (`policy.audit.spool_keys`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import Counter, deque
from collections.abc import Mapping
from pathlib import Path

import msgspec

from policy.audit.base import AuditRecordError, AuditStore, AuditStoreError
from policy.audit.files import append_synced
from policy.audit.keys import MacKey
from policy.audit.records import AuditDraft, normalize
from policy.audit.spool import Spool
from policy.clock import Clock, Sleep

log = logging.getLogger("lockgate.audit")

# The share of `spool_max_bytes` and `buffer_size` the gate's refusals may use beyond them (module docstring).
REFUSAL_RESERVE = 1 / 8


def holds_reserve(draft: AuditDraft) -> bool:
    """Whether `draft` records a refusal of the safety gate (a block, or a guard's fail-closed refusal),
    which may use the trail's reserve."""
    return draft.stage in ("input", "output") and draft.decision in ("block", "refuse")


class AuditWriterError(Exception):
    """Root of the writer's errors."""


class AuditBackpressureError(AuditWriterError):
    """The draft was not accepted; nothing was dropped. The policy's fail mode decides (module docstring)."""


class AuditSpoolFullError(AuditBackpressureError):
    """The spool holds `spool_max_bytes`: the store is down or replay has not caught up."""


class AuditBufferFullError(AuditBackpressureError):
    """`buffer_size` drafts are waiting: the store (or the spool disk) does not keep up."""


class AuditWriterClosedError(AuditWriterError):
    """The writer is not running (not started, or closed)."""


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """Backoff between probes of a store that is down (and retries of a failed spool write)."""

    first_delay: float = 0.05
    max_delay: float = 5.0

    def delay(self, failures: int) -> float:
        """Seconds to wait after `failures` (>= 1) failures in a row."""
        return float(min(self.max_delay, self.first_delay * 2.0 ** max(0, failures - 1)))


class AuditWriterState(msgspec.Struct, frozen=True, kw_only=True):
    """What /readyz and metrics show of the writer."""

    buffered: int
    spooled_bytes: int
    spool_files: int
    store_up: bool
    last_error: str | None
    last_error_at: float | None
    dropped: int = 0  # always: the writer refuses (backpressure) rather than drop


class AuditWriter:
    """Buffers drafts and appends them to `store` in its own task, spooling to `spool_dir` while it is
    down."""

    def __init__(
        self,
        store: AuditStore,
        spool_dir: Path | str,
        *,
        clock: Clock,
        batch_size: int = 256,
        flush_interval: float = 0.2,
        buffer_size: int = 10_000,
        spool_max_bytes: int = 1 << 30,
        spool_file_bytes: int = 4 << 20,
        append_timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        sleep: Sleep = asyncio.sleep,
        mac_key: MacKey | None = None,
    ) -> None:
        self._store = store
        self.counters: Counter[str] = Counter()
        # Spooled lines carry their MAC under `mac_key`; a line that fails it is quarantined and counted.
        self._spool = Spool(
            spool_dir, file_max_bytes=spool_file_bytes, mac_key=mac_key, counters=self.counters
        )
        self._clock = clock
        self._batch_size = batch_size
        self._flush_interval = flush_interval
        self._buffer_size = buffer_size
        self._spool_max_bytes = spool_max_bytes
        self._append_timeout = append_timeout
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._id_prefix = secrets.token_hex(8)
        self._ids = itertools.count(1)
        # Invariant: every draft in _buffer is newer than every draft in the spool, and oldest first.
        self._buffer: deque[AuditDraft] = deque()
        # Drafts ever submitted / durable: durable ones are a prefix, since they leave the buffer in order.
        self._submitted = 0
        self._durable = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        # Direct: the spool is empty and the store took the last append; the buffer goes straight to it.
        self._direct = True
        self._store_up = True
        self._failures = 0
        self._spool_failed = False  # the last failure was a spool write (the disk), not the store
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._wake = asyncio.Event()
        self._hold: asyncio.Task[None] | None = None  # backoff after a failure
        self._timer: asyncio.Task[None] | None = None  # flush_interval for what is buffered
        self._append_scope: asyncio.Timeout | None = None
        self._close_deadline: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    async def start(self) -> None:
        """Open the spool and start the writer's task; leftover spool files are replayed first."""
        await self._spool.open()
        self._direct = self._spool.empty
        self._task = asyncio.get_running_loop().create_task(self._run(), name="audit-writer")

    def state(self) -> AuditWriterState:
        """Buffered drafts, spool size, whether the store took the last append, the last error."""
        return AuditWriterState(
            buffered=len(self._buffer),
            spooled_bytes=self._spool.pending_bytes,
            spool_files=self._spool.files,
            store_up=self._store_up,
            last_error=self._last_error,
            last_error_at=self._last_error_at,
        )

    async def shred_content(self, cutoffs: Mapping[str, float]) -> int:
        """Make the spooled content past each tenant's retention unreadable (`Spool.shred`: `cutoffs` maps a
        tenant to the `at` before which its content has expired); the number of keys deleted. OSError."""
        return await self._spool.shred(cutoffs)

    def submit(self, draft: AuditDraft) -> None:
        """Accept `draft` for recording without waiting; raises instead of dropping (module docstring)."""
        self._accept(draft)

    async def record(self, draft: AuditDraft) -> None:
        """Like `submit`, and return once the draft is durable (in the store, or fsync'd in the spool)."""
        seq = self._accept(draft)
        done = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, done))
        self._wake.set()
        await done

    def _accept(self, draft: AuditDraft) -> int:
        if self._task is None or self._closing:
            raise AuditWriterClosedError("the audit writer is not running")
        clean = normalize(draft)
        if not clean.draft_id:
            clean = msgspec.structs.replace(clean, draft_id=f"{self._id_prefix}-{next(self._ids)}")
        scale = 1.0 + REFUSAL_RESERVE if holds_reserve(clean) else 1.0
        if not self._direct and self._spool.pending_bytes >= self._spool_max_bytes * scale:
            raise AuditSpoolFullError(f"the audit spool is full ({self._spool.pending_bytes} bytes)")
        if len(self._buffer) >= self._buffer_size * scale:
            raise AuditBufferFullError(f"{len(self._buffer)} audit drafts are waiting")
        self._buffer.append(clean)
        self._submitted += 1
        if len(self._buffer) == 1 or len(self._buffer) >= self._batch_size:
            self._wake.set()
        return self._submitted

    async def close(self, within: float = 10.0) -> None:
        """Flush the buffer (to the store within `within` seconds, else to the spool) and stop the task."""
        if self._task is None or self._closing:
            return
        self._closing = True
        loop = asyncio.get_running_loop()
        self._close_deadline = loop.time() + within
        if self._append_scope is not None:
            self._append_scope.reschedule(self._close_deadline)
        self._wake.set()
        try:
            await self._task
        finally:
            for timer in (self._hold, self._timer):
                if timer is not None:
                    timer.cancel()
            self._spool.close()

    def _fail(self, exc: BaseException, *, spool: bool = False) -> None:
        self._spool_failed = spool
        self.counters["flush_failures"] += 1
        self._failures += 1
        self._last_error = f"{type(exc).__name__}: {exc}"
        self._last_error_at = self._clock()
        if self._hold is not None:
            self._hold.cancel()
        if not self._closing:
            self._hold = asyncio.get_running_loop().create_task(
                self._sleep(self._retry.delay(self._failures))
            )

    def _done(self, count: int) -> None:
        """`count` drafts at the head of the buffer are durable: drop them and wake who waits for them."""
        for _ in range(count):
            self._buffer.popleft()
        self._durable += count
        while self._waiters and self._waiters[0][0] <= self._durable:
            _, done = self._waiters.popleft()
            if not done.done():
                done.set_result(None)

    async def _append(self, drafts: list[AuditDraft]) -> None:
        """Append `drafts`; when the store refuses a record itself (`AuditRecordError`: the same append would
        fail forever), append them one by one and set the refused ones apart (`_set_apart`), so one poison
        record never stops the trail. Outages raise as they are (the caller spools and retries)."""
        try:
            await self._store_append(drafts)
        except AuditRecordError as exc:
            log.error(
                "audit store refused a record of a batch of %d; appending one by one: %s", len(drafts), exc
            )
            for draft in drafts:
                try:
                    await self._store_append([draft])
                except AuditRecordError as refused:
                    await self._set_apart(draft, refused)

    async def _set_apart(self, draft: AuditDraft, exc: AuditRecordError) -> None:
        """A draft the store refuses: recorded without its content (its content_hash stays, and the detail
        says why), or, if the store refuses that too, written so (without content) to `quarantine.jsonl`
        beside the spool (fsync'd) and logged; counted either way."""
        self.counters["refused_records"] += 1
        note = f"content not stored: the store refused it ({type(exc.__cause__ or exc).__name__})"
        bare = msgspec.structs.replace(draft, content=None, detail=f"{draft.detail}; {note}".lstrip("; "))
        try:
            await self._store_append([bare])
            log.error("audit record of request %s stored without its content: %s", draft.request_id, exc)
            return
        except AuditRecordError as again:
            exc = again
        self.counters["quarantined"] += 1
        path = self._spool.base / "quarantine.jsonl"
        # Without its content: the store refused the draft without it too, and a file outside the store is
        # never purged when the tenant's retention ends (its content_hash stays).
        line = msgspec.json.encode(bare) + b"\n"
        await asyncio.get_running_loop().run_in_executor(None, append_synced, path, line)
        log.critical(
            "audit record of request %s refused by the store, quarantined in %s: %s",
            draft.request_id,
            path,
            exc,
        )

    async def _store_append(self, drafts: list[AuditDraft]) -> None:
        """store.append, bounded by `append_timeout` (and by close's deadline once closing)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + self._append_timeout
        if self._close_deadline is not None:
            when = min(when, self._close_deadline)
        async with asyncio.timeout_at(when) as scope:
            self._append_scope = scope
            try:
                await self._store.append(drafts)
            finally:
                self._append_scope = None

    async def _spool_buffer(self) -> bool:
        """Move the whole buffer to the spool (fsync'd); False when the disk failed (the drafts stay)."""
        drafts = list(self._buffer)
        if not drafts:
            return True
        try:
            await self._spool.append(drafts)
        except OSError as exc:
            log.error("audit spool write failed, %d drafts kept in memory: %s", len(drafts), exc)
            self._fail(exc, spool=True)
            return False
        self.counters["spooled"] += len(drafts)
        self._done(len(drafts))
        return True

    def _due(self) -> bool:
        """Whether the buffer should be flushed now."""
        timer_fired = self._timer is not None and self._timer.done()
        return bool(self._buffer) and (
            self._closing or timer_fired or bool(self._waiters) or len(self._buffer) >= self._batch_size
        )

    async def _run(self) -> None:
        while True:
            try:
                if self._closing:
                    await self._shutdown()
                    return
                await self._step()
            except AuditWriterError:
                raise
            except Exception as exc:
                # A bug in the loop must not stop auditing: logged, counted, retried after a backoff.
                log.exception("audit writer step failed; retrying with backoff")
                self._fail(exc)

    async def _step(self) -> None:
        """One round: flush or spool what is due, replay when the store may be back, else wait."""
        holding = self._hold is not None and not self._hold.done()
        if not holding:
            self._hold = None
        if self._buffer and self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(self._sleep(self._flush_interval))
        if self._direct:
            if self._due():
                await self._flush_direct()
            else:
                await self._wait(self._timer)
            return
        if self._due() and not (holding and self._spool_failed) and await self._spool_buffer():
            self._timer = None
        if self._hold is None:
            await self._replay_step()
            await asyncio.sleep(0)  # replay goes on at once; let submitters in between batches
        else:
            await self._wait(self._hold, None if self._spool_failed else self._timer)

    async def _wait(self, *timers: asyncio.Task[None] | None) -> None:
        """Until something is submitted that needs a flush, close is called, or a timer fires."""
        self._wake.clear()
        wake = asyncio.get_running_loop().create_task(self._wake.wait())
        waits = [wake, *(t for t in timers if t is not None)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()

    async def _flush_direct(self) -> None:
        batch = [self._buffer[i] for i in range(min(self._batch_size, len(self._buffer)))]
        try:
            await self._append(batch)
        except (AuditStoreError, TimeoutError) as exc:
            log.warning("audit store append failed, spooling from here on: %s", exc)
            self._down(exc)
        except Exception as exc:
            # Not an outage but a bug: same handling (spool, retry with backoff), logged with its traceback.
            log.exception("audit store append raised unexpectedly, spooling from here on")
            self._down(exc)
        else:
            self.counters["appended"] += len(batch)
            self._failures = 0
            self._store_up = True
            self._done(len(batch))
            if not self._buffer:
                self._timer = None
            return
        await self._spool_buffer()
        self._timer = None

    def _down(self, exc: BaseException) -> None:
        self._direct = False
        self._store_up = False
        self._fail(exc)

    async def _replay_step(self) -> None:
        """Append the spool's next batch (or, when the spool is empty, the buffer's head) to the store."""
        from_spool = not self._spool.empty
        if from_spool:
            try:
                drafts, cursor = await self._spool.read(self._batch_size)
            except OSError as exc:
                log.error("audit spool read failed: %s", exc)
                self._fail(exc, spool=True)
                return
        else:
            drafts = [self._buffer[i] for i in range(min(self._batch_size, len(self._buffer)))]
        try:
            if drafts:
                await self._append(drafts)
        except Exception as exc:
            if not isinstance(exc, AuditStoreError | TimeoutError):
                log.exception("audit replay raised unexpectedly; retrying with backoff")
            self._store_up = False
            self._fail(exc)
            return
        if from_spool:
            self.counters["replayed"] += len(drafts)
            try:
                await self._spool.commit(cursor)
            except OSError as exc:
                # The batch is in the store but the cursor did not move: it is replayed again (a duplicate).
                log.error("audit spool cursor write failed: %s", exc)
                self._fail(exc, spool=True)
                return
        else:
            self.counters["appended"] += len(drafts)
            self._done(len(drafts))
        self._store_up = True
        self._failures = 0
        if self._spool.empty and (drafts or not from_spool):
            self._direct = True
            log.info("audit spool replayed; appending to the store directly again")

    async def _shutdown(self) -> None:
        """Closing: the buffer to the store (direct, before the deadline) or to the spool; then stop."""
        while self._buffer and self._direct:
            await self._flush_direct()
        if self._buffer and not await self._spool_buffer():
            lost = len(self._buffer)
            error = AuditWriterError(f"{lost} audit drafts could not be stored or spooled at shutdown")
            for _, done in self._waiters:
                if not done.done():
                    done.set_exception(error)
            log.critical("%s: %s", error, self._last_error)
            raise error
