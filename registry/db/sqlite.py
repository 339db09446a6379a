"""`SqliteWorker`: one stdlib `sqlite3` connection on one dedicated worker thread; `SqliteStore`, the base
of every SQLite store.

sqlite3 calls block, so every call runs on a single thread, which also owns the connection (it is created
there, and `check_same_thread` enforces that it is used nowhere else). One thread serialises the calls, so
no two transactions of this process interleave on the connection.

A store subclasses `SqliteStore`, naming its migrations, their table and its errors; it gets `open`, `close`
and `_run`: a function of the connection run on the worker, where an operational error (the file locked
by another process past `busy_timeout`, a disk error) is the store's unavailable error: the same call may
succeed later.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, Self, TypeVar

from registry.db.migrations import Migration, checked_table, create_table_sql, pending

T = TypeVar("T")
Conn = sqlite3.Connection


class SqliteWorker:
    """The connection to one SQLite file (WAL mode), or to memory for ":memory:", and its thread."""

    def __init__(self, executor: ThreadPoolExecutor, conn: Conn, path: Path | None) -> None:
        """Use `open`; this takes a connection already owned by `executor`'s only thread, to the file at
        `path` (None: in memory)."""
        self._executor = executor
        self._conn: Conn | None = conn
        self.path = path

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        migrations: Sequence[Migration],
        table: str,
        foreign_keys: bool,
        name: str = "db",
    ) -> SqliteWorker:
        """Open (creating if needed) the database at `path` and apply `migrations`, recorded in `table`.

        `name` tells the worker thread apart in thread dumps ("lockgate-<name>-sqlite").
        """
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lockgate-{name}-sqlite")

        def connect() -> Conn:
            return _connect(str(path), migrations, table, foreign_keys=foreign_keys)

        try:
            conn = await asyncio.get_running_loop().run_in_executor(executor, connect)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(executor, conn, None if str(path) == ":memory:" else Path(path))

    @property
    def closed(self) -> bool:
        """Whether `close` has been called: a store checks this to raise its own error instead of `run`'s."""
        return self._conn is None

    async def run(self, fn: Callable[[Conn], T]) -> T:
        """`fn(connection)` on the worker thread. sqlite3.ProgrammingError once closed."""
        if self._conn is None:
            raise sqlite3.ProgrammingError("the database worker is closed")
        # If the caller is cancelled, the call still finishes on the worker, so a transaction is never cut
        # in half; only its result is dropped.
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, self._conn)

    async def close(self) -> None:
        """Close the connection and let the worker thread end. Safe to call twice."""
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        await asyncio.get_running_loop().run_in_executor(self._executor, conn.close)
        # The queue is empty now, so not waiting for the thread loses nothing and never blocks the loop.
        self._executor.shutdown(wait=False)


class SqliteStore:
    """A store in one SQLite file (WAL mode), or in memory for ":memory:": its worker and error mapping."""

    # What the store's errors call it ("the tenant store is closed", "the tenant database is unavailable").
    what: ClassVar[str]
    # Raised for an operational error (locked past busy_timeout, a disk error), and once closed.
    unavailable: ClassVar[type[Exception]]
    closed_error: ClassVar[type[Exception]]
    # Raised for a value SQLite cannot take (too large, a type it cannot bind, text it cannot encode); None:
    # such errors stay what they are.
    refused: ClassVar[type[Exception] | None] = None
    # The store's schema steps and the table recording them; whether foreign keys are enforced.
    migrations: ClassVar[Sequence[Migration]]
    migrations_table: ClassVar[str]
    foreign_keys: ClassVar[bool] = False

    def __init__(self, db: SqliteWorker) -> None:
        """Use `open`; this takes a worker whose database is already migrated."""
        self._db = db

    @classmethod
    async def open(cls, path: str | Path) -> Self:
        """Open (creating if needed) and migrate the database at `path`."""
        return cls(await cls.open_worker(path))

    @classmethod
    async def open_worker(cls, path: str | Path) -> SqliteWorker:
        """A worker on the database at `path`, migrated with this store's migrations."""
        return await SqliteWorker.open(
            path,
            migrations=cls.migrations,
            table=cls.migrations_table,
            foreign_keys=cls.foreign_keys,
            name=cls.what,
        )

    def _check_open(self) -> None:
        """`closed_error` once `close` has been called."""
        if self._db.closed:
            raise self.closed_error(f"the {self.what} store is closed")

    async def _run(self, fn: Callable[[Conn], T]) -> T:
        """`fn(connection)` on the worker, its errors mapped onto the store's."""
        self._check_open()
        refused = _REFUSED if self.refused is not None else ()
        try:
            return await self._db.run(fn)
        except sqlite3.OperationalError as exc:
            raise self.unavailable(f"the {self.what} database is unavailable: {exc}") from exc
        except refused as exc:
            if self.refused is None:
                raise
            raise self.refused(f"the {self.what} database refused a record: {exc}") from exc

    async def close(self) -> None:
        """Close the connection and let the worker thread end. Safe to call twice."""
        await self._db.close()


# What a value itself causes (too large, a type it cannot bind, text it cannot encode).
_REFUSED: tuple[type[BaseException], ...] = (sqlite3.DataError, sqlite3.InterfaceError, UnicodeEncodeError)


@contextmanager
def transaction(conn: Conn) -> Iterator[None]:
    """A write transaction on `conn`: committed when the block ends, rolled back if it raises."""
    # IMMEDIATE takes the write lock up front, so a read-then-write cannot be overtaken by another writer.
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def migrate(conn: Conn, migrations: Sequence[Migration], table: str) -> None:
    """Apply the `migrations` that `table` does not list yet, each in its own transaction."""
    table = checked_table(table)
    conn.execute(create_table_sql(table))
    applied = {version for (version,) in conn.execute(f"SELECT version FROM {table}")}
    for migration in pending(migrations, applied):
        with transaction(conn):
            # Checked again under the write lock: another process may have applied it since we looked.
            done = conn.execute(f"SELECT 1 FROM {table} WHERE version = ?", (migration.version,))
            if done.fetchone() is not None:
                continue
            for sql in migration.statements("sqlite"):
                conn.execute(sql)
            conn.execute(f"INSERT INTO {table} (version) VALUES (?)", (migration.version,))


def _connect(path: str, migrations: Sequence[Migration], table: str, *, foreign_keys: bool) -> Conn:
    # isolation_level=None: no implicit transactions; `transaction` (or a store) opens them explicitly.
    if path != ":memory:" and not os.path.exists(path):
        # Created 0600 (SQLite would take the umask's mode): it holds keys' hashes, audit records, prompts
        # where retained. Its -wal and -shm files take the database file's mode.
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        if path != ":memory:":
            # WAL lets readers (other processes: replicas on one host, the CLI) proceed while one writes.
            conn.execute("PRAGMA journal_mode = WAL")
        if foreign_keys:
            conn.execute("PRAGMA foreign_keys = ON")
        # Another process holding the write lock makes us wait on the worker thread, not fail at once.
        conn.execute("PRAGMA busy_timeout = 5000")
        migrate(conn, migrations, table)
    except BaseException:
        conn.close()
        raise
    return conn
