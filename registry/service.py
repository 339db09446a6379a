"""`Registry`: validated changes through a `RegistryStore`, and the current `RegistryView` for requests.

Cross-replica bound: every replica runs `run_refresher()`, which polls the store's generation every
`refresh_interval` seconds and loads a new snapshot when it changed. A change committed on any replica is
therefore served by every other replica within `refresh_interval` plus one snapshot read (while the store
is reachable); the replica that made the change serves it at once. While the store is unreachable a
replica keeps serving its last view, whole and consistent.

Store outages. Each refresh may take at most `refresh_timeout` seconds, then it counts as failed (a refresh
whose cancellation is still stuck on the server is never stacked with another). The refresher never dies of
an error: a store error or any unexpected exception is logged and counted, and the next tick tries again.
`health()` reports how old the view is (seconds since the last successful refresh, on the injected clock),
the failures in a row and the last error, and whether the refresher still runs; `/readyz` turns that into
"stale" once the age passes the operator's bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import msgspec

from registry.base import RegistryStore
from registry.errors import InvalidError, RegistryError
from registry.hashing import canonical_json, content_hash
from registry.models import (
    SPEC_TYPES,
    Alias,
    AliasTarget,
    Kind,
    ModelSpec,
    Published,
    Spec,
    check_name,
    decode_spec,
)
from registry.validation import check_spec, check_targets
from registry.view import RegistryView, ResolvedModel, ResolvedPolicy

log = logging.getLogger("lockgate.registry")

RefresherState = Literal["not_started", "running", "stopped"]
# Checks that a model version can be served (its files, tokenizer hash, chat template) before it is
# published or an alias points at it: (view, "name@version", spec); InvalidError names the problem.
ModelCheck = Callable[[RegistryView, str, ModelSpec], Awaitable[None]]


class RegistryHealth(msgspec.Struct, frozen=True, kw_only=True):
    """How current this replica's registry view is."""

    # The generation of the view being served.
    generation: int
    # Seconds since the last successful refresh (or since the registry was created, before any).
    age_s: float
    # Whether `age_s` is past the bound the caller gave.
    stale: bool
    # Refreshes that failed in a row since the last success, and the last one's error.
    consecutive_failures: int
    last_error: str | None
    # "stopped": the refresher ended (cancelled, or killed by something that is not an Exception).
    refresher: RefresherState

    @property
    def ready(self) -> bool:
        """Fresh enough to serve, and still refreshing."""
        return not self.stale and self.refresher != "stopped"


class Registry:
    """The registry service of one gateway replica."""

    def __init__(
        self,
        store: RegistryStore,
        clock: Callable[[], float],
        refresh_interval: float = 1.0,
        *,
        refresh_timeout: float = 5.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        model_check: ModelCheck | None = None,
    ) -> None:
        """Serve from `store`; `clock` stamps changes and ages the view, `sleep` paces the refresher (both
        injectable); `refresh_timeout` bounds each refresher tick in real seconds. `model_check` (settable
        later, as the app does once its renderers exist) refuses model versions that cannot be served."""
        if not refresh_interval > 0:
            raise ValueError(f"refresh_interval must be positive, got {refresh_interval}")
        if not refresh_timeout > 0:
            raise ValueError(f"refresh_timeout must be positive, got {refresh_timeout}")
        self.store = store
        self.refresh_interval = refresh_interval
        self.refresh_timeout = refresh_timeout
        self._clock = clock
        self._sleep = sleep
        self.model_check = model_check
        self._view = RegistryView.empty()
        # One reload at a time, so an older snapshot can never replace a newer one.
        self._reload = asyncio.Lock()
        self._last_success = clock()
        self._failures = 0
        self._last_error: str | None = None
        self._refresher: RefresherState = "not_started"
        # The refresher's refresh in flight: one that outlived its tick (its cancellation stuck on the server)
        # keeps the reload lock, and another behind it would only wait.
        self._pending: asyncio.Task[bool] | None = None

    @classmethod
    async def load(
        cls,
        store: RegistryStore,
        clock: Callable[[], float],
        refresh_interval: float = 1.0,
        *,
        refresh_timeout: float = 5.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        model_check: ModelCheck | None = None,
    ) -> Registry:
        """A registry with its first view already loaded."""
        registry = cls(
            store,
            clock,
            refresh_interval,
            refresh_timeout=refresh_timeout,
            sleep=sleep,
            model_check=model_check,
        )
        await registry.refresh()
        return registry

    @property
    def view(self) -> RegistryView:
        """The current view. Take it once per request and resolve everything from it."""
        return self._view

    async def refresh(self) -> bool:
        """Load a new view if the store's generation differs from the view's; whether one was loaded."""
        async with self._reload:
            started = self._clock()
            if await self.store.generation() == self._view.generation:
                self._succeeded(started)
                return False
            snapshot = await self.store.snapshot()
            # Built before the swap: a request holds either the old view or the new one, never a mix.
            self._view = RegistryView(snapshot)
            self._succeeded(started)
            return True

    def health(self, max_staleness: float) -> RegistryHealth:
        """How current the view is; stale once no refresh has succeeded for over `max_staleness` seconds."""
        age = max(0.0, self._clock() - self._last_success)
        return RegistryHealth(
            generation=self._view.generation,
            age_s=age,
            stale=age > max_staleness,
            consecutive_failures=self._failures,
            last_error=self._last_error,
            refresher=self._refresher,
        )

    async def run_refresher(self) -> None:
        """Refresh every `refresh_interval` seconds until cancelled; failures keep the last view."""
        self._refresher = "running"
        try:
            while True:
                await self._sleep(self.refresh_interval)
                await self._tick()
        finally:
            self._refresher = "stopped"
            if self._pending is not None:
                self._pending.cancel()

    async def _tick(self) -> None:
        """One refresh within `refresh_timeout`; raises only on cancellation (the refresher must not die)."""
        if self._pending is not None and not self._pending.done():
            self._failed(f"the previous refresh is still stuck after {self.refresh_timeout}s")
            return
        self._pending = task = asyncio.create_task(self.refresh())
        # Not asyncio.timeout: cancelling a query may itself wait on a paused server, and this tick must end.
        done, _ = await asyncio.wait({task}, timeout=self.refresh_timeout)
        if not done:
            task.cancel()
            self._failed(f"refresh took longer than {self.refresh_timeout}s")
            return
        try:
            task.result()
        except RegistryError as exc:
            # Not fatal: the last view stays whole and consistent, and the next tick tries again.
            self._failed(str(exc))
        except Exception as exc:
            # A bug, not an outage; still the refresher goes on (dying would silently freeze the view), and
            # the traceback is logged so that it gets fixed.
            log.exception(
                "registry refresh raised unexpectedly (serving generation %d)", self._view.generation
            )
            self._failed(repr(exc), logged=True)

    def _succeeded(self, started: float) -> None:
        if self._failures:
            log.warning("registry refresh works again after %d failures", self._failures)
        # When the refresh started: the view is at least that fresh.
        self._last_success = max(self._last_success, started)
        self._failures = 0
        self._last_error = None

    def _failed(self, error: str, *, logged: bool = False) -> None:
        self._failures += 1
        self._last_error = error
        # The 1st, 2nd, 4th, 8th... failure in a row: a long outage is visible without flooding the log.
        if not logged and self._failures & (self._failures - 1) == 0:
            log.warning(
                "registry refresh failed %d time(s) in a row (serving generation %d, %.0fs old): %s",
                self._failures,
                self._view.generation,
                self._clock() - self._last_success,
                error,
            )

    async def publish(self, kind: Kind, name: str, version: str, spec: Spec, *, actor: str) -> Published:
        """Publish `spec` as `name@version` of `kind`, after checking it and the versions it refers to (and,
        for a model, `model_check`).

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
        new = not self._view.has(kind, name, version)
        if new and self.model_check is not None and isinstance(normalized, ModelSpec):
            # Refused here, by the operator's change, never discovered later by a user's request. A version
            # already published is left to the store: identical content is a no-op, other content a conflict.
            await self.model_check(self._view, f"{name}@{version}", normalized)
        published = await self.store.publish(
            kind, name, version, spec_json, content_hash(spec_json), actor=actor, now=self._clock()
        )
        await self.refresh()
        return published

    async def set_alias(
        self, kind: Kind, name: str, targets: str | Sequence[AliasTarget], *, actor: str
    ) -> Alias:
        """Point alias `name` of `kind` at one version (a string) or at canary targets (each model version
        target passing `model_check`)."""
        check_name("alias", name)
        wanted = (AliasTarget(version=targets, weight=1.0),) if isinstance(targets, str) else tuple(targets)
        await self.refresh()
        check_targets(kind, name, wanted, self._view)
        if self.model_check is not None and kind == "model":
            view = self._view
            for target in wanted:
                ref = f"{name}@{target.version}"
                await self.model_check(view, ref, view.spec("model", name, target.version, ModelSpec))
        alias = await self.store.set_alias(kind, name, wanted, actor=actor, now=self._clock())
        await self.refresh()
        return alias

    async def rollback(self, kind: Kind, name: str, *, actor: str) -> Alias:
        """Move an alias back to its previous targets in one call (repeat to go further back)."""
        alias = await self.store.rollback(kind, name, actor=actor, now=self._clock())
        await self.refresh()
        return alias

    def resolve_model(self, name_or_ref: str, key: str) -> ResolvedModel:
        """`self.view.resolve_model`: for one lookup; take `view` once when resolving several things."""
        return self._view.resolve_model(name_or_ref, key)

    def resolve_policy(self, alias_or_ref: str, key: str) -> ResolvedPolicy:
        """`self.view.resolve_policy`: for one lookup; take `view` once when resolving several things."""
        return self._view.resolve_policy(alias_or_ref, key)
