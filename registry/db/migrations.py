"""Schema migrations for both dialects: the `Migration` step, and what each runner needs about its table.

A store lists its own `Migration`s and names its own migrations table (stores may share one database, and
their version numbers would collide in a shared table). The runners, `sqlite.migrate` and
`postgres.migrate`, apply in one transaction each the migrations whose version that table lacks, so
applying is idempotent. Never edit a released migration: append a new one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

import msgspec

Dialect = Literal["sqlite", "postgres"]

# Plain lower-case identifiers only, so a schema or table name never needs quoting where it is interpolated.
IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")

_ID_PK: dict[Dialect, str] = {
    # Without AUTOINCREMENT SQLite may reuse the largest id after a delete; the tables using it are
    # append-only, so ids still only grow, and the plain rowid alias is cheaper.
    "sqlite": "INTEGER PRIMARY KEY",
    "postgres": "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
}


class Migration(msgspec.Struct, frozen=True, kw_only=True):
    """One schema step: SQL shared by both dialects, then each dialect's own."""

    version: int
    summary: str
    shared: tuple[str, ...] = ()
    sqlite: tuple[str, ...] = ()
    postgres: tuple[str, ...] = ()

    def statements(self, dialect: Dialect) -> tuple[str, ...]:
        """The statements to run on `dialect`, in order (`{id_pk}` in shared SQL is its auto-increment id)."""
        own = self.sqlite if dialect == "sqlite" else self.postgres
        return tuple(sql.replace("{id_pk}", _ID_PK[dialect]) for sql in self.shared) + own


def create_table_sql(table: str) -> str:
    """The statement creating the migrations table `table` (one row per applied version) if missing."""
    return f"CREATE TABLE IF NOT EXISTS {checked_table(table)} (version INTEGER PRIMARY KEY)"


def checked_table(table: str) -> str:
    """`table` itself, once it is known to be safe to interpolate into SQL."""
    if not IDENTIFIER.fullmatch(table):
        raise ValueError(f"migrations table {table!r} must match {IDENTIFIER.pattern}")
    return table


def pending(migrations: Iterable[Migration], applied: set[int]) -> list[Migration]:
    """The migrations not yet applied, in version order."""
    return [m for m in sorted(migrations, key=lambda m: m.version) if m.version not in applied]
