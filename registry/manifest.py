"""A TOML manifest of versions and aliases, applied at start-up through the `Registry` (so validated).

Each `[[tokenizer]]`, `[[chat_template]]`, `[[model]]`, `[[guard_model]]`, `[[policy]]` and `[[prompt]]`
entry holds `name`, `version` and the fields of that kind's spec; `[[alias]]` holds `kind`, `name` and either
`version` (one target) or `targets` (a canary: `[{version, weight}, ...]`). Applying is idempotent:
identical versions and unchanged aliases are left as they are, while changed content under an existing
version is a ConflictError naming it. The manifest states the aliases wanted at start-up, so a restart
re-applies them (an operator's later alias change holds until the manifest is edited to match).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec

from registry.errors import InvalidError
from registry.models import (
    AliasTarget,
    ChatTemplateSpec,
    EmbeddingModelSpec,
    GuardModelSpec,
    Kind,
    ModelSpec,
    PolicySpec,
    PromptSpec,
    RouteSpec,
    Spec,
    TokenizerSpec,
)
from registry.service import Registry


# An entry is its kind's spec plus a name and version; inheriting keeps the spec fields in one place.
class TokenizerEntry(TokenizerSpec, frozen=True, kw_only=True):
    """`[[tokenizer]]`."""

    name: str
    version: str


class ChatTemplateEntry(ChatTemplateSpec, frozen=True, kw_only=True):
    """`[[chat_template]]`."""

    name: str
    version: str


class ModelEntry(ModelSpec, frozen=True, kw_only=True):
    """`[[model]]`."""

    name: str
    version: str


class GuardModelEntry(GuardModelSpec, frozen=True, kw_only=True):
    """`[[guard_model]]`."""

    name: str
    version: str


class EmbeddingModelEntry(EmbeddingModelSpec, frozen=True, kw_only=True):
    """`[[embedding_model]]`."""

    name: str
    version: str


class RouteEntry(RouteSpec, frozen=True, kw_only=True):
    """`[[route]]`."""

    name: str
    version: str


class PolicyEntry(PolicySpec, frozen=True, kw_only=True):
    """`[[policy]]`."""

    name: str
    version: str


class PromptEntry(PromptSpec, frozen=True, kw_only=True):
    """`[[prompt]]`."""

    name: str
    version: str


class AliasEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[[alias]]`: exactly one of `version` and `targets`."""

    kind: Kind
    name: str
    version: str | None = None
    targets: tuple[AliasTarget, ...] = ()

    def wanted(self) -> tuple[AliasTarget, ...]:
        """The alias's targets; InvalidError unless exactly one of `version` and `targets` is given."""
        if (self.version is None) == (not self.targets):
            raise InvalidError(f"manifest alias {self.kind}:{self.name}: give either version or targets")
        if self.version is not None:
            return (AliasTarget(version=self.version, weight=1.0),)
        return self.targets


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A whole manifest file."""

    tokenizer: tuple[TokenizerEntry, ...] = ()
    chat_template: tuple[ChatTemplateEntry, ...] = ()
    model: tuple[ModelEntry, ...] = ()
    guard_model: tuple[GuardModelEntry, ...] = ()
    policy: tuple[PolicyEntry, ...] = ()
    prompt: tuple[PromptEntry, ...] = ()
    embedding_model: tuple[EmbeddingModelEntry, ...] = ()
    route: tuple[RouteEntry, ...] = ()
    alias: tuple[AliasEntry, ...] = ()


class ManifestResult(msgspec.Struct, frozen=True, kw_only=True):
    """What applying a manifest changed ("kind name@version" and "kind:name" strings)."""

    published: tuple[str, ...]
    unchanged: tuple[str, ...]
    aliases_set: tuple[str, ...]


def parse_manifest(text: str | bytes, *, source: str = "manifest") -> Manifest:
    """A manifest from TOML text; InvalidError naming `source` and the location of the fault."""
    try:
        return msgspec.toml.decode(text, type=Manifest)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise InvalidError(f"{source}: {exc}") from exc


async def load_manifest(path: Path) -> Manifest:
    """Read (in a thread) and parse a manifest file."""
    text = await asyncio.to_thread(path.read_bytes)
    return parse_manifest(text, source=str(path))


def _spec(entry: Any, spec_type: type[Spec]) -> Spec:
    # The spec's own fields, taken from the entry (which adds only name and version).
    return spec_type(**{field: getattr(entry, field) for field in spec_type.__struct_fields__})


async def apply_manifest(registry: Registry, manifest: Manifest, *, actor: str) -> ManifestResult:
    """Publish every version (dependencies first) and set every alias; idempotent."""
    entries: list[tuple[Kind, Any, type[Spec]]] = [
        *(("tokenizer", e, TokenizerSpec) for e in manifest.tokenizer),
        *(("chat_template", e, ChatTemplateSpec) for e in manifest.chat_template),
        *(("model", e, ModelSpec) for e in manifest.model),
        *(("guard_model", e, GuardModelSpec) for e in manifest.guard_model),
        *(("policy", e, PolicySpec) for e in manifest.policy),
        *(("prompt", e, PromptSpec) for e in manifest.prompt),
        *(("embedding_model", e, EmbeddingModelSpec) for e in manifest.embedding_model),
        *(("route", e, RouteSpec) for e in manifest.route),
    ]
    published: list[str] = []
    unchanged: list[str] = []
    await registry.refresh()
    for kind, entry, spec_type in entries:
        label = f"{kind} {entry.name}@{entry.version}"
        existed = registry.view.has(kind, entry.name, entry.version)
        await registry.publish(kind, entry.name, entry.version, _spec(entry, spec_type), actor=actor)
        (unchanged if existed else published).append(label)
    aliases_set: list[str] = []
    for alias in manifest.alias:
        view = registry.view
        before = (
            view.alias(alias.kind, alias.name).revision if view.has_alias(alias.kind, alias.name) else None
        )
        after = await registry.set_alias(alias.kind, alias.name, alias.wanted(), actor=actor)
        if after.revision != before:
            aliases_set.append(f"{alias.kind}:{alias.name}")
    return ManifestResult(
        published=tuple(published), unchanged=tuple(unchanged), aliases_set=tuple(aliases_set)
    )


async def apply_manifest_file(registry: Registry, path: Path, *, actor: str) -> ManifestResult:
    """Load and apply a manifest file."""
    return await apply_manifest(registry, await load_manifest(path), actor=actor)
