"""Sessions in PostgreSQL, shared by every gateway replica (a second replica, or a restarted one, continues
them), in the `[storage]` schema, created and migrated on `open` (`registry.db.postgres.PostgresStore`: the
schema's advisory lock, so replicas starting together take turns).

One row per session::

    gateway_sessions(id PK, tenant, version, body, live, last_used, history_tokens, forget_at)

        version         the record's version (each save sets the version it compared, plus one)
        body            msgpack(SessionRecord)
        live            no `ended`: the row is in its tenant's index, with `last_used` and `history_tokens`
                        (a partial index on (tenant) WHERE live answers `index`)
        forget_at       the save's now + `keep` (on the injected clock): from then on the row counts as
                        absent, and any save of a new id may delete it

`save` is one statement. A create (version None) is INSERT ... ON CONFLICT DO UPDATE WHERE the stored row's
`forget_at` has passed: a new id, or one whose record is forgotten, is written as version 1; a live one is
left alone (no row: False). Any other save is UPDATE ... WHERE id, version AND forget_at not passed. Two
replicas saving one version (or creating one id) at once queue on the row's lock, and the second re-reads the
row the first wrote, so they get one True between them; the index is the same row, so it never disagrees
with the last save.

Forgotten rows are deleted as sessions are created: before its insert, each create deletes at most
`SWEEP_LIMIT` rows whose `forget_at` has passed (oldest first, by an index on forget_at; rows another
transaction holds are skipped, never waited for). Every session is created once and forgotten at most once,
so the creates delete forgotten rows far faster than they appear: the table holds the kept sessions plus
those forgotten since about the last create. `load` and `index` read past forgotten rows without deleting
them. Every replica's clock is taken to agree with the others' to well within a `keep`, as the session
logic's own expiry assumes.

Every operation (taking a pooled connection and its statements) is bounded by `op_timeout`; losing the
database (`registry.db.postgres.UNREACHABLE`) or running past it is SessionStoreUnavailableError. So is a
record that does not decode (not written by this store, or by an incompatible version of it): the request
gets 503, never a session started afresh over it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Self, Unpack

import msgspec

from gateway.sessions.base import IndexEntry, SessionRecord, SessionStoreUnavailableError, Versioned
from policy.clock import Clock
from registry.db.migrations import Migration
from registry.db.postgres import PoolOptions, PostgresStore

MIGRATIONS_TABLE = "gateway_sessions_schema_migrations"
MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        version=1,
        summary="gateway_sessions, its live rows by tenant, its rows by forget_at",
        postgres=(
            """CREATE TABLE gateway_sessions (
                id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                version BIGINT NOT NULL,
                body BYTEA NOT NULL,
                live BOOLEAN NOT NULL,
                last_used DOUBLE PRECISION NOT NULL,
                history_tokens BIGINT NOT NULL,
                forget_at DOUBLE PRECISION NOT NULL
            )""",
            "CREATE INDEX gateway_sessions_live_by_tenant ON gateway_sessions (tenant) WHERE live",
            "CREATE INDEX gateway_sessions_by_forget_at ON gateway_sessions (forget_at)",
        ),
    ),
)
# Most forgotten rows one create deletes.
SWEEP_LIMIT = 100

_COLUMNS = "id, tenant, version, body, live, last_used, history_tokens, forget_at"
# $1 id, $2 tenant, $3 body, $4 live, $5 last_used, $6 history_tokens, $7 forget_at, $8 now.
_CREATE = f"""
INSERT INTO gateway_sessions AS stored ({_COLUMNS}) VALUES ($1, $2, 1, $3, $4, $5, $6, $7)
ON CONFLICT (id) DO UPDATE SET
    tenant = EXCLUDED.tenant, version = 1, body = EXCLUDED.body, live = EXCLUDED.live,
    last_used = EXCLUDED.last_used, history_tokens = EXCLUDED.history_tokens, forget_at = EXCLUDED.forget_at
WHERE stored.forget_at <= $8
RETURNING 1
"""
# $1 .. $7 as _CREATE, $8 the expected version, $9 now.
_UPDATE = """
UPDATE gateway_sessions SET
    tenant = $2, version = version + 1, body = $3, live = $4, last_used = $5, history_tokens = $6,
    forget_at = $7
WHERE id = $1 AND version = $8 AND forget_at > $9
RETURNING 1
"""
# $1 now.
_SWEEP = f"""
DELETE FROM gateway_sessions WHERE forget_at <= $1 AND id = ANY(ARRAY(
    SELECT id FROM gateway_sessions WHERE forget_at <= $1
    ORDER BY forget_at LIMIT {SWEEP_LIMIT} FOR UPDATE SKIP LOCKED
))
"""
_LOAD = "SELECT version, body FROM gateway_sessions WHERE id = $1 AND forget_at > $2"
_INDEX = (
    "SELECT id, last_used, history_tokens FROM gateway_sessions WHERE tenant = $1 AND live AND forget_at > $2"
)
_ENCODER = msgspec.msgpack.Encoder()
_RECORD = msgspec.msgpack.Decoder(SessionRecord)


class PostgresSessionStore(PostgresStore):
    """`SessionStore` in one PostgreSQL schema. The store owns its pool: `aclose` closes it."""

    what = "session"
    unavailable = SessionStoreUnavailableError
    migrations = MIGRATIONS
    migrations_table = MIGRATIONS_TABLE
    # Arbitrary but fixed ("Lkgtsess"): replicas migrating the sessions table wait on each other only.
    lock_key = 0x4C6B6774_73657373

    def __init__(self, pool: Any, clock: Clock = time.time, *, op_timeout: float = 0.5) -> None:
        """Use `open`; this takes an asyncpg pool whose schema is already migrated. Records are kept and
        forgotten on `clock`; each operation is bounded by `op_timeout`."""
        super().__init__(pool)
        self._clock = clock
        self._op_timeout = op_timeout

    @classmethod
    async def open(
        cls, dsn: str, *, clock: Clock = time.time, op_timeout: float = 0.5, **options: Unpack[PoolOptions]
    ) -> Self:
        """Connect to `dsn`, create the schema if missing, and migrate it (`PostgresStore.open`)."""
        return cls(await cls.open_pool(dsn, **options), clock, op_timeout=op_timeout)

    @asynccontextmanager
    async def _bounded(self) -> AsyncIterator[Any]:
        """A pooled connection (`_connect`) for one operation, which must end within `op_timeout`."""
        try:
            async with asyncio.timeout(self._op_timeout), self._connect() as conn:
                yield conn
        except TimeoutError as exc:
            raise SessionStoreUnavailableError(
                f"the {self.what} database did not answer within {self._op_timeout}s"
            ) from exc

    async def load(self, session_id: str) -> Versioned | None:
        """See `SessionStore.load`."""
        async with self._bounded() as conn:
            row = await conn.fetchrow(_LOAD, session_id, self._clock())
        if row is None:
            return None
        try:
            return Versioned(_RECORD.decode(row[1]), int(row[0]))
        except msgspec.DecodeError as exc:
            raise SessionStoreUnavailableError(
                f"the session store holds a record for {session_id!r} that does not decode: {exc}"
            ) from exc

    async def save(self, record: SessionRecord, version: int | None, keep: float) -> bool:
        """See `SessionStore.save` (a create first deletes up to `SWEEP_LIMIT` forgotten rows)."""
        now = self._clock()
        row = (
            record.id,
            record.tenant,
            _ENCODER.encode(record),
            record.ended is None,
            record.last_used,
            record.history_tokens,
            now + keep,
        )
        async with self._bounded() as conn:
            if version is None:
                await conn.execute(_SWEEP, now)
                saved = await conn.fetchval(_CREATE, *row, now)
            else:
                saved = await conn.fetchval(_UPDATE, *row, version, now)
        return saved is not None

    async def index(self, tenant: str) -> dict[str, IndexEntry]:
        """See `SessionStore.index` (rows past their `forget_at` are left out)."""
        async with self._bounded() as conn:
            rows = await conn.fetch(_INDEX, tenant, self._clock())
        return {row[0]: IndexEntry(row[1], row[2]) for row in rows}

    async def aclose(self) -> None:
        """Close the pool (the sessions stay in PostgreSQL for the other replicas)."""
        await self.close()
