"""`Registry`: validated changes through a `RegistryStore`, and the current `RegistryView` for requests.

Cross-replica bound: every replica runs `run_refresher()`, which polls the store's generation every
`refresh_interval` seconds and loads a new snapshot when it changed. A change committed on any replica is
therefore served by every other replica within `refresh_interval` plus one snapshot read (while the store
is reachable); the replica that made the change serves it at once. While the store is unreachable a
replica keeps serving its last view, whole and consistent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from registry.base import InvalidError, RegistryError, RegistryStore
from registry.hashing import canonical_json, content_hash
from registry.models import SPEC_TYPES, Alias, AliasTarget, Kind, Published, Spec, check_name, decode_spec
from registry.validation import check_spec, check_targets
from registry.view import RegistryView, ResolvedModel, ResolvedPolicy

log = logging.getLogger("lockgate.registry")


class Registry:
    """The registry service of one gateway replica."""

    def __init__(
        self,
        store: RegistryStore,
        clock: Callable[[], float],
        refresh_interval: float = 1.0,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Serve from `store`; `clock` stamps changes, `sleep` paces the refresher (both injectable)."""
        if not refresh_interval > 0:
            raise ValueError(f"refresh_interval must be positive, got {refresh_interval}")
        self.store = store
        self.refresh_interval = refresh_interval
        self._clock = clock
        self._sleep = sleep
        self._view = RegistryView.empty()
        # One reload at a time, so an older snapshot can never replace a newer one.
        self._reload = asyncio.Lock()

    @classmethod
    async def load(
        cls, store: RegistryStore, clock: Callable[[], float], refresh_interval: float = 1.0
    ) -> Registry:
        """A registry with its first view already loaded."""
        registry = cls(store, clock, refresh_interval)
        await registry.refresh()
        return registry

    @property
    def view(self) -> RegistryView:
        """The current view. Take it once per request and resolve everything from it."""
        return self._view

    async def refresh(self) -> bool:
        """Load a new view if the store's generation differs from the view's; whether one was loaded."""
        async with self._reload:
            if await self.store.generation() == self._view.generation:
                return False
            snapshot = await self.store.snapshot()
            # Built before the swap: a request holds either the old view or the new one, never a mix.
            self._view = RegistryView(snapshot)
            return True

    async def run_refresher(self) -> None:
        """Refresh every `refresh_interval` seconds until cancelled; failures keep the last view."""
        while True:
            await self._sleep(self.refresh_interval)
            try:
                await self.refresh()
            except RegistryError as exc:
                # Not fatal: the last view stays whole and consistent, and the next tick tries again.
                log.warning("registry refresh failed (serving generation %d): %s", self._view.generation, exc)

    async def publish(self, kind: Kind, name: str, version: str, spec: Spec, *, actor: str) -> Published:
        """Publish `spec` as `name@version` of `kind`, after checking it and the versions it refers to.

        Publishing identical content again returns the stored version; other content is a ConflictError.
        """
        check_name("name", name)
        check_name("version", version)
        expected = SPEC_TYPES[kind]
        if not isinstance(spec, expected):
            raise InvalidError(f"a {kind} version needs a {expected.__name__}, got {type(spec).__name__}")
        # Round trip through the decoder: it checks the declared bounds and turns ints into floats where a
        # float is declared, so `0` and `0.0` hash alike.
        try:
            normalized = decode_spec(kind, canonical_json(spec))
        except InvalidError as exc:
            raise InvalidError(f"{kind} {name}@{version}: {exc}") from exc
        spec_json = canonical_json(normalized)
        await self.refresh()
        check_spec(kind, f"{name}@{version}", normalized, self._view)
        published = await self.store.publish(
            kind, name, version, spec_json, content_hash(spec_json), actor=actor, now=self._clock()
        )
        await self.refresh()
        return published

    async def set_alias(
        self, kind: Kind, name: str, targets: str | Sequence[AliasTarget], *, actor: str
    ) -> Alias:
        """Point alias `name` of `kind` at one version (a string) or at canary targets."""
        check_name("alias", name)
        wanted = (AliasTarget(version=targets, weight=1.0),) if isinstance(targets, str) else tuple(targets)
        await self.refresh()
        check_targets(kind, name, wanted, self._view)
        alias = await self.store.set_alias(kind, name, wanted, actor=actor, now=self._clock())
        await self.refresh()
        return alias

    async def rollback(self, kind: Kind, name: str, *, actor: str) -> Alias:
        """Move an alias back to its previous targets in one call (repeat to go further back)."""
        alias = await self.store.rollback(kind, name, actor=actor, now=self._clock())
        await self.refresh()
        return alias

    def resolve_model(self, name_or_ref: str, request_id: str) -> ResolvedModel:
        """`self.view.resolve_model`: for one lookup; take `view` once when resolving several things."""
        return self._view.resolve_model(name_or_ref, request_id)

    def resolve_policy(self, alias_or_ref: str, request_id: str) -> ResolvedPolicy:
        """`self.view.resolve_policy`: for one lookup; take `view` once when resolving several things."""
        return self._view.resolve_policy(alias_or_ref, request_id)
