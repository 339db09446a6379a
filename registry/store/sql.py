"""The statements both stores run, how Structs map to rows, and the pure part of each write.

Statements use SQLite's `?` placeholders; the PostgreSQL store runs them through
`registry.db.postgres.numbered`. Column lists
are fixed so rows decode by position on both drivers. The stores keep only what differs between drivers:
connections, transactions and locking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from registry.db import Row
from registry.errors import ConflictError, InvalidError, NotFoundError
from registry.models import Alias, AliasChange, AliasTarget, FiguresRecord, Kind, Published

VERSION_COLUMNS = "kind, name, version, content_hash, spec, published_at, actor"
ALIAS_COLUMNS = "kind, name, targets, revision, updated_at, actor"
HISTORY_COLUMNS = "id, kind, name, action, targets, previous, parent_id, at, actor"
INSERT_VERSION = (
    f"INSERT INTO registry_versions ({VERSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (kind, name, version) DO NOTHING"
)
SELECT_VERSION = (
    f"SELECT {VERSION_COLUMNS} FROM registry_versions WHERE kind = ? AND name = ? AND version = ?"
)
SELECT_VERSIONS = f"SELECT {VERSION_COLUMNS} FROM registry_versions WHERE kind = ? AND name = ?"
SELECT_ALL_VERSIONS = f"SELECT {VERSION_COLUMNS} FROM registry_versions"
SELECT_ALIAS = f"SELECT {ALIAS_COLUMNS} FROM registry_aliases WHERE kind = ? AND name = ?"
SELECT_ALIASES = f"SELECT {ALIAS_COLUMNS} FROM registry_aliases"
UPSERT_ALIAS = (
    f"INSERT INTO registry_aliases ({ALIAS_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (kind, name)"
    " DO UPDATE SET targets = excluded.targets, revision = excluded.revision,"
    " updated_at = excluded.updated_at, actor = excluded.actor"
)
INSERT_HISTORY = (
    "INSERT INTO registry_alias_history (kind, name, action, targets, previous, parent_id, at, actor)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?) RETURNING id"
)
SELECT_HISTORY_ENTRY = f"SELECT {HISTORY_COLUMNS} FROM registry_alias_history WHERE id = ?"
SELECT_HISTORY = (
    f"SELECT {HISTORY_COLUMNS} FROM registry_alias_history"  # newest first
    " WHERE kind = ? AND name = ? ORDER BY id DESC LIMIT ?"
)
FIGURES_COLUMNS = "kind, name, version, suite_sha256, context, figures, error, baseline, forced, at, actor"
# The first record of a version on a suite stays (append-only): a second measurement changes nothing.
INSERT_FIGURES = (
    f"INSERT INTO registry_figures ({FIGURES_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (kind, name, version, suite_sha256, context) DO NOTHING"
)
SELECT_FIGURES = f"SELECT {FIGURES_COLUMNS} FROM registry_figures WHERE kind = ?"
FIGURES_ORDER = " ORDER BY at, name, version, context"
SELECT_GENERATION = "SELECT value FROM registry_generation WHERE id = 1"
BUMP_GENERATION = "UPDATE registry_generation SET value = value + 1 WHERE id = 1"
# The first writer's secret stays: every later one (another replica starting) reads it back.
INSERT_SECRET = "INSERT INTO registry_secret (id, value) VALUES (1, ?) ON CONFLICT (id) DO NOTHING"
SELECT_SECRET = "SELECT value FROM registry_secret WHERE id = 1"

_targets = msgspec.json.Decoder(tuple[AliasTarget, ...])
_encode = msgspec.json.Encoder()


def encode_targets(targets: Sequence[AliasTarget]) -> str:
    """Targets as stored: a JSON array."""
    return _encode.encode(tuple(targets)).decode()


def normalize(targets: Sequence[AliasTarget]) -> tuple[AliasTarget, ...]:
    """Targets with float weights (Structs do not convert on construction), so equal targets compare equal."""
    return tuple(AliasTarget(version=t.version, weight=float(t.weight)) for t in targets)


def new_version(
    kind: Kind, name: str, version: str, spec_json: str, content_hash: str, *, actor: str, now: float
) -> Published:
    """The version a publish stores."""
    return Published(
        kind=kind,
        name=name,
        version=version,
        content_hash=content_hash,
        spec_json=spec_json,
        published_at=float(now),
        actor=actor,
    )


def version_row(p: Published) -> tuple[object, ...]:
    """Column values of a version, in VERSION_COLUMNS order."""
    return (p.kind, p.name, p.version, p.content_hash, p.spec_json, float(p.published_at), p.actor)


def version_from_row(row: Row) -> Published:
    """A version from a row selected as VERSION_COLUMNS."""
    kind, name, version, content_hash, spec_json, now, actor = row
    return new_version(kind, name, version, spec_json, content_hash, actor=actor, now=now)


def alias_from_row(row: Row) -> Alias:
    """An alias from a row selected as ALIAS_COLUMNS."""
    targets = _targets.decode(row[2])
    return Alias(
        kind=row[0], name=row[1], targets=targets, revision=int(row[3]), updated_at=row[4], actor=row[5]
    )


def change_from_row(row: Row) -> AliasChange:
    """An alias history entry from a row selected as HISTORY_COLUMNS."""
    return AliasChange(
        change_id=int(row[0]),
        kind=row[1],
        name=row[2],
        action=row[3],
        targets=_targets.decode(row[4]),
        previous=None if row[5] is None else _targets.decode(row[5]),
        parent_id=None if row[6] is None else int(row[6]),
        at=float(row[7]),
        actor=row[8],
    )


def figures_row(r: FiguresRecord) -> tuple[object, ...]:
    """Column values of a figures record, in FIGURES_COLUMNS order."""
    return (
        r.kind, r.name, r.version, r.suite_sha256, r.context, r.figures, r.error, r.baseline,
        bool(r.forced), float(r.at), r.actor,
    )  # fmt: skip


def figures_from_row(row: Row) -> FiguresRecord:
    """A figures record from a row selected as FIGURES_COLUMNS."""
    kind, name, version, suite, context, figures, error, baseline, forced, at, actor = row
    return FiguresRecord(
        kind=kind, name=name, version=version, suite_sha256=suite, context=context, figures=figures,
        error=error, baseline=baseline, forced=bool(forced), at=float(at), actor=actor,
    )  # fmt: skip


def same_or_conflict(stored: Published, content_hash: str) -> Published:
    """`stored` if it has `content_hash` (an idempotent publish); else the ConflictError naming it."""
    if stored.content_hash != content_hash:
        raise ConflictError(
            f"{stored.kind} {stored.ref} is already published with content sha256 {stored.content_hash}, "
            f"not {content_hash}: published versions are immutable, publish a new version"
        )
    return stored


def check_found(kind: Kind, name: str, targets: Sequence[AliasTarget], found: set[str]) -> None:
    """NotFoundError naming the first target version that `found` lacks."""
    for target in targets:
        if target.version not in found:
            raise NotFoundError(f"alias {kind}:{name} -> {name}@{target.version}: no such {kind} version")


class AliasMove(msgspec.Struct, frozen=True, kw_only=True):
    """An alias change about to be written: its history entry, then the alias row pointing at it."""

    kind: Kind
    name: str
    action: Literal["set", "rollback"]
    targets: tuple[AliasTarget, ...]
    before: tuple[AliasTarget, ...] | None
    parent: int | None
    actor: str
    now: float

    def history_args(self) -> tuple[object, ...]:
        """Values for INSERT_HISTORY."""
        before = None if self.before is None else encode_targets(self.before)
        targets = encode_targets(self.targets)
        return (self.kind, self.name, self.action, targets, before, self.parent, float(self.now), self.actor)

    def alias_args(self, revision: int) -> tuple[object, ...]:
        """Values for UPSERT_ALIAS, once the history entry has id `revision`."""
        return (self.kind, self.name, encode_targets(self.targets), revision, float(self.now), self.actor)

    def alias(self, revision: int) -> Alias:
        """The alias as written."""
        return Alias(
            kind=self.kind,
            name=self.name,
            targets=self.targets,
            updated_at=float(self.now),
            actor=self.actor,
            revision=revision,
        )


def plan_set(
    kind: Kind, name: str, targets: tuple[AliasTarget, ...], current: Alias | None, *, actor: str, now: float
) -> AliasMove | Alias:
    """The change that points an alias at `targets`, or `current` itself when it points there already."""
    if current is not None and current.targets == targets:
        return current
    before, parent = (None, None) if current is None else (current.targets, current.revision)
    return AliasMove(
        kind=kind,
        name=name,
        action="set",
        targets=targets,
        before=before,
        parent=parent,
        actor=actor,
        now=now,
    )


def plan_rollback(
    current: Alias, head: AliasChange, back: AliasChange | None, *, actor: str, now: float
) -> AliasMove:
    """The change that returns an alias from its `head` entry to the entry before it (`back`).

    The new entry's parent is `back`'s parent, so a second rollback goes one step further back.
    """
    if back is None or head.parent_id != back.change_id:
        raise InvalidError(f"alias {current.kind}:{current.name} has no earlier targets to roll back to")
    return AliasMove(
        kind=current.kind,
        name=current.name,
        action="rollback",
        targets=back.targets,
        before=current.targets,
        parent=back.parent_id,
        actor=actor,
        now=now,
    )
