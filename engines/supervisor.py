"""`SupervisedEngine`: an `Engine` that notices when its engine dies and replaces it, without the gateway
restarting.

An engine dies when its engine core process exits (killed, out of memory, a crash): vLLM then fails every
open request with its EngineDeadError, which reaches our callers as `EngineDeadError`, and serves nothing
more. An engine that holds requests but runs no step for `stall_timeout` seconds (hung, or stopped with
SIGSTOP) counts as dead too. The supervisor learns of it from that error or from a periodic check of health
and progress, shuts the dead engine down (its open streams end with EngineDeadError), and starts a new one
from the factory, retrying with exponential backoff up to `max_restarts` times in a row. Meanwhile new
requests fail at once with `EngineDeadError` carrying a `retry_after` (how long the last start took), which
the gateway answers with 503 `engine_unavailable`. After the last failed attempt the supervisor gives up:
`alive` turns False, which `/healthz` reports so that a process supervisor restarts the whole gateway.

States::

    starting -> ready -> restarting -> ready
                            └──────-> failed (gave up; liveness fails)
    any -> stopped (shutdown)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Literal

import msgspec

from engines.base import Engine, EngineDeadError, EngineDelta, EngineLoad, EngineRequest, Health
from engines.memory import release_freed_memory

log = logging.getLogger("lockgate.engine")

State = Literal["starting", "ready", "restarting", "failed", "stopped"]


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the supervisor watches and restarts its engine."""

    # Seconds between health checks of a ready engine (a death is usually seen at once, from the error).
    health_interval: float = 2.0
    # Restart attempts in a row before giving up (then `/healthz` fails).
    max_restarts: int = 5
    # Seconds before the first restart attempt; doubled after each failure, capped at `backoff_max`.
    backoff: float = 1.0
    # Longest wait between two restart attempts, in seconds.
    backoff_max: float = 30.0
    # Seconds a dead engine may take to shut down before it is abandoned.
    shutdown_timeout: float = 30.0
    # Seconds an engine may hold requests without running a single step before it counts as dead (a hung
    # or stopped engine core): longer than any one step can take on the host.
    stall_timeout: float = 60.0


class SupervisedEngine:
    """Runs the engine `factory` builds and replaces it when it dies."""

    def __init__(
        self,
        factory: Callable[[], Engine],
        policy: RestartPolicy | None = None,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        release: Callable[[], None] = release_freed_memory,
    ) -> None:
        """`release`: run (in a thread) once a dead engine is shut down, before the next one starts, so that
        what the dead one held goes back to the OS (`engines.memory`)."""
        self._factory = factory
        self._release = release
        self._policy = policy or RestartPolicy()
        self._sleep = sleep
        self._clock = clock
        self._engine = factory()
        self.replica_id = self._engine.replica_id
        self.model_name = self._engine.model_name
        self.max_model_len = self._engine.max_model_len
        self.state: State = "starting"
        self._changed = asyncio.Event()
        self.restarts = 0
        # Health and progress checks made so far (tests wait on it instead of on the clock).
        self.checks = 0
        self.last_error = ""
        self._start_s = 30.0
        self._died = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None

    @property
    def engine(self) -> Engine:
        """The engine serving now (replaced by each restart)."""
        return self._engine

    @property
    def alive(self) -> bool:
        """False once the supervisor has given up: only a restart of the process can help then."""
        return self.state != "failed"

    @property
    def retry_after(self) -> float:
        """Seconds a client should wait before trying again while the engine restarts."""
        return max(1.0, self._start_s)

    async def start(self) -> None:
        """Start the first engine and the watcher."""
        await self._timed_start(self._engine)
        self._set_state("ready")
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def _set_state(self, state: State) -> None:
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, *states: State) -> None:
        """Return once the supervisor is in one of `states` (an event, not a poll)."""
        while self.state not in states:
            await self._changed.wait()

    async def _timed_start(self, engine: Engine) -> None:
        began = self._clock()
        await engine.start()
        self._start_s = self._clock() - began

    def _unavailable(self) -> EngineDeadError:
        detail = f": {self.last_error}" if self.last_error else ""
        return EngineDeadError(f"the engine is {self.state}{detail}", retry_after=self.retry_after)

    def _check_ready(self) -> Engine:
        if self.state != "ready":
            raise self._unavailable()
        return self._engine

    def _report_death(self, engine: Engine, exc: BaseException) -> None:
        # Only a death of the engine serving now counts: a late error from a replaced one is old news.
        if engine is self._engine and self.state == "ready":
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._died.set()

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        """The current engine's stream; a death ends it with EngineDeadError and starts a restart."""
        engine = self._check_ready()
        try:
            async for delta in engine.generate(req):
                if delta.finish_reason == "abort" and (engine is not self._engine or self.state != "ready"):
                    # Aborted by the shutdown of an engine found dead (stalled): a failure, not an end.
                    raise self._unavailable()
                yield delta
        except EngineDeadError as exc:
            self._report_death(engine, exc)
            raise EngineDeadError(str(exc), retry_after=self.retry_after) from exc

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        """The current engine's first-token logprobs of exactly `token_ids`; a death starts a restart."""
        engine = self._check_ready()
        try:
            return await engine.score_next_token(
                prompt_token_ids, token_ids, priority=priority, cache_salt=cache_salt
            )
        except EngineDeadError as exc:
            self._report_death(engine, exc)
            raise EngineDeadError(str(exc), retry_after=self.retry_after) from exc

    async def load(self) -> EngineLoad:
        """The current engine's load (idle and empty while it restarts)."""
        if self.state != "ready":
            return EngineLoad(running=0, waiting=0, kv_tokens_used=0, kv_tokens_capacity=0)
        return await self._engine.load()

    async def health(self) -> Health:
        """Ready only while the current engine is ready."""
        if self.state != "ready":
            return Health(ready=False, detail=str(self._unavailable()))
        return await self._engine.health()

    async def _watch(self) -> None:
        """Wait for a reported death, a failed health check or a stall, then restart; until given up or
        cancelled."""
        progress = (-1, self._clock())  # (engine steps, when that count was first seen)
        while self.state != "failed":
            try:
                async with asyncio.timeout(self._policy.health_interval):
                    await self._died.wait()
            except TimeoutError:
                problem, progress = await self._check(progress)
                if not problem:
                    continue
                self.last_error = problem
            await self._restart()
            progress = (-1, self._clock())

    async def _check(self, progress: tuple[int, float]) -> tuple[str, tuple[int, float]]:
        """What is wrong with the engine now ("" if nothing), and the progress mark to compare with next."""
        self.checks += 1
        health = await self._engine.health()
        if not health.ready:
            return health.detail, progress
        load = await self._engine.load()
        now = self._clock()
        steps, since = progress
        if load.steps != steps or not load.running + load.waiting:
            return "", (load.steps, now)
        if now - since < self._policy.stall_timeout:
            return "", progress
        # Work in hand and not one step for longer than any step takes: hung (or stopped, SIGSTOP).
        return (
            f"stalled: no engine step for {now - since:.0f} s with {load.running + load.waiting} requests",
            progress,
        )

    async def _restart(self) -> None:
        self._set_state("restarting")
        log.error("engine %s died (%s); restarting it", self.replica_id, self.last_error)
        await self._dispose(self._engine)
        await asyncio.to_thread(self._release)
        delay = self._policy.backoff
        for attempt in range(1, self._policy.max_restarts + 1):
            await self._sleep(delay)
            engine = self._factory()
            try:
                await self._timed_start(engine)
            # A start can fail in many ways (vLLM raises RuntimeError, OSError, its own errors); each one is
            # logged and counted, and the next attempt decides.
            except Exception as exc:
                self.last_error = f"restart {attempt} failed: {type(exc).__name__}: {exc}"
                log.error("engine %s: %s", self.replica_id, self.last_error)
                await self._dispose(engine)
                delay = min(delay * 2, self._policy.backoff_max)
                continue
            self._engine = engine
            self.restarts += 1
            self.last_error = ""
            self._died.clear()
            self._set_state("ready")
            log.warning("engine %s is serving again after restart %d", self.replica_id, self.restarts)
            return
        self._set_state("failed")
        log.critical("engine %s: gave up after %d restarts", self.replica_id, self._policy.max_restarts)

    async def _dispose(self, engine: Engine) -> None:
        try:
            async with asyncio.timeout(self._policy.shutdown_timeout):
                await engine.shutdown()
        # Shutting down a dead engine may fail in its own ways; the new engine must start regardless.
        except Exception as exc:
            log.warning("engine %s did not shut down cleanly: %r", self.replica_id, exc)

    async def shutdown(self) -> None:
        """Stop watching and shut the current engine down."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self.state != "failed":
            self._set_state("stopped")
        await self._engine.shutdown()
