"""The SQL plumbing shared by every SQL-backed store: connections, transactions, error mapping, migrations.

It is the lowest layer under the tenant, audit and appeal stores (`policy`) and the registry's own stores
(`registry.store`) alike, and imports nothing from any of them, so each builds on it without depending on
the others. `sqlite` runs one connection on its own worker thread, under the `SqliteStore` base;
`postgres` opens a migrated asyncpg pool in one schema, under the `PostgresStore` base; both bases open,
close, run transactions and map driver errors onto the errors the store names. `migrations` holds what
both dialects share about schema steps; `stores.open_store` opens the backend the storage settings name.
A store keeps what is its own: tables, statements, and which errors it raises.
"""

from collections.abc import Sequence
from typing import Any

# A result row as either driver returns it (an sqlite3 tuple, an asyncpg Record): stores read it by position.
Row = Sequence[Any]

__all__ = ["Row"]
