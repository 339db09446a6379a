"""`PostgresStore`, the base of every PostgreSQL store, and `open_pool`: an asyncpg pool working in one
PostgreSQL schema, created and migrated on open.

`search_path` is set on every pooled connection, so a store's statements name tables without a schema.
Replicas starting at once take turns on an advisory lock while creating the schema and migrating: one per
store and schema (`migration_lock`), so stores in other schemas of the same database never wait on it, and
the wait for it has its own bound (`lock_timeout`), longer than a statement's: another replica's migration
may take longer than one statement may.

Every connection attempt and every statement has a time limit (`connect_timeout`, `command_timeout`), so a
database that is down or paused shows as an error after a bounded wait, never as a hang. The pool replaces
connections the server closed (a restart) on the next `acquire`, so it recovers once the server is back.
`UNREACHABLE` lists the driver errors that mean "the database cannot be reached now" (each store maps them
onto its own unavailable error); other SQL errors are bugs and stay what they are.

A store subclasses `PostgresStore`, naming its migrations, their table and lock, and its errors; it gets
`open`, `close`, and `_connect` / `_conn`: a pooled connection (in a transaction for a write) on which
losing the database is the store's unavailable error.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, ClassVar, Self, TypedDict, Unpack

import asyncpg  # type: ignore[import-untyped]

from registry.db.migrations import IDENTIFIER, Migration, checked_table, create_table_sql, pending

# Losing the database (network, restart, admin shutdown, no free connection, a statement over its time limit)
# is "unreachable": the caller may try again later.
UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,  # class 08
    asyncpg.OperatorInterventionError,  # class 57: admin shutdown, cannot connect now
    asyncpg.InsufficientResourcesError,  # class 53: too many connections
    # What asyncpg raises when the server drops the connection just as a statement starts.
    asyncpg.InternalClientError,
)


# What a value itself causes (class 22, data exception: a character the encoding cannot hold, a value out of
# range; class 54: a value over a program limit): the same statement fails again, whenever it is retried.
REFUSED_DATA: tuple[type[BaseException], ...] = (
    asyncpg.DataError,
    asyncpg.ProgramLimitExceededError,
)


def numbered(sql: str) -> str:
    """`sql` with its `?` placeholders as PostgreSQL's `$1, $2, ...` (the statement holds no other `?`)."""
    counter = iter(range(1, 1000))
    return re.sub(r"\?", lambda _m: f"${next(counter)}", sql)


def migration_lock(lock_key: int, schema: str) -> int:
    """The advisory lock (a signed 64-bit key) that replicas of the store `lock_key` take in `schema`."""
    digest = hashlib.blake2b(f"{lock_key}:{schema}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


async def open_pool(
    dsn: str,
    *,
    schema: str,
    migrations: Sequence[Migration],
    table: str,
    lock_key: int,
    min_size: int,
    max_size: int,
    connect_timeout: float = 5.0,
    command_timeout: float = 10.0,
    lock_timeout: float = 300.0,
) -> Any:
    """Connect to `dsn`, create `schema` if missing, and apply `migrations` (recorded in `table`) to it.

    `lock_key` names the store: the advisory lock held while migrating is its and the schema's
    (`migration_lock`), so the replicas of one store in one schema wait on each other and on nothing else.
    `connect_timeout` bounds each connection attempt, `command_timeout` each statement, and `lock_timeout`
    the wait for that lock while another replica migrates (all in seconds).
    """
    if not IDENTIFIER.fullmatch(schema):
        raise ValueError(f"schema {schema!r} must match {IDENTIFIER.pattern}")
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        timeout=connect_timeout,
        command_timeout=command_timeout,
        server_settings={"search_path": schema},
    )
    try:
        async with pool.acquire() as conn:
            lock = migration_lock(lock_key, schema)
            await conn.execute("SELECT pg_advisory_lock($1)", lock, timeout=lock_timeout)
            try:
                # Inside the lock: two replicas creating the same schema at once would otherwise collide.
                await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
                await migrate(conn, migrations, table)
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", lock)
    except BaseException:
        await pool.close()
        raise
    return pool


async def migrate(conn: Any, migrations: Sequence[Migration], table: str) -> None:
    """Apply the `migrations` that `table` does not list yet, each in its own transaction.

    The caller holds the advisory lock, so no other replica migrates meanwhile.
    """
    table = checked_table(table)
    await conn.execute(create_table_sql(table))
    applied = {row[0] for row in await conn.fetch(f"SELECT version FROM {table}")}
    for migration in pending(migrations, applied):
        async with conn.transaction():
            for sql in migration.statements("postgres"):
                await conn.execute(sql)
            await conn.execute(f"INSERT INTO {table} (version) VALUES ($1)", migration.version)


class PoolOptions(TypedDict, total=False):
    """How a store's pool opens: its schema, size and time limits (seconds; see `open_pool`)."""

    schema: str
    min_size: int
    max_size: int
    connect_timeout: float
    command_timeout: float


class PostgresStore:
    """A store in one PostgreSQL schema: its pool, opened and migrated by `open`, and its error mapping."""

    # What the store's errors call its database ("the tenant database is unreachable").
    what: ClassVar[str]
    # Raised for a database that cannot be reached now (`UNREACHABLE`).
    unavailable: ClassVar[type[Exception]]
    # Raised for a value the database refuses (`REFUSED_DATA`); None: such errors stay what they are.
    refused: ClassVar[type[Exception] | None] = None
    # The store's schema steps, the table recording them, and the advisory lock replicas take to apply them.
    migrations: ClassVar[Sequence[Migration]]
    migrations_table: ClassVar[str]
    lock_key: ClassVar[int]
    # The pool's size when `open` is not given one.
    max_connections: ClassVar[int] = 10

    def __init__(self, pool: Any) -> None:
        """Use `open`; this takes an asyncpg pool whose schema is already migrated."""
        self._pool = pool

    @classmethod
    async def open(cls, dsn: str, **options: Unpack[PoolOptions]) -> Self:
        """Connect to `dsn`, create the schema if missing, and migrate it (time limits: `open_pool`)."""
        return cls(await cls.open_pool(dsn, **options))

    @classmethod
    async def open_pool(cls, dsn: str, **options: Unpack[PoolOptions]) -> Any:
        """This store's pool on `dsn`: its own migrations, recorded in its own table, under its own lock."""
        return await open_pool(
            dsn,
            schema=options.get("schema", "public"),
            migrations=cls.migrations,
            table=cls.migrations_table,
            lock_key=cls.lock_key,
            min_size=options.get("min_size", 1),
            max_size=options.get("max_size", cls.max_connections),
            connect_timeout=options.get("connect_timeout", 5.0),
            command_timeout=options.get("command_timeout", 10.0),
        )

    @asynccontextmanager
    async def _connect(self) -> AsyncIterator[Any]:
        """A pooled connection; losing the database is `unavailable`, a refused value `refused`."""
        refused = REFUSED_DATA if self.refused is not None else ()
        try:
            async with self._pool.acquire() as conn:
                yield conn
        except UNREACHABLE as exc:
            raise self.unavailable(f"the {self.what} database is unreachable: {exc!r}") from exc
        except refused as exc:
            if self.refused is None:
                raise
            raise self.refused(f"the {self.what} database refused a record: {exc!r}") from exc

    @asynccontextmanager
    async def _conn(self, *, write: bool = False) -> AsyncIterator[Any]:
        """A pooled connection (`_connect`), in a transaction if `write`."""
        async with self._connect() as conn:
            if write:
                async with conn.transaction():
                    yield conn
            else:
                yield conn

    async def close(self) -> None:
        """Close the pool (waiting for connections in use to be released)."""
        await self._pool.close()
