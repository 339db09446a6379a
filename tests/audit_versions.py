"""Databases left at an older audit migration, for upgrade tests: rows written with the schema as it was."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policy.audit.migrations import MIGRATIONS, MIGRATIONS_TABLE
from policy.audit.postgres import PostgresAuditStore
from registry.db.postgres import open_pool
from registry.db.sqlite import SqliteWorker, transaction
from tests.backends import PG_DSN, SqlBackend

# (table and its columns, e.g. "audit_heads (tenant, seq, hash)", one row of values)
Insert = tuple[str, tuple[Any, ...]]


async def write_at_migration(backend: SqlBackend[Any], version: int, inserts: Sequence[Insert]) -> None:
    """Migrate `backend`'s database to audit migration `version` only, then insert `inserts` in order."""
    migrations = MIGRATIONS[:version]
    if backend.name == "sqlite":
        db = await SqliteWorker.open(
            backend.location, migrations=migrations, table=MIGRATIONS_TABLE, foreign_keys=False
        )

        def write(conn: Any) -> None:
            with transaction(conn):
                for into, row in inserts:
                    conn.execute(f"INSERT INTO {into} VALUES ({', '.join('?' for _ in row)})", row)

        await db.run(write)
        await db.close()
        return
    pool = await open_pool(
        PG_DSN,
        schema=backend.location,
        migrations=migrations,
        table=MIGRATIONS_TABLE,
        lock_key=PostgresAuditStore.lock_key,
        min_size=1,
        max_size=1,
    )
    async with pool.acquire() as conn:
        for into, row in inserts:
            marks = ", ".join(f"${i}" for i in range(1, len(row) + 1))
            await conn.execute(f"INSERT INTO {into} VALUES ({marks})", *row)
    await pool.close()
