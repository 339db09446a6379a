"""`SqliteRegistryStore`: the embedded default, on the stdlib `sqlite3` module and one worker thread.

sqlite3 calls block, so every call runs on the one dedicated thread of a `registry.db.sqlite.SqliteWorker`,
which also owns the connection; one thread serialises the calls, so no two transactions of this process
interleave. Writers take the write lock up front (BEGIN IMMEDIATE); `snapshot` reads inside one
transaction, which WAL turns into one consistent view even while another process writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from registry.db.sqlite import Conn, SqliteStore, transaction
from registry.errors import NotFoundError, RegistryError, UnavailableError
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


class SqliteRegistryStore(SqliteStore):
    """A `RegistryStore` in one SQLite file (WAL mode), or in memory for ":memory:"."""

    what = "registry"
    # Locked past busy_timeout, disk errors: the caller keeps its last view and tries again later.
    unavailable = UnavailableError
    closed_error = RegistryError
    migrations = MIGRATIONS
    migrations_table = MIGRATIONS_TABLE

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

        def publish(conn: Conn) -> Published:
            with transaction(conn):
                if conn.execute(sql.INSERT_VERSION, sql.version_row(new)).rowcount == 0:
                    return sql.same_or_conflict(_version(conn, kind, name, version), content_hash)
                conn.execute(sql.BUMP_GENERATION)
            return new

        return await self._run(publish)

    async def get(self, kind: Kind, name: str, version: str) -> Published:
        """One version, or NotFoundError."""
        return await self._run(lambda conn: _version(conn, kind, name, version))

    async def versions(self, kind: Kind, name: str) -> list[Published]:
        """All versions of a name, oldest first."""
        query = sql.SELECT_VERSIONS + " ORDER BY published_at, version"
        return await self._run(
            lambda conn: [sql.version_from_row(r) for r in conn.execute(query, (kind, name))]
        )

    async def set_alias(
        self, kind: Kind, name: str, targets: Sequence[AliasTarget], *, actor: str, now: float
    ) -> Alias:
        """Point an alias at `targets`, recording the change; the same targets again change nothing."""
        wanted = sql.normalize(targets)

        def set_alias(conn: Conn) -> Alias:
            with transaction(conn):
                found = {t.version for t in wanted if _row(conn, sql.SELECT_VERSION, kind, name, t.version)}
                sql.check_found(kind, name, wanted, found)
                move = sql.plan_set(
                    kind, name, wanted, _alias_or_none(conn, kind, name), actor=actor, now=now
                )
                return move if isinstance(move, Alias) else _write(conn, move)

        return await self._run(set_alias)

    async def aliases(self, kind: Kind | None = None) -> list[Alias]:
        """All aliases (of one kind, or all), ordered by kind and name."""
        where, args = ("", ()) if kind is None else (" WHERE kind = ?", (kind,))
        query = f"{sql.SELECT_ALIASES}{where} ORDER BY kind, name"
        return await self._run(lambda conn: [sql.alias_from_row(r) for r in conn.execute(query, args)])

    async def alias_history(self, kind: Kind, name: str, limit: int = 100) -> list[AliasChange]:
        """The newest changes of one alias first."""
        args = (kind, name, limit)
        return await self._run(
            lambda conn: [sql.change_from_row(r) for r in conn.execute(sql.SELECT_HISTORY, args)]
        )

    async def rollback(self, kind: Kind, name: str, *, actor: str, now: float) -> Alias:
        """Move an alias back to the targets it had before its current ones."""

        def rollback(conn: Conn) -> Alias:
            with transaction(conn):
                current = _alias(conn, kind, name)
                head = _entry(conn, current.revision)
                back = None if head.parent_id is None else _entry(conn, head.parent_id)
                return _write(conn, sql.plan_rollback(current, head, back, actor=actor, now=now))

        return await self._run(rollback)

    async def record_figures(self, record: FiguresRecord) -> None:
        """Keep a version's figures on one suite; a second record of the same key changes nothing."""

        def insert(conn: Conn) -> None:
            with transaction(conn):
                conn.execute(sql.INSERT_FIGURES, sql.figures_row(record))

        await self._run(insert)

    async def figures(self, kind: Kind, name: str | None = None) -> list[FiguresRecord]:
        """The figures records of one kind (of one name), oldest first."""
        where, args = ("", (kind,)) if name is None else (" AND name = ?", (kind, name))
        query = sql.SELECT_FIGURES + where + sql.FIGURES_ORDER
        return await self._run(lambda conn: [sql.figures_from_row(r) for r in conn.execute(query, args)])

    async def generation(self) -> int:
        """The change counter."""
        return await self._run(lambda conn: int(conn.execute(sql.SELECT_GENERATION).fetchone()[0]))

    async def snapshot(self) -> RegistrySnapshot:
        """All versions, all aliases and the generation, from one read transaction."""

        def snapshot(conn: Conn) -> RegistrySnapshot:
            conn.execute("BEGIN")
            try:
                return RegistrySnapshot(
                    generation=int(conn.execute(sql.SELECT_GENERATION).fetchone()[0]),
                    versions=tuple(sql.version_from_row(r) for r in conn.execute(sql.SELECT_ALL_VERSIONS)),
                    aliases=tuple(sql.alias_from_row(r) for r in conn.execute(sql.SELECT_ALIASES)),
                )
            finally:
                conn.execute("COMMIT")

        return await self._run(snapshot)

    async def server_secret(self, candidate: str) -> str:
        """The stored server secret, or `candidate` stored now (the first caller's wins)."""

        def secret(conn: Conn) -> str:
            with transaction(conn):
                conn.execute(sql.INSERT_SECRET, (candidate,))
                return str(conn.execute(sql.SELECT_SECRET).fetchone()[0])

        return await self._run(secret)


def _write(conn: Conn, move: sql.AliasMove) -> Alias:
    """Record an alias change, point the alias at its targets, and bump the generation."""
    revision = int(conn.execute(sql.INSERT_HISTORY, move.history_args()).fetchone()[0])
    conn.execute(sql.UPSERT_ALIAS, move.alias_args(revision))
    conn.execute(sql.BUMP_GENERATION)
    return move.alias(revision)


def _row(conn: Conn, query: str, *args: object) -> tuple[object, ...] | None:
    row: tuple[object, ...] | None = conn.execute(query, args).fetchone()
    return row


def _version(conn: Conn, kind: Kind, name: str, version: str) -> Published:
    row = _row(conn, sql.SELECT_VERSION, kind, name, version)
    if row is None:
        raise NotFoundError(f"no {kind} version {name}@{version}")
    return sql.version_from_row(row)


def _alias_or_none(conn: Conn, kind: Kind, name: str) -> Alias | None:
    row = _row(conn, sql.SELECT_ALIAS, kind, name)
    return None if row is None else sql.alias_from_row(row)


def _alias(conn: Conn, kind: Kind, name: str) -> Alias:
    alias = _alias_or_none(conn, kind, name)
    if alias is None:
        raise NotFoundError(f"no {kind} alias {name!r}")
    return alias


def _entry(conn: Conn, change_id: int) -> AliasChange:
    row = _row(conn, sql.SELECT_HISTORY_ENTRY, change_id)
    if row is None:
        raise NotFoundError(f"no alias history entry {change_id}")
    return sql.change_from_row(row)
