"""The result cache as the generation pipeline uses it: look an answer up, replay it, keep a generated one.

An answer is kept as the engine's deltas (`CachedAnswer`), never as the response a client got: a hit goes
through the same output guard, formatter and settlement as a generated answer (`gateway.generation.pipeline`),
so what the client receives is checked by the tenant's policy as it is now (the check is recorded, with
`answer=cache` in its detail), shaped by its request (whole or streamed, usage or not), and charged as
configured (`hit_prompt_price` of its prompt tokens, and its output checks' guard tokens).

Only an answer the engine finished (`stop` or `length`) is kept: a stream its client left, an engine error or
an output guard block mid-stream (which closes the engine stream) leave nothing. The store is written after
the answer, by a task of the request's TaskSet, so no client waits for it. A store that fails is a miss, never
an error (`lockgate:result_cache_lookups_total{result="error"}`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

import msgspec

from engines.base import EngineDelta
from gateway.result_cache.base import ResultStore, ResultStoreUnavailableError

KEPT_FINISHES = ("stop", "length")


class CachedAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's deltas of one answer, as it generated them."""

    deltas: tuple[EngineDelta, ...]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(CachedAnswer)
Spawn = Callable[[Coroutine[Any, Any, None]], object]


class ResultCache:
    """Lookups, replays and keeping of answers over one `ResultStore` (built in the lifespan)."""

    def __init__(
        self, store: ResultStore, *, max_entry_bytes: int, hit_prompt_price: float, engine_build: str
    ) -> None:
        self.store = store
        self.max_entry_bytes = max_entry_bytes
        self.hit_prompt_price = hit_prompt_price
        # Engine kind, vLLM version and dtype (part of every key: they change the numbers).
        self.engine_build = engine_build
        # hit / miss / error lookups; kept / too_large answers; saved_tokens (prompt and completion tokens
        # of hits, which no engine computed): `lockgate:result_cache_*`.
        self.counts: Counter[str] = Counter()
        self.lookup_seconds = 0.0

    async def get(self, key: str) -> CachedAnswer | None:
        """The answer kept under `key`, or None (a miss; a store failure or an unreadable value counts as
        `error` and is a miss too)."""
        start = time.perf_counter()
        try:
            value = await self.store.get(key)
        except ResultStoreUnavailableError:
            self.counts["error"] += 1
            return None
        finally:
            self.lookup_seconds += time.perf_counter() - start
        if value is None:
            self.counts["miss"] += 1
            return None
        try:
            answer = _DECODER.decode(value)
        except msgspec.DecodeError:
            self.counts["error"] += 1
            return None
        self.counts["hit"] += 1
        usage = answer.deltas[-1].usage if answer.deltas else None
        if usage is not None:
            self.counts["saved_tokens"] += usage.prompt_tokens + usage.completion_tokens
        return answer

    def recorded(
        self, source: AsyncGenerator[EngineDelta, None], key: str, spawn: Spawn
    ) -> AsyncGenerator[EngineDelta, None]:
        """`source` as it is, its answer kept under `key` (by a task `spawn` starts) once the engine has
        finished it."""
        return self._recorded(source, key, spawn)

    async def _recorded(
        self, source: AsyncGenerator[EngineDelta, None], key: str, spawn: Spawn
    ) -> AsyncGenerator[EngineDelta, None]:
        deltas: list[EngineDelta] = []
        try:
            async for delta in source:
                deltas.append(delta)
                yield delta
        finally:
            await source.aclose()
        if deltas and deltas[-1].finish_reason in KEPT_FINISHES:
            spawn(self._keep(key, CachedAnswer(deltas=tuple(deltas))))

    async def _keep(self, key: str, answer: CachedAnswer) -> None:
        value = _ENCODER.encode(answer)
        if len(value) > self.max_entry_bytes:
            self.counts["too_large"] += 1
            return
        try:
            await self.store.put(key, value)
        except ResultStoreUnavailableError:
            self.counts["error"] += 1
            return
        self.counts["kept"] += 1


async def replayed(answer: CachedAnswer) -> AsyncGenerator[EngineDelta, None]:
    """The kept answer's deltas, as an engine stream."""
    for delta in answer.deltas:
        yield delta
