"""The SQL plumbing shared by every SQL-backed store: connections, transactions and migrations.

It is the lowest layer under the tenant store (`policy`) and the registry store alike and imports nothing
from either, so each builds on it without depending on the other. `sqlite` runs one connection on its own
worker thread; `postgres` opens a migrated asyncpg pool in one schema; `migrations` holds what both
dialects share about schema steps. A store keeps what is its own: tables, statements, and how driver
errors map onto its errors.
"""

from collections.abc import Sequence
from typing import Any

# A result row as either driver returns it (an sqlite3 tuple, an asyncpg Record): stores read it by position.
Row = Sequence[Any]

__all__ = ["Row"]
