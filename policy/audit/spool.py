"""The audit writer's durable local spool: drafts the store could not take, on disk, in order.

The spool is a directory of append-only files `spool-<n>.jsonl` (n = 1, 2, 3, ... in the order they were
written), one msgspec-JSON `AuditDraft` per line, and a `cursor.json` saying how far replay has got (file n,
byte offset). Every write is fsync'd, and all file work runs in a worker thread, never on the event loop.

Replay reads from the cursor (`read`), the caller appends those drafts to the store, then `commit` moves the
cursor past them (written to a temporary file, fsync'd, renamed over `cursor.json`) and deletes files that
are fully replayed. A crash between the store append and the cursor write replays that one batch again after
the restart: the spool is at-least-once (a duplicate is at most one replay batch), and the store records
each draft id once, so the trail is not.

A process that dies during a write leaves at most a torn last line, never acknowledged as durable: it is
skipped on replay. After a restart new drafts go to a new file, never after a torn line.

With a MAC key (`policy.audit.keys`, the key of the chain) each line is `<HMAC of the JSON, hex> <JSON>`, so
whoever can write to the spool directory but lacks the key cannot slip a decision into the trail. A line
that does not parse, or whose MAC does not verify (or that has none while a key is set), is never replayed
and never skipped silently: it is moved to `quarantine.jsonl` in the base directory (fsync'd, 0600, with
the file, offset and reason), logged critically and counted (`spool_quarantined`).

A draft's content is never on disk in clear: it is sealed under a key of its (tenant, hour) kept in the
directory's `content-keys.json` (`policy.audit.spool_keys`), which the retention pass deletes once that hour
is past the tenant's retention (`shred`, here and in every directory no process holds). Lines then replay
without their content; no spool file is rewritten, and the line MACs cover the lines as written. Quarantined
lines keep their content sealed the same way, readable only while the spool keeps its key.

One `Spool` is used by one task at a time (the writer's). One process at a time uses a directory: `open`
takes an exclusive `flock` on its `.lock` file, held until `close` (or the process's death). A process that
finds the directory taken (another worker of `lockgate serve --workers N`) claims the first free
`worker-<n>` directory inside it instead, so each worker has a spool of its own, and a restarted worker takes
over (and replays) the one a dead worker left. A directory that no process holds and that still has drafts
(its worker was not started again: `--workers` lowered) is adopted by the next process that opens a spool:
its drafts are appended to that process's spool, in their order (their content opened with that directory's
keys and sealed again under this one's; content whose key is gone stays gone), and its files and keys are
then deleted (a crash in between replays them twice, as the spool is at-least-once anyway; the store records
them once).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from policy.audit.files import append_synced, fsync_dir, private_dir, private_opener, replace_synced
from policy.audit.keys import MacKey
from policy.audit.records import AuditDraft
from policy.audit.spool_keys import BUCKET_S, SpoolKeys, SpoolLine

log = logging.getLogger("lockgate.audit")

_encoder = msgspec.json.Encoder()
_line_decoder = msgspec.json.Decoder(SpoolLine)
_PREFIX = "spool-"
_SUFFIX = ".jsonl"
_CURSOR = "cursor.json"
_LOCK = ".lock"
QUARANTINE = "quarantine.jsonl"
_MAC_HEX = 64  # characters of a line's MAC (HMAC-SHA256, hex)
# Worker directories tried after the base one (more gateway processes than this on one spool is a mistake).
MAX_WORKERS = 256


class Quarantined(msgspec.Struct, frozen=True, kw_only=True):
    """A spooled line set apart: where it was, why, and the line itself (undecodable bytes escaped)."""

    spool_file: str
    offset: int
    reason: str
    line: str


class SpoolBusyError(OSError):
    """Every spool directory under the base one is held by another process."""


class Cursor(msgspec.Struct, frozen=True):
    """Where replay stands: byte `offset` into spool file number `file`."""

    file: int
    offset: int


_cursor_decoder = msgspec.json.Decoder(Cursor)


class Spool:
    """Append-only spool files in `directory`; call `open` once before anything else."""

    def __init__(
        self,
        directory: Path | str,
        *,
        file_max_bytes: int = 4 << 20,
        mac_key: MacKey | None = None,
        counters: Counter[str] | None = None,
        key_bucket_s: float = BUCKET_S,
    ) -> None:
        # The base directory; `open` sets `directory` to the one this process claimed (it or a worker-<n>).
        self.base = Path(directory)
        self.directory = self.base
        self._lock_fd: int | None = None
        # A file is closed for new writes past this size, so replayed files can be deleted early.
        self._file_max_bytes = file_max_bytes
        # Invariant: _sizes holds every spool file (number -> size in bytes), oldest first, and
        # _cursor.file is the oldest of them (or any number when there are none).
        self._sizes: dict[int, int] = {}
        self._cursor = Cursor(1, 0)
        # The file new drafts go to; None: start a new one (after a restart, never append after a torn line).
        self._active: int | None = None
        self._key = mac_key
        self.counters: Counter[str] = Counter() if counters is None else counters
        # Lines (file, offset) quarantined already: a batch read again after a failed append is not
        # quarantined twice.
        self._set_apart: set[tuple[int, int]] = set()
        # How far (file, offset) lines were ever read: unreadable content before it is counted already.
        self._read_to = (0, 0)
        # The content keys of the claimed directory (`policy.audit.spool_keys`), loaded by `_open`.
        self._key_bucket_s = key_bucket_s
        self._keys = SpoolKeys(self.directory, counters=self.counters, bucket_s=key_bucket_s)

    @property
    def pending_bytes(self) -> int:
        """Bytes written and not replayed yet."""
        return sum(self._sizes.values()) - (self._cursor.offset if self._sizes else 0)

    @property
    def files(self) -> int:
        """Spool files on disk."""
        return len(self._sizes)

    @property
    def empty(self) -> bool:
        """Nothing left to replay."""
        return self.pending_bytes == 0

    def _path(self, number: int) -> Path:
        return self.directory / f"{_PREFIX}{number:012d}{_SUFFIX}"

    async def open(self) -> None:
        """Claim a directory (module docstring), create it if needed, and find its leftover files and replay
        cursor; then adopt what unheld directories left. Raises SpoolBusyError when every one is held."""
        await asyncio.to_thread(self._open)
        for directory, fd in await asyncio.to_thread(self._orphans):
            await self._adopt(directory, fd)

    def _directories(self) -> list[Path]:
        return [self.base, *(self.base / f"worker-{n}" for n in range(1, MAX_WORKERS + 1))]

    def _orphans(self) -> list[tuple[Path, int]]:
        """The other directories that hold spool files and no process holds, each locked (its descriptor)."""
        found = []
        for directory in self._directories():
            if directory == self.directory or not any(directory.glob(f"{_PREFIX}*{_SUFFIX}")):
                continue
            fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its process is alive: it replays its own
                os.close(fd)
                continue
            found.append((directory, fd))
        return found

    async def _adopt(self, directory: Path, fd: int) -> None:
        """Append the drafts `directory` has not replayed to this spool, in order, then delete its files."""
        orphan = Spool(
            directory,
            file_max_bytes=self._file_max_bytes,
            mac_key=self._key,
            counters=self.counters,
            key_bucket_s=self._key_bucket_s,
        )
        orphan.directory, orphan._lock_fd = directory, fd
        orphan.base = self.base  # its bad lines go to this spool's quarantine
        try:
            await asyncio.to_thread(orphan._open)
            adopted = 0
            while not orphan.empty:
                drafts, cursor = await orphan.read(1024)
                if drafts:
                    await self.append(drafts)  # fsync'd before the orphan's cursor moves past them
                    adopted += len(drafts)
                elif cursor == orphan._cursor:
                    break
                await orphan.commit(cursor)
            log.warning("audit spool: adopted %d drafts that %s held", adopted, directory)
        finally:
            orphan.close()

    def close(self) -> None:
        """Give the directory up (another process may claim it); the files stay for whoever does."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _claim(self) -> None:
        for directory in self._directories():
            private_dir(directory)
            fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.directory = directory
            self._lock_fd = fd
            return
        raise SpoolBusyError(f"every audit spool directory under {self.base} is held by another process")

    def _open(self) -> None:
        if self._lock_fd is None:
            self._claim()
        found: dict[int, int] = {}
        for path in self.directory.glob(f"{_PREFIX}*{_SUFFIX}"):
            digits = path.name[len(_PREFIX) : -len(_SUFFIX)]
            if digits.isdigit():
                found[int(digits)] = path.stat().st_size
        self._sizes = dict(sorted(found.items()))
        cursor_path = self.directory / _CURSOR
        cursor = _cursor_decoder.decode(cursor_path.read_bytes()) if cursor_path.exists() else None
        if cursor is None:
            cursor = Cursor(next(iter(self._sizes), 1), 0)
        for number in [n for n in self._sizes if n < cursor.file]:
            # Spent before a crash that came between the cursor write and the delete.
            self._path(number).unlink(missing_ok=True)
            del self._sizes[number]
        if self._sizes and cursor.file not in self._sizes:
            cursor = Cursor(next(iter(self._sizes)), 0)
        self._cursor = cursor
        self._active = None
        self._keys = SpoolKeys(self.directory, counters=self.counters, bucket_s=self._key_bucket_s)
        self._keys.load()
        self._keys.forget_before(next(iter(self._sizes), None))

    async def append(self, drafts: Sequence[AuditDraft]) -> int:
        """Write `drafts` (in order) and fsync them; returns the bytes written. Raises OSError."""
        if not drafts:
            return 0
        number = self._active
        if number is None or self._sizes.get(number, 0) >= self._file_max_bytes or number not in self._sizes:
            number = max(self._sizes, default=self._cursor.file - 1) + 1
        written = await asyncio.to_thread(self._write, number, drafts)
        if not self._sizes:
            self._cursor = Cursor(number, 0)
        self._sizes[number] = self._sizes.get(number, 0) + written
        self._active = number
        return written

    def _line(self, draft: AuditDraft, number: int) -> bytes:
        body = _encoder.encode(self._keys.seal(draft, number))
        if self._key is None:
            return body + b"\n"
        return self._key.line_mac(body).encode() + b" " + body + b"\n"

    def _decode(self, line: bytes, first_read: bool = True) -> AuditDraft | str:
        """The draft a line (without its newline) holds, or why it is quarantined."""
        mac, sep, body = line.partition(b" ")
        if not (sep and len(mac) == _MAC_HEX and line[:1] != b"{"):
            mac, body = b"", line
        if self._key is not None and not (mac and self._key.line_ok(body, mac)):
            return "no MAC" if not mac else "the MAC does not verify"
        try:
            line_ = _line_decoder.decode(body)
        except msgspec.DecodeError as exc:
            return f"does not parse: {exc}"
        return self._keys.unseal(line_, count=first_read)

    def _quarantine(self, number: int, offset: int, line: bytes, reason: str) -> None:
        if (number, offset) in self._set_apart:
            return
        path = self.base / QUARANTINE
        entry = Quarantined(
            spool_file=str(self._path(number)),
            offset=offset,
            reason=reason,
            line=line.decode("utf-8", "backslashreplace"),
        )
        append_synced(path, _encoder.encode(entry) + b"\n")
        self._set_apart.add((number, offset))
        self.counters["spool_quarantined"] += 1
        log.critical(
            "audit spool %s: the line at %d is quarantined in %s, not replayed: %s",
            *(number, offset, path, reason),
        )

    def _write(self, number: int, drafts: Sequence[AuditDraft]) -> int:
        """Seal and write `drafts` to file `number` (the keys they need saved first); the bytes written."""
        data = b"".join(self._line(d, number) for d in drafts)
        self._keys.flush()
        path = self._path(number)
        new = not path.exists()
        with open(path, "ab", opener=private_opener) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if new:
            fsync_dir(self.directory)
        return len(data)

    async def read(self, limit: int) -> tuple[list[AuditDraft], Cursor]:
        """Up to `limit` drafts from the cursor on (within one file), and the cursor past them."""
        while self._sizes:
            cursor = self._cursor
            size = self._sizes[cursor.file]
            if cursor.offset < size:
                drafts, offset = await asyncio.to_thread(self._read, cursor, size, limit)
                return drafts, Cursor(cursor.file, offset)
            if cursor.file == self._active:
                break
            # Fully replayed (or only a torn tail left): move on to the next file.
            await self.commit(Cursor(cursor.file, size))
        return [], self._cursor

    def _read(self, cursor: Cursor, size: int, limit: int) -> tuple[list[AuditDraft], int]:
        drafts: list[AuditDraft] = []
        offset = cursor.offset
        with self._path(cursor.file).open("rb") as f:
            f.seek(offset)
            while len(drafts) < limit and offset < size:
                line = f.readline(size - offset)
                if not line.endswith(b"\n"):
                    # A torn tail from a crash mid-write: never acknowledged, so never replayed.
                    log.warning("audit spool %s: skipping a torn last line", cursor.file)
                    offset = size
                    break
                decoded = self._decode(line[:-1], (cursor.file, offset) >= self._read_to)
                if isinstance(decoded, str):
                    self._quarantine(cursor.file, offset, line[:-1], decoded)
                else:
                    drafts.append(decoded)
                offset += len(line)
                self._read_to = max(self._read_to, (cursor.file, offset))
        return drafts, offset

    async def commit(self, cursor: Cursor) -> None:
        """Mark everything before `cursor` (from `read`) as stored: save the cursor, delete spent files."""
        size = self._sizes.get(cursor.file, 0)
        spent = cursor.offset >= size
        if spent:
            later = [n for n in self._sizes if n > cursor.file]
            # The active file, once spent, is deleted too: the next append starts a new one.
            nxt = Cursor(later[0] if later else cursor.file + 1, 0)
            await asyncio.to_thread(self._save_and_delete, nxt, cursor.file, later[0] if later else None)
            del self._sizes[cursor.file]
            if self._active == cursor.file:
                self._active = None
            self._cursor = nxt
        else:
            await asyncio.to_thread(self._save_and_delete, cursor)
            self._cursor = cursor

    def _save_and_delete(self, cursor: Cursor, spent: int | None = None, oldest: int | None = None) -> None:
        # The cursor first: a crash after it and before the delete leaves a file the cursor has passed,
        # which `_open` recognises (the cursor names a later file) and replays no line of twice.
        replace_synced(self.directory / _CURSOR, _encoder.encode(cursor), sync_dir=False)
        if spent is not None:
            self._path(spent).unlink(missing_ok=True)
        fsync_dir(self.directory)
        if spent is not None:
            # The content keys only the deleted file used go with it (`oldest`: the oldest file left).
            self._keys.forget_before(oldest)

    async def shred(self, cutoffs: Mapping[str, float]) -> int:
        """Delete the content keys of every slot past its tenant's retention (`SpoolKeys.shred`: `cutoffs`
        maps a tenant to the `at` before which its content has expired), in this spool's directory and in
        every one no process holds, so their content on disk is unreadable from now on; the keys deleted."""
        return await asyncio.to_thread(self._shred, cutoffs)

    def _shred(self, cutoffs: Mapping[str, float]) -> int:
        shredded = self._keys.shred(cutoffs) if self._lock_fd is not None else 0
        for directory, fd in self._orphans():
            try:
                keys = SpoolKeys(directory, counters=self.counters, bucket_s=self._key_bucket_s)
                keys.load()
                shredded += keys.shred(cutoffs)
            finally:
                os.close(fd)
        return shredded
