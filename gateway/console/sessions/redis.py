"""Console sessions in Redis, shared by every gateway process (`lockgate serve --workers N`).

A session holds the reviewer key's Authorization value, and API keys are never stored in readable form
anywhere persistent; so Redis holds only ciphertext that the session id (the cookie, which the server does
not keep) opens::

    <prefix><sha256 hex of sid>   nonce (12 random bytes) || AES-256-GCM(msgpack(Session)), PX = the session's
                                  remaining lifetime

    <prefix>owner:<sha256 hex of key id>   a list of the owner's session key names, oldest first, PX = a
                                  session's lifetime (refreshed by each sign-in)

`open` runs one Lua script: it drops the owner's names whose sessions are gone, ends the oldest ones while
the owner holds `per_key`, then stores the new session and appends its name. Only that owner's sessions are
ever ended: there is no global bound to evict for (Redis' memory is the operator's to size; each reviewer
key holds at most `per_key`). The script touches keys it did not declare (the listed names), so the store
needs one Redis server, not a Cluster (the config check says so).

The AES key is HKDF-SHA256 of the sid (a domain-separated derivation, independent of the key name), and the
key name is the additional authenticated data, so a value copied under another name does not open. A value
that fails to open (tampered, truncated, written by something else) is no session. `get` also checks
`expires_at` against the injected clock: Redis' expiry runs on the server's clock, the session's on ours.

Every round trip is bounded by `op_timeout`; a Redis error or timeout is SessionStoreUnavailableError.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Awaitable
from typing import TypeVar

import msgspec
import redis.asyncio
import redis.exceptions
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gateway.console.sessions.base import Session, SessionStoreUnavailableError, new_session
from gateway.redis_client import bounded_client, round_trip
from policy.clock import Clock

T = TypeVar("T")
PREFIX = "lockgate:console:session:"
NONCE_BYTES = 12
_TAG_BYTES = 16
# Domain separation: this derivation's output is an AES key for console sessions and nothing else.
_KDF_INFO = b"lockgate console session aes-256-gcm v1"
# KEYS: the new session's name, the owner's list. ARGV: sealed value, PX, per_key.
_OPEN = """
for _, name in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
    if redis.call('EXISTS', name) == 0 then redis.call('LREM', KEYS[2], 0, name) end
end
local cap = tonumber(ARGV[3])
while redis.call('LLEN', KEYS[2]) >= cap do
    redis.call('DEL', redis.call('LPOP', KEYS[2]))
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('RPUSH', KEYS[2], KEYS[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Session)


def key_name(sid: str, prefix: str = PREFIX) -> str:
    """The Redis key of the session with id `sid`: a hash of the id, never the id itself."""
    return prefix + hashlib.sha256(sid.encode()).hexdigest()


def owner_name(owner: str, prefix: str = PREFIX) -> str:
    """The Redis key of the list of `owner`'s session names."""
    return f"{prefix}owner:{hashlib.sha256(owner.encode()).hexdigest()}"


def _aead(sid: str) -> AESGCM:
    """The cipher whose 256-bit key is derived from the session id (the id is 32 random bytes)."""
    kdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_KDF_INFO)
    return AESGCM(kdf.derive(sid.encode()))


def seal(sid: str, name: str, session: Session) -> bytes:
    """The stored value of `session`: a random nonce, then the ciphertext bound to `name`."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + _aead(sid).encrypt(nonce, _ENCODER.encode(session), name.encode())


def unseal(sid: str, name: str, value: bytes) -> Session | None:
    """The session in a stored value, or None when it does not open with `sid` under `name`."""
    if len(value) < NONCE_BYTES + _TAG_BYTES:
        return None
    try:
        plain = _aead(sid).decrypt(value[:NONCE_BYTES], value[NONCE_BYTES:], name.encode())
        return _DECODER.decode(plain)
    except (InvalidTag, msgspec.DecodeError):
        return None


class RedisSessionStore:
    """`SessionStore` in Redis: sessions seen by every gateway process on the same Redis.

    The store owns `client`: `aclose` closes it."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        clock: Clock,
        *,
        ttl: float,
        per_key: int,
        op_timeout: float = 0.5,
        prefix: str = PREFIX,
    ) -> None:
        """Sessions that last `ttl` seconds of `clock`, at most `per_key` per owner; each Redis round trip
        bounded by `op_timeout`."""
        self._client = client
        self._per_key = per_key
        self._open = client.register_script(_OPEN)
        self._clock = clock
        self._ttl = ttl
        self._op_timeout = op_timeout
        self._prefix = prefix

    @classmethod
    def from_url(
        cls,
        url: str,
        clock: Clock,
        *,
        ttl: float,
        per_key: int,
        op_timeout: float = 0.5,
        prefix: str = PREFIX,
    ) -> RedisSessionStore:
        """A store with a client of its own on the Redis at `url` (connects on first use)."""
        # Every command here is idempotent: resent once after a Redis restart (`bounded_client`).
        client = bounded_client(url, op_timeout)
        return cls(client, clock, ttl=ttl, per_key=per_key, op_timeout=op_timeout, prefix=prefix)

    async def _call(self, step: Awaitable[T]) -> T:
        """One round trip, bounded by `op_timeout`; Redis failures become SessionStoreUnavailableError."""
        return await round_trip(
            step, self._op_timeout, SessionStoreUnavailableError, "the console session store"
        )

    async def open(self, authorization: str, owner: str) -> tuple[str, Session]:
        """A new session for `owner`'s key, ending its oldest beyond `per_key` (see `SessionStore.open`)."""
        sid, session = new_session(authorization, self._clock() + self._ttl)
        name = key_name(sid, self._prefix)
        px = max(1, math.ceil(self._ttl * 1000))
        keys = [name, owner_name(owner, self._prefix)]
        await self._call(self._open(keys=keys, args=[seal(sid, name, session), px, self._per_key]))
        return sid, session

    async def get(self, sid: str | None) -> Session | None:
        """The live session with this id, or None (unknown, expired, or a value that does not open)."""
        if not sid:
            return None
        name = key_name(sid, self._prefix)
        value = await self._call(self._client.get(name))
        if not isinstance(value, bytes):
            return None
        session = unseal(sid, name, value)
        if session is not None and session.expires_at <= self._clock():
            await self.close(sid)
            return None
        return session

    async def close(self, sid: str | None) -> None:
        """End the session (if any)."""
        if sid:
            await self._call(self._client.delete(key_name(sid, self._prefix)))

    async def aclose(self) -> None:
        """Close the client's connections (the sessions stay in Redis for the other processes)."""
        await self._client.aclose()
