"""The `RegistryStore` protocol: published versions, aliases with their history, and a generation counter.

Every change (a new version, an alias set or rolled back) bumps the generation in the same transaction, so
a replica that polls `generation()` and then reads one `snapshot()` sees every change up to that
generation and none after it. A call that changes nothing (publishing identical content again, setting the
targets an alias already has) bumps nothing and records nothing.

Exceptions (each knows the HTTP status an API would answer with)::

    RegistryError               base (500)
    ├── NotFoundError           no such version or alias (404)
    ├── ConflictError           name@version is published with other content (409)
    ├── InvalidError            the input breaks a rule; the message names the rule (422)
    └── UnavailableError        the store cannot be reached (503)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from registry.models import (
    Alias,
    AliasChange,
    AliasTarget,
    FiguresRecord,
    Kind,
    Published,
    RegistrySnapshot,
)


class RegistryStore(Protocol):
    """Versions and aliases in SQLite (embedded default) or PostgreSQL (shared by replicas).

    The store checks what it alone can check atomically (identity, existence); rules about content
    (weights, references between versions) belong to `registry.validation`.
    """

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
        """Store a version. Identical content again returns the stored version unchanged (idempotent);
        other content under the same name@version is a ConflictError naming it."""
        ...

    async def get(self, kind: Kind, name: str, version: str) -> Published:
        """One version, or NotFoundError."""
        ...

    async def versions(self, kind: Kind, name: str) -> list[Published]:
        """All versions of a name, oldest first."""
        ...

    async def set_alias(
        self, kind: Kind, name: str, targets: Sequence[AliasTarget], *, actor: str, now: float
    ) -> Alias:
        """Point an alias at `targets` (creating it if needed), recording the change in its history.

        NotFoundError if a target version does not exist.
        """
        ...

    async def aliases(self, kind: Kind | None = None) -> list[Alias]:
        """All aliases (of one kind, or all), ordered by kind and name."""
        ...

    async def alias_history(self, kind: Kind, name: str, limit: int = 100) -> list[AliasChange]:
        """The newest changes of one alias first."""
        ...

    async def rollback(self, kind: Kind, name: str, *, actor: str, now: float) -> Alias:
        """Move an alias back to the targets it had before its current ones, in one transaction.

        NotFoundError if there is no such alias; InvalidError if it has no earlier targets.
        """
        ...

    async def record_figures(self, record: FiguresRecord) -> None:
        """Keep a version's figures on one suite (in one context). The first record of a version, suite and
        context stays: recording them again changes nothing. The generation is not bumped (figures change
        nothing a request resolves)."""
        ...

    async def figures(self, kind: Kind, name: str | None = None) -> list[FiguresRecord]:
        """The figures records of one kind (of one name), oldest first."""
        ...

    async def generation(self) -> int:
        """The change counter: 0 for an empty registry, bumped by every change."""
        ...

    async def snapshot(self) -> RegistrySnapshot:
        """All versions, all aliases and the generation, read in one consistent transaction."""
        ...

    async def server_secret(self, candidate: str) -> str:
        """The deployment's server secret: the stored one, or `candidate`, stored now when there is none.
        The first caller's candidate wins and is never replaced, so replicas sharing the store agree."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
