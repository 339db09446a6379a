"""`PostgresRegistryStore`: the registry in PostgreSQL, shared by gateway replicas (asyncpg pool).

Each store works in one schema (`search_path` on every pooled connection), created and migrated on `open`
(`registry.db.postgres.PostgresStore`) under an advisory lock so replicas starting together take turns. Every
write first locks the single generation row, so writes run one at a time and generations follow commit
order; `snapshot` reads in one REPEATABLE READ transaction, so the versions and aliases it returns are
exactly those of its generation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from registry.db.postgres import PostgresStore, numbered
from registry.errors import NotFoundError, UnavailableError
from registry.models import (
    Alias,
    AliasChange,
    AliasTarget,
    FiguresRecord,
    Kind,
    Published,
    RegistrySnapshot,
)
from registry.store import sql
from registry.store.migrations import MIGRATIONS, MIGRATIONS_TABLE

_LOCK_GENERATION = "SELECT value FROM registry_generation WHERE id = 1 FOR UPDATE"
# Ids sort by code point, as on SQLite, whatever the database's default collation.
_BY_ALIAS = ' ORDER BY kind COLLATE "C", name COLLATE "C"'
# The shared statements in PostgreSQL's placeholder style, converted once.
_INSERT_VERSION = numbered(sql.INSERT_VERSION + " RETURNING 1")
_SELECT_VERSION = numbered(sql.SELECT_VERSION)
_SELECT_VERSIONS = numbered(sql.SELECT_VERSIONS + ' ORDER BY published_at, version COLLATE "C"')
_SELECT_ALIAS = numbered(sql.SELECT_ALIAS)
_SELECT_ALIASES_OF = numbered(sql.SELECT_ALIASES + " WHERE kind = ?" + _BY_ALIAS)
_SELECT_HISTORY = numbered(sql.SELECT_HISTORY)
_SELECT_HISTORY_ENTRY = numbered(sql.SELECT_HISTORY_ENTRY)
_INSERT_HISTORY = numbered(sql.INSERT_HISTORY)
_UPSERT_ALIAS = numbered(sql.UPSERT_ALIAS)
_INSERT_SECRET = numbered(sql.INSERT_SECRET)
_INSERT_FIGURES = numbered(sql.INSERT_FIGURES)
_FIGURES_ORDER = ' ORDER BY at, name COLLATE "C", version COLLATE "C", context COLLATE "C"'
_SELECT_FIGURES = numbered(sql.SELECT_FIGURES + _FIGURES_ORDER)
_SELECT_FIGURES_OF = numbered(sql.SELECT_FIGURES + " AND name = ?" + _FIGURES_ORDER)


class PostgresRegistryStore(PostgresStore):
    """A `RegistryStore` in one PostgreSQL schema."""

    what = "registry"
    unavailable = UnavailableError
    migrations = MIGRATIONS
    migrations_table = MIGRATIONS_TABLE
    # Fixed and distinct from the tenant store's ("Lkgtregi"): registry migrations wait only on each other.
    lock_key = 0x4C6B6774_72656769
    max_connections = 5

    @asynccontextmanager
    async def _tx(self, *, write: bool) -> AsyncIterator[Any]:
        """A connection in a transaction: a writer holding the generation row, or a consistent reader."""
        async with self._connect() as conn:
            if write:
                async with conn.transaction():
                    await conn.execute(_LOCK_GENERATION)
                    yield conn
            else:
                async with conn.transaction(isolation="repeatable_read", readonly=True):
                    yield conn

    async def publish(
        self,
        kind: Kind,
        name: str,
        version: str,
        spec_json: str,
        content_hash: str,
        *,
        actor: str,
        now: float,
    ) -> Published:
        """Store a version; identical content again is a no-op, other content a ConflictError."""
        new = sql.new_version(kind, name, version, spec_json, content_hash, actor=actor, now=now)
        async with self._tx(write=True) as conn:
            if await conn.fetchval(_INSERT_VERSION, *sql.version_row(new)) is None:
                return sql.same_or_conflict(await _version(conn, kind, name, version), content_hash)
            await conn.execute(sql.BUMP_GENERATION)
        return new

    async def get(self, kind: Kind, name: str, version: str) -> Published:
        """One version, or NotFoundError."""
        async with self._tx(write=False) as conn:
            return await _version(conn, kind, name, version)

    async def versions(self, kind: Kind, name: str) -> list[Published]:
        """All versions of a name, oldest first."""
        async with self._tx(write=False) as conn:
            rows = await conn.fetch(_SELECT_VERSIONS, kind, name)
        return [sql.version_from_row(row) for row in rows]

    async def set_alias(
        self, kind: Kind, name: str, targets: Sequence[AliasTarget], *, actor: str, now: float
    ) -> Alias:
        """Point an alias at `targets`, recording the change; the same targets again change nothing."""
        wanted = sql.normalize(targets)
        async with self._tx(write=True) as conn:
            found = {t.version for t in wanted if await conn.fetchrow(_SELECT_VERSION, kind, name, t.version)}
            sql.check_found(kind, name, wanted, found)
            move = sql.plan_set(
                kind, name, wanted, await _alias_or_none(conn, kind, name), actor=actor, now=now
            )
            return move if isinstance(move, Alias) else await _write(conn, move)

    async def aliases(self, kind: Kind | None = None) -> list[Alias]:
        """All aliases (of one kind, or all), ordered by kind and name."""
        async with self._tx(write=False) as conn:
            if kind is None:
                rows = await conn.fetch(sql.SELECT_ALIASES + _BY_ALIAS)
            else:
                rows = await conn.fetch(_SELECT_ALIASES_OF, kind)
        return [sql.alias_from_row(row) for row in rows]

    async def alias_history(self, kind: Kind, name: str, limit: int = 100) -> list[AliasChange]:
        """The newest changes of one alias first."""
        async with self._tx(write=False) as conn:
            rows = await conn.fetch(_SELECT_HISTORY, kind, name, limit)
        return [sql.change_from_row(row) for row in rows]

    async def rollback(self, kind: Kind, name: str, *, actor: str, now: float) -> Alias:
        """Move an alias back to the targets it had before its current ones."""
        async with self._tx(write=True) as conn:
            current = await _alias(conn, kind, name)
            head = await _entry(conn, current.revision)
            back = None if head.parent_id is None else await _entry(conn, head.parent_id)
            return await _write(conn, sql.plan_rollback(current, head, back, actor=actor, now=now))

    async def record_figures(self, record: FiguresRecord) -> None:
        """Keep a version's figures on one suite; a second record of the same key changes nothing."""
        async with self._connect() as conn:
            await conn.execute(_INSERT_FIGURES, *sql.figures_row(record))

    async def figures(self, kind: Kind, name: str | None = None) -> list[FiguresRecord]:
        """The figures records of one kind (of one name), oldest first."""
        async with self._tx(write=False) as conn:
            if name is None:
                rows = await conn.fetch(_SELECT_FIGURES, kind)
            else:
                rows = await conn.fetch(_SELECT_FIGURES_OF, kind, name)
        return [sql.figures_from_row(row) for row in rows]

    async def generation(self) -> int:
        """The change counter."""
        async with self._tx(write=False) as conn:
            return int(await conn.fetchval(sql.SELECT_GENERATION))

    async def server_secret(self, candidate: str) -> str:
        """The stored server secret, or `candidate` stored now (the first caller's wins: replicas starting
        together race on the insert, and each reads back the one row that won)."""
        async with self._tx(write=True) as conn:
            await conn.execute(_INSERT_SECRET, candidate)
            return str(await conn.fetchval(sql.SELECT_SECRET))

    async def snapshot(self) -> RegistrySnapshot:
        """All versions, all aliases and the generation, from one REPEATABLE READ transaction."""
        async with self._tx(write=False) as conn:
            return RegistrySnapshot(
                generation=int(await conn.fetchval(sql.SELECT_GENERATION)),
                versions=tuple(sql.version_from_row(r) for r in await conn.fetch(sql.SELECT_ALL_VERSIONS)),
                aliases=tuple(sql.alias_from_row(r) for r in await conn.fetch(sql.SELECT_ALIASES)),
            )


async def _write(conn: Any, move: sql.AliasMove) -> Alias:
    """Record an alias change, point the alias at its targets, and bump the generation."""
    revision = int(await conn.fetchval(_INSERT_HISTORY, *move.history_args()))
    await conn.execute(_UPSERT_ALIAS, *move.alias_args(revision))
    await conn.execute(sql.BUMP_GENERATION)
    return move.alias(revision)


async def _version(conn: Any, kind: Kind, name: str, version: str) -> Published:
    row = await conn.fetchrow(_SELECT_VERSION, kind, name, version)
    if row is None:
        raise NotFoundError(f"no {kind} version {name}@{version}")
    return sql.version_from_row(row)


async def _alias_or_none(conn: Any, kind: Kind, name: str) -> Alias | None:
    row = await conn.fetchrow(_SELECT_ALIAS, kind, name)
    return None if row is None else sql.alias_from_row(row)


async def _alias(conn: Any, kind: Kind, name: str) -> Alias:
    alias = await _alias_or_none(conn, kind, name)
    if alias is None:
        raise NotFoundError(f"no {kind} alias {name!r}")
    return alias


async def _entry(conn: Any, change_id: int) -> AliasChange:
    row = await conn.fetchrow(_SELECT_HISTORY_ENTRY, change_id)
    if row is None:
        raise NotFoundError(f"no alias history entry {change_id}")
    return sql.change_from_row(row)
