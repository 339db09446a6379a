"""`RegistryView`: one immutable snapshot of the registry, and what resolving a name in it yields.

A request takes one view (`registry.view`) and resolves everything it needs from it: its model, the
model's tokenizer and template, its tenant's policy and that policy's guard models. A reload builds a new
view and swaps the reference, so a request never sees versions from before and after a change together.

A name is either pinned, `name@version` (aliases are bypassed), or an alias: one version, or two with
canary weights, chosen by `canary_pick` from a pick key the caller derives. The gateway derives it from
who is asking (tenant, API key) under its server secret (`gateway.secret`), never from anything the client
chooses per request, so a client cannot steer a request to a version and a retry lands on the same one.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from registry.errors import InvalidError, NotFoundError
from registry.hashing import canary_pick
from registry.models import (
    Alias,
    ChatTemplateSpec,
    EmbeddingModelSpec,
    GuardModelSpec,
    Kind,
    ModelSpec,
    PolicySpec,
    PromptSpec,
    Published,
    RegistrySnapshot,
    RouteSpec,
    S,
    Spec,
    check_name,
    decode_spec,
    parse_ref,
)

VersionKey = tuple[Kind, str, str]


class ResolvedModel(msgspec.Struct, frozen=True, kw_only=True):
    """A model version with the exact tokenizer and chat template versions it requires."""

    ref: str  # name@version of the model version chosen
    model: Published
    spec: ModelSpec
    tokenizer: Published
    chat_template: Published
    template: ChatTemplateSpec
    generation: int  # of the view it was resolved in

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token of this model version (for routing's KV budget)."""
        return self.spec.arch.kv_bytes_per_token()


class ResolvedGuard(msgspec.Struct, frozen=True, kw_only=True):
    """A guard model version and the model version it runs on (None for an embedding guard, which carries
    its own encoder and head)."""

    ref: str
    guard: Published
    spec: GuardModelSpec
    model: ResolvedModel | None


class ResolvedPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """A policy version and the guard model versions of its model stages, in stage order (rules stages
    name no guard)."""

    ref: str
    policy: Published
    spec: PolicySpec
    guards: tuple[ResolvedGuard, ...]
    generation: int


class ResolvedPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """A system prompt version and its text."""

    ref: str
    text: str


class ResolvedEmbeddingModel(msgspec.Struct, frozen=True, kw_only=True):
    """An embedding model version and its spec."""

    ref: str
    spec: EmbeddingModelSpec


class ResolvedRoute(msgspec.Struct, frozen=True, kw_only=True):
    """A route version (a model name that chooses a model per request) and its spec."""

    ref: str
    spec: RouteSpec


class RegistryView:
    """An immutable snapshot of versions and aliases at one generation."""

    __slots__ = ("_aliases", "_specs", "_versions", "generation")

    generation: int
    _versions: Mapping[VersionKey, Published]
    _specs: Mapping[VersionKey, Spec]
    _aliases: Mapping[tuple[Kind, str], Alias]

    def __init__(self, snapshot: RegistrySnapshot) -> None:
        """Index a snapshot, decoding every spec once (InvalidError if a stored spec no longer decodes)."""
        versions = {(p.kind, p.name, p.version): p for p in snapshot.versions}
        specs = {key: decode_spec(p.kind, p.spec_json) for key, p in versions.items()}
        aliases = {(a.kind, a.name): a for a in snapshot.aliases}
        for slot, value in (
            ("generation", snapshot.generation),
            ("_versions", MappingProxyType(versions)),
            ("_specs", MappingProxyType(specs)),
            ("_aliases", MappingProxyType(aliases)),
        ):
            object.__setattr__(self, slot, value)

    @classmethod
    def empty(cls) -> RegistryView:
        """The view before the first load: nothing published, generation -1 (below any store's)."""
        return cls(RegistrySnapshot(generation=-1, versions=(), aliases=()))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a RegistryView is immutable")

    def has(self, kind: Kind, name: str, version: str) -> bool:
        """Whether `name@version` of `kind` is published in this view."""
        return (kind, name, version) in self._versions

    def get(self, kind: Kind, name: str, version: str) -> Published:
        """One version, or NotFoundError."""
        try:
            return self._versions[(kind, name, version)]
        except KeyError:
            raise NotFoundError(f"no {kind} version {name}@{version}") from None

    def spec(self, kind: Kind, name: str, version: str, spec_type: type[S]) -> S:
        """The decoded spec of one version, as `spec_type`."""
        spec = self._specs.get((kind, name, version))
        if spec is None:
            raise NotFoundError(f"no {kind} version {name}@{version}")
        if not isinstance(spec, spec_type):
            raise InvalidError(f"{kind} {name}@{version} is not a {spec_type.__name__}")
        return spec

    def versions(self, kind: Kind, name: str) -> list[Published]:
        """The versions of one name, oldest first."""
        found = [p for (k, n, _), p in self._versions.items() if (k, n) == (kind, name)]
        return sorted(found, key=lambda p: (p.published_at, p.version))

    def has_alias(self, kind: Kind, name: str) -> bool:
        """Whether alias `name` of `kind` exists in this view."""
        return (kind, name) in self._aliases

    def alias(self, kind: Kind, name: str) -> Alias:
        """One alias, or NotFoundError."""
        try:
            return self._aliases[(kind, name)]
        except KeyError:
            raise NotFoundError(f"no {kind} alias {name!r}") from None

    def aliases(self, kind: Kind | None = None) -> list[Alias]:
        """The aliases (of one kind, or all), ordered by kind and name."""
        return [a for key, a in sorted(self._aliases.items()) if kind is None or a.kind == kind]

    def pick(self, kind: Kind, name_or_ref: str, key: str) -> Published:
        """The version `name_or_ref` means for pick key `key`: pinned as written, or by alias and canary."""
        if "@" in name_or_ref:
            return self.get(kind, *parse_ref(name_or_ref))
        name = check_name("name", name_or_ref)
        alias = self.alias(kind, name)
        return self.get(kind, name, canary_pick(key, alias.targets, salt=f"{kind}:{name}"))

    def resolve_model(self, name_or_ref: str, key: str) -> ResolvedModel:
        """A model version with its tokenizer and chat template, all from this view."""
        model = self.pick("model", name_or_ref, key)
        spec = self.spec("model", model.name, model.version, ModelSpec)
        tokenizer = self.get("tokenizer", *parse_ref(spec.tokenizer))
        template_name, template_version = parse_ref(spec.chat_template)
        return ResolvedModel(
            ref=model.ref,
            model=model,
            spec=spec,
            tokenizer=tokenizer,
            chat_template=self.get("chat_template", template_name, template_version),
            template=self.spec("chat_template", template_name, template_version, ChatTemplateSpec),
            generation=self.generation,
        )

    def resolve_guard(self, ref: str, key: str) -> ResolvedGuard:
        """A guard model version (pinned or by alias) with its model version, both picked with `key`."""
        guard = self.pick("guard_model", ref, key)
        spec = self.spec("guard_model", guard.name, guard.version, GuardModelSpec)
        model = self.resolve_model(spec.model, key) if spec.kind == "one_token" else None
        return ResolvedGuard(ref=guard.ref, guard=guard, spec=spec, model=model)

    def resolve_policy(self, alias_or_ref: str, key: str) -> ResolvedPolicy:
        """A policy version (a tenant's binding: an alias, or a pinned `name@version`) and its guards, all
        picked with `key` (the same key gives the same versions on every call of one view)."""
        policy = self.pick("policy", alias_or_ref, key)
        spec = self.spec("policy", policy.name, policy.version, PolicySpec)
        guards = tuple(self.resolve_guard(stage.guard, key) for stage in spec.stages if stage.kind == "model")
        return ResolvedPolicy(
            ref=policy.ref, policy=policy, spec=spec, guards=guards, generation=self.generation
        )

    def resolve_prompt(self, name_or_ref: str, key: str) -> ResolvedPrompt:
        """A system prompt version (a tenant's or key's binding: an alias, or a pinned `name@version`)."""
        prompt = self.pick("prompt", name_or_ref, key)
        spec = self.spec("prompt", prompt.name, prompt.version, PromptSpec)
        return ResolvedPrompt(ref=prompt.ref, text=spec.text)

    def resolve_embedding_model(self, name_or_ref: str, key: str) -> ResolvedEmbeddingModel:
        """An embedding model version (pinned, or by alias and canary with `key`)."""
        found = self.pick("embedding_model", name_or_ref, key)
        spec = self.spec("embedding_model", found.name, found.version, EmbeddingModelSpec)
        return ResolvedEmbeddingModel(ref=found.ref, spec=spec)

    def is_route(self, name_or_ref: str) -> bool:
        """Whether a model name a client sent names a route (its alias, or a pinned route version)."""
        name, _, version = name_or_ref.partition("@")
        return self.has("route", name, version) if version else self.has_alias("route", name)

    def resolve_route(self, name_or_ref: str, key: str) -> ResolvedRoute:
        """A route version (pinned, or by alias and canary with `key`)."""
        found = self.pick("route", name_or_ref, key)
        return ResolvedRoute(ref=found.ref, spec=self.spec("route", found.name, found.version, RouteSpec))

    def kv_bytes_per_token(self, model_ref: str) -> int:
        """KV cache bytes per token of a pinned model version `name@version`."""
        name, version = parse_ref(model_ref)
        return self.spec("model", name, version, ModelSpec).arch.kv_bytes_per_token()
