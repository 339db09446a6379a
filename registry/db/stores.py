"""`open_store`: open a store family's SQLite or PostgreSQL backend, whichever the storage settings name.

Each store family (tenants, registry, audit, appeals) names its two backends once in a `StoreKind`; the
caller passes that kind and the `[storage]` settings. Every store of one deployment opens the same SQLite
file or PostgreSQL schema, with the same time limits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

S = TypeVar("S")


class Storage(Protocol):
    """Where the stores live (the gateway's `[storage]` settings)."""

    @property
    def backend(self) -> Literal["sqlite", "postgres"]: ...
    @property
    def sqlite_path(self) -> str: ...
    @property
    def postgres_dsn(self) -> str: ...
    @property
    def postgres_schema(self) -> str: ...
    @property
    def postgres_connect_timeout(self) -> float: ...
    @property
    def postgres_command_timeout(self) -> float: ...


@dataclass(frozen=True)
class StoreKind(Generic[S]):
    """One store family by name: how to open it on SQLite (a file path) and on PostgreSQL (a DSN)."""

    name: str
    sqlite: Callable[..., Awaitable[S]]
    postgres: Callable[..., Awaitable[S]]


async def open_store(kind: StoreKind[S], storage: Storage, **extra: Any) -> S:
    """The `kind` store on the backend `storage` names, opened and migrated; `extra` goes to its `open`
    (the audit store's `mac_key`)."""
    if storage.backend == "postgres":
        return await kind.postgres(
            storage.postgres_dsn,
            schema=storage.postgres_schema,
            connect_timeout=storage.postgres_connect_timeout,
            command_timeout=storage.postgres_command_timeout,
            **extra,
        )
    # The file's directory is created (and `~` expanded) off the event loop.
    return await kind.sqlite(await asyncio.to_thread(sqlite_file, storage.sqlite_path), **extra)


def sqlite_file(raw: str) -> Path:
    """The SQLite file at `raw` (`~` expanded), its directory created if missing."""
    path = Path(raw).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
