"""The `ResultStore` protocol: encoded answers by key, each kept for the store's TTL.

A store holds bytes (`cache.CachedAnswer`, msgpack-encoded by `gateway.result_cache.cache`), so that every
backend bounds what it keeps by the same measure. The key is already a digest of everything that decides the
answer (`keys.result_key`); a store never sees a request.

A store that cannot answer raises `ResultStoreUnavailableError`; the cache counts it and generates the
answer (a cache is never a reason to refuse a request).
"""

from __future__ import annotations

from typing import Protocol


class ResultStoreUnavailableError(Exception):
    """The result store cannot be reached in time."""


class ResultStore(Protocol):
    """Encoded answers by key."""

    async def get(self, key: str) -> bytes | None:
        """The value kept under `key`, or None (never kept, expired, or evicted)."""
        ...

    async def put(self, key: str, value: bytes) -> None:
        """Keep `value` under `key` for the store's TTL (replacing what was there)."""
        ...

    async def aclose(self) -> None:
        """Release the store's connections."""
        ...
