"""Sessions in Redis, shared by every gateway replica (a second replica, or a restarted one, continues them).

One hash per session and one per tenant::

    <prefix>s:<session id>   v       the record's version (each save sets the version it compared, plus one)
                             body    msgpack(SessionRecord)
                             tenant  the record's tenant
                             with PX = the save's `keep` (past it Redis forgets it: the id is unknown)

    <prefix>t:<tenant>       <session id> -> msgpack(IndexEntry), one field per live session (no `ended`),
                             with PX = the longest `keep` of a save into it (never shortened, so it outlives
                             every record it lists, and a tenant nobody uses any more is forgotten too)

`save` is one Lua script: it compares the stored version, writes the record, and updates the tenant's index,
so that two replicas saving one version at once get one True between them and the index never disagrees with
the last save. Redis forgets a record at its PX without touching the index: `index` (one Lua script too) drops
the fields whose record is gone before it answers. That script derives the record keys from the listed ids
(keys it did not declare), so the store needs one Redis server, not a Cluster. Its work is the tenant's live
sessions, which the per-tenant limits bound.

Every round trip is bounded by `op_timeout`; a Redis error or timeout is SessionStoreUnavailableError. So is a
record that does not decode (not written by this store, or by an incompatible version of it): the request
gets 503, never a session started afresh over it.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
import redis.asyncio

from gateway.redis_client import bounded_client, round_trip
from gateway.sessions.base import IndexEntry, SessionRecord, SessionStoreUnavailableError, Versioned

T = TypeVar("T")
PREFIX = "lockgate:session:"
# KEYS: the record, the tenant's index. ARGV: the expected version ("" for none: only if no record has the
# id), the new version, body, tenant, PX, "1" when live else "0", the session id, msgpack(IndexEntry).
# 1: saved; 0: the stored version is not the expected one (nothing written).
_SAVE = """
local stored = redis.call('HGET', KEYS[1], 'v')
if ARGV[1] == '' then
    if stored then return 0 end
elseif stored ~= ARGV[1] then
    return 0
end
local px = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'body', ARGV[3], 'tenant', ARGV[4])
redis.call('PEXPIRE', KEYS[1], px)
if ARGV[6] == '1' then
    redis.call('HSET', KEYS[2], ARGV[7], ARGV[8])
    local ttl = redis.call('PTTL', KEYS[2])
    if ttl < px then redis.call('PEXPIRE', KEYS[2], px) end
else
    redis.call('HDEL', KEYS[2], ARGV[7])
end
return 1
"""
# KEYS: the tenant's index. ARGV: the record keys' prefix. The live fields, flat: {id, entry, id, entry, ...}.
_INDEX = """
local live = {}
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
    if redis.call('EXISTS', ARGV[1] .. fields[i]) == 1 then
        live[#live + 1] = fields[i]
        live[#live + 1] = fields[i + 1]
    else
        redis.call('HDEL', KEYS[1], fields[i])
    end
end
return live
"""
_ENCODER = msgspec.msgpack.Encoder()
_RECORD = msgspec.msgpack.Decoder(SessionRecord)
_ENTRY = msgspec.msgpack.Decoder(IndexEntry)


def _px(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


class RedisSessionStore:
    """`SessionStore` in Redis. The store owns `client`: `aclose` closes it."""

    def __init__(self, client: redis.asyncio.Redis, *, op_timeout: float = 0.5, prefix: str = PREFIX) -> None:
        """Sessions under `prefix`; each Redis round trip bounded by `op_timeout`."""
        self._client = client
        self._save = client.register_script(_SAVE)
        self._index = client.register_script(_INDEX)
        self._op_timeout = op_timeout
        self._prefix = prefix

    @classmethod
    def from_url(cls, url: str, *, op_timeout: float = 0.5, prefix: str = PREFIX) -> RedisSessionStore:
        """A store with a client of its own on the Redis at `url` (connects on first use)."""
        # Resent once after a Redis restart (`bounded_client`): a save that did land answers the resend with
        # False (its version moved on), and the caller loads again and decides anew, as after any lost race;
        # load and index are safe to repeat.
        return cls(bounded_client(url, op_timeout), op_timeout=op_timeout, prefix=prefix)

    def _record_key(self, session_id: str) -> str:
        return f"{self._prefix}s:{session_id}"

    def _index_key(self, tenant: str) -> str:
        return f"{self._prefix}t:{tenant}"

    async def _call(self, step: Awaitable[T]) -> T:
        """One round trip, bounded by `op_timeout`; Redis failures become SessionStoreUnavailableError."""
        return await round_trip(step, self._op_timeout, SessionStoreUnavailableError, "the session store")

    async def load(self, session_id: str) -> Versioned | None:
        """See `SessionStore.load`."""
        found: list[Any] = await self._call(self._client.hmget(self._record_key(session_id), ["v", "body"]))
        version, body = found
        if version is None or body is None:
            return None
        try:
            return Versioned(_RECORD.decode(body), int(version))
        except (msgspec.DecodeError, ValueError) as exc:
            raise SessionStoreUnavailableError(
                f"the session store holds a record for {session_id!r} that does not decode: {exc}"
            ) from exc

    async def save(self, record: SessionRecord, version: int | None, keep: float) -> bool:
        """See `SessionStore.save`."""
        live = record.ended is None
        entry = _ENCODER.encode(IndexEntry(record.last_used, record.history_tokens)) if live else b""
        args: list[str | bytes | int] = [
            "" if version is None else str(version),
            str((version or 0) + 1),
            _ENCODER.encode(record),
            record.tenant,
            _px(keep),
            "1" if live else "0",
            record.id,
            entry,
        ]
        keys = [self._record_key(record.id), self._index_key(record.tenant)]
        saved: Any = await self._call(self._save(keys=keys, args=args))
        return bool(saved)

    async def index(self, tenant: str) -> dict[str, IndexEntry]:
        """See `SessionStore.index` (ids whose record Redis has forgotten are dropped from it first)."""
        flat: list[Any] = await self._call(
            self._index(keys=[self._index_key(tenant)], args=[self._record_key("")])
        )
        members: dict[str, IndexEntry] = {}
        for session_id, entry in zip(flat[::2], flat[1::2], strict=True):
            try:
                members[session_id.decode()] = _ENTRY.decode(entry)
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                raise SessionStoreUnavailableError(
                    f"the session store's index of {tenant!r} holds an entry that does not decode: {exc}"
                ) from exc
        return members

    async def aclose(self) -> None:
        """Close the client's connections (the sessions stay in Redis for the other replicas)."""
        await self._client.aclose()
