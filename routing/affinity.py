"""What the router remembers to send related requests to the same replica: the prompt prefixes each replica
served recently (its prefix cache likely still holds them) and the replica each session was last sent to.

Prefix blocks. A prompt's leading tokens are cut into blocks of `block_size` (vLLM caches whole blocks) and
hashed in a chain: block i's hash covers block i and every block before it, seeded with the request's
`cache_salt` (tenants never share cached prefixes, so their prefixes must not attract each other). Two
prompts share their first k block hashes exactly when they share their first k blocks, so the longest hash
of a request that a replica remembers tells how many leading blocks it may have cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def prefix_block_hashes(
    token_ids: Sequence[int], *, block_size: int, depth: int, salt: str | None = None
) -> tuple[int, ...]:
    """Chained hashes of the first `depth` whole blocks of `block_size` tokens (a partial last block is
    not cached by the engine, so it is not hashed)."""
    hashes: list[int] = []
    previous = hash(("lockgate-prefix", salt))
    for start in range(0, min(len(token_ids) // block_size, depth) * block_size, block_size):
        previous = hash((previous, tuple(token_ids[start : start + block_size])))
        hashes.append(previous)
    return tuple(hashes)


class PrefixMemory:
    """A bounded LRU of the prefix block hashes one replica was sent recently."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` this replica was sent (the longest remembered chain)."""
        for count in range(len(hashes), 0, -1):
            if hashes[count - 1] in self._hashes:
                return count
        return 0

    def remember(self, hashes: Sequence[int]) -> None:
        """Record a request's block hashes as the most recently used."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        # Invariant: at most `size` hashes remembered.
        while len(self._hashes) > self._size:
            self._hashes.popitem(last=False)


class SessionMemory:
    """A bounded LRU of session key -> (replica id, last seen), each entry forgotten `ttl` seconds after
    its session's last request."""

    def __init__(self, size: int, ttl: float) -> None:
        self._size = size
        self._ttl = ttl
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session: str, now: float) -> str | None:
        """The replica id the session is bound to, unless unknown or expired."""
        entry = self._sessions.get(session)
        if entry is None:
            return None
        replica_id, seen = entry
        if now - seen > self._ttl:
            del self._sessions[session]
            return None
        return replica_id

    def bind(self, session: str, replica_id: str, now: float) -> None:
        """Bind (or rebind) a session to a replica as of `now`."""
        self._sessions[session] = (replica_id, now)
        self._sessions.move_to_end(session)
        # Invariant: at most `size` sessions remembered.
        while len(self._sessions) > self._size:
            self._sessions.popitem(last=False)
