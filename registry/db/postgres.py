"""`open_pool`: an asyncpg pool working in one PostgreSQL schema, created and migrated on open.

`search_path` is set on every pooled connection, so a store's statements name tables without a schema.
Replicas starting at once take turns on an advisory lock while creating the schema and migrating.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg  # type: ignore[import-untyped]

from registry.db.migrations import IDENTIFIER, Migration, checked_table, create_table_sql, pending


async def open_pool(
    dsn: str,
    *,
    schema: str,
    migrations: Sequence[Migration],
    table: str,
    lock_key: int,
    min_size: int,
    max_size: int,
) -> Any:
    """Connect to `dsn`, create `schema` if missing, and apply `migrations` (recorded in `table`) to it.

    `lock_key` is the advisory lock held while migrating: a store's own fixed key, so the replicas of one
    store wait on each other and not on other stores.
    """
    if not IDENTIFIER.fullmatch(schema):
        raise ValueError(f"schema {schema!r} must match {IDENTIFIER.pattern}")
    pool = await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, server_settings={"search_path": schema}
    )
    try:
        async with pool.acquire() as conn:
            await conn.execute("SELECT pg_advisory_lock($1)", lock_key)
            try:
                # Inside the lock: two replicas creating the same schema at once would otherwise collide.
                await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
                await migrate(conn, migrations, table)
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", lock_key)
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
