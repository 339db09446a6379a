"""The classifiers behind guard versions: built here, where the engines are, and injected into the gate.

A one-token guard runs on the engine pool its model version names (the served engine, `default`, for a
zero-shot judge; its own pool for a trained guard model). An embedding guard loads its encoder and head once,
in the background, and an n-gram guard its head; a request that needs one before it is loaded waits within
the stage's timeout. Whatever
keeps a guard from being built (no engine for its pool, another tokenizer, a missing artifact) becomes a
classifier that raises GuardError, so the policy's fail mode decides, and the reason is in the audit record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from engines.base import Scorer
from gateway.config import GuardConfig
from gateway.generation.prompts import PromptRenderer
from guard.backlog import Backlog
from guard.base import Classifier, GuardError, GuardInput, GuardScore, ItemSized
from guard.embedding import load_embedding_guard
from guard.ngram import load_ngram_guard
from guard.one_token import OneTokenClassifier
from registry.view import ResolvedGuard


class BrokenGuard:
    """A guard that could not be built: every call is a GuardError naming why."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    async def classify(self, item: GuardInput) -> GuardScore:
        """Always GuardError."""
        raise GuardError(f"guard {self.name} is unavailable: {self.reason}")


class LoadingGuard:
    """A guard loaded in the background once; calls wait for the load (within their stage's timeout)."""

    def __init__(self, name: str, load: Callable[[], Coroutine[Any, Any, Classifier]]) -> None:
        self.name = name
        self._task: asyncio.Task[Classifier] = asyncio.get_running_loop().create_task(load())

    async def ready(self) -> None:
        """Wait until loaded (raises what the load raised)."""
        await self._loaded()

    async def _loaded(self) -> Classifier:
        # Shielded: a request that times out waiting must not cancel the load for everyone else. A failed load
        # raises here on every call; the cascade's stage turns that into a guard error.
        return await asyncio.shield(self._task)

    async def classify(self, item: GuardInput) -> GuardScore:
        """The loaded guard's score."""
        return await (await self._loaded()).classify(item)

    def oversized(self, item: GuardInput) -> bool:
        """Whether the loaded guard finds `item` more than one call's work (`ItemSized`); False until it is
        loaded: a timeout while loading is the guard's own, and counts on its breaker."""
        task = self._task
        if not task.done() or task.cancelled() or task.exception() is not None:
            return False
        guard = task.result()
        return isinstance(guard, ItemSized) and guard.oversized(item)

    def cancel(self) -> None:
        """Stop a load still running (shutdown)."""
        self._task.cancel()


class GuardFactory:
    """Builds (once per guard version) the classifier of a resolved guard."""

    def __init__(
        self,
        *,
        pools: Mapping[str, Scorer],
        renderer: PromptRenderer,
        tokenizer_ref: str,
        artifacts: Path,
        config: GuardConfig,
        clock: Callable[[], float],
    ) -> None:
        self._pools = pools
        self._renderer = renderer
        self._tokenizer_ref = tokenizer_ref
        self._artifacts = artifacts
        self._config = config
        self._clock = clock
        self._built: dict[str, Classifier] = {}
        # One per engine pool, shared by the guards that run on it (`guard.backlog`).
        self.backlogs: dict[str, Backlog] = {}

    def __call__(self, guard: ResolvedGuard) -> Classifier:
        """The classifier of `guard`, built on first use."""
        built = self._built.get(guard.ref)
        if built is None:
            built = self.build(guard)
            self._built[guard.ref] = built
        return built

    def build(self, guard: ResolvedGuard) -> Classifier:
        """A new classifier of `guard`, not kept: for a version not published yet (`gateway.publish_check`),
        which must never be served from this factory's cache under its ref. The caller cancels it if it
        is a `LoadingGuard`."""
        spec = guard.spec
        executor = self._renderer.executor
        if spec.kind == "embedding":
            return LoadingGuard(
                guard.ref, lambda: load_embedding_guard(guard.ref, spec, self._artifacts, executor)
            )
        if spec.kind == "ngram":
            return LoadingGuard(
                guard.ref, lambda: load_ngram_guard(guard.ref, spec, self._artifacts, executor)
            )
        model = guard.model
        if model is None:
            return BrokenGuard(guard.ref, "a one-token guard without a model version")
        pool = model.spec.engine_pool
        engine = self._pools.get(pool)
        if engine is None:
            return BrokenGuard(guard.ref, f"no engine serves pool `{pool}` of model {model.ref}")
        if model.tokenizer.ref != self._tokenizer_ref:
            return BrokenGuard(
                guard.ref,
                f"its model uses tokenizer {model.tokenizer.ref}, this gateway loads {self._tokenizer_ref}",
            )
        backlog = self.backlogs.get(pool)
        if backlog is None:
            backlog = self.backlogs[pool] = Backlog(self._clock)
        try:
            return OneTokenClassifier(
                guard.ref,
                spec,
                engine,
                self._renderer.tokenizer,
                self._renderer.executor,
                min_label_mass=self._config.min_label_mass,
                model_ref=model.ref,
                priority=self._config.priority,
                backlog=backlog,
            )
        except ValueError as exc:
            return BrokenGuard(guard.ref, str(exc))

    async def ready(self, guards: tuple[ResolvedGuard, ...]) -> None:
        """Build `guards` and wait for those that load in the background (start-up)."""
        for guard in guards:
            built = self(guard)
            if isinstance(built, LoadingGuard):
                await built.ready()

    def close(self) -> None:
        """Stop loads still running."""
        for built in self._built.values():
            if isinstance(built, LoadingGuard):
                built.cancel()
