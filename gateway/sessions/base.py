"""The `SessionStore` protocol: sessions (`gateway.sessions.service`) kept where every gateway replica reads
them, so that a second replica, or a restarted one, continues a session.

A store keeps records by session id, each with a version that every save increments. Saves compare and set::

    load(id)                      -> Versioned(record, version) | None
    save(record, version, keep)   -> True: stored as version + 1 (version None: only if no record has the id)
                                  -> False: another save came first (the caller loads again and decides anew)

`keep` is how long the store must keep the record (past it the store may forget it: then the id is unknown,
404). Beside the records each store keeps an index per tenant of its live sessions (no `ended`): their last
use and history tokens, read by the per-tenant limits (`index`), updated by the same save.

Exceptions: `SessionStoreUnavailableError` (the store cannot answer in time: the request gets 503, never a
session started afresh).
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

from gateway.keeping import StoredAnswer
from gateway.schemas import ChatMessage

# Why a session ended (answered with 410 from then on).
EndReason = Literal["expired", "evicted_capacity", "deleted", "model_version_retired"]
# What a session does when its model version is no longer served (migrate only where its policy allows).
OnRetire = Literal["fail", "migrate"]


class Bound(msgspec.Struct, frozen=True, kw_only=True):
    """The versions a session was bound to at creation (`name@version` each; prompt None: none)."""

    model: str
    tokenizer: str
    chat_template: str
    policy: str
    prompt: str | None = None


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """One step's token counts (`cached_tokens`: prompt tokens the engine found in its prefix cache)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """One appended step: what the client sent, what the model answered, and the answer as sent."""

    step: int
    fingerprint: str
    messages: list[ChatMessage]
    reply: ChatMessage
    usage: Usage
    answer: StoredAnswer
    at: float


class Pending(msgspec.Struct, frozen=True, kw_only=True):
    """The step running now: only the holder of `token` completes or releases it; it lapses at `until`."""

    step: int
    fingerprint: str
    token: str
    until: float


class Migration(msgspec.Struct, frozen=True, kw_only=True):
    """A declared move to another model version, after the bound one stopped being served."""

    before: Bound
    after: Bound
    at: float
    at_step: int


class Ended(msgspec.Struct, frozen=True, kw_only=True):
    """Why and when a session ended."""

    reason: EndReason
    at: float


class SessionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A session as stored. Invariant: `steps[i].step == i + 1`; `history_tokens` is the last step's prompt
    plus completion tokens (what the next step's prompt repeats)."""

    id: str
    tenant: str
    key_id: str
    model: str  # as the client named it
    bound: Bound
    created_at: float
    expires_at: float  # absolute expiry
    idle_timeout: float  # seconds without a step after which it expires
    last_used: float
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    on_retire: OnRetire = "fail"
    steps: list[Step] = msgspec.field(default_factory=list)
    history_tokens: int = 0
    pending: Pending | None = None
    migrations: list[Migration] = msgspec.field(default_factory=list)
    ended: Ended | None = None


class Versioned(msgspec.Struct, frozen=True):
    """A record and the version its last save gave it."""

    record: SessionRecord
    version: int


class IndexEntry(msgspec.Struct, frozen=True):
    """A live session in its tenant's index."""

    last_used: float
    history_tokens: int


class SessionStoreUnavailableError(Exception):
    """The session store cannot be reached in time."""


class SessionStore(Protocol):
    """Session records by id, saved by compare and set, with a per-tenant index of the live ones."""

    async def load(self, session_id: str) -> Versioned | None:
        """The record with this id and its version (None: none, or forgotten)."""
        ...

    async def save(self, record: SessionRecord, version: int | None, keep: float) -> bool:
        """Store `record` if the stored version is `version` (None: if there is none), for at least `keep`
        seconds; update its tenant's index. False: the version moved on (nothing written)."""
        ...

    async def index(self, tenant: str) -> dict[str, IndexEntry]:
        """The tenant's live sessions by id (as of their last saves)."""
        ...

    async def aclose(self) -> None:
        """Release the store's connections."""
        ...
