"""`MemoryLedger`: the capacity ledger of gateway processes that share one Python process (tests, and the
contract the Redis ledger is held to)."""

from __future__ import annotations

from routing.capacity.base import Capacity, granted


class _Lease:
    __slots__ = ("expires", "lease", "want")

    def __init__(self, lease: Capacity, want: Capacity, expires: float) -> None:
        self.lease, self.want, self.expires = lease, want, expires


class MemoryLedger:
    """Leases per replica in a dict (`routing.capacity.base`)."""

    def __init__(self) -> None:
        self._replicas: dict[str, dict[str, _Lease]] = {}

    async def renew(
        self,
        replica: str,
        holder: str,
        *,
        want: Capacity,
        used: Capacity,
        budget: Capacity,
        now: float,
        ttl: float,
    ) -> Capacity:
        leases = self._replicas.setdefault(replica, {})
        for name in [n for n, lease in leases.items() if lease.expires <= now]:
            del leases[name]
        others = [lease for name, lease in leases.items() if name != holder]
        grant = Capacity(
            granted(
                want.tokens,
                used.tokens,
                sum(o.lease.tokens for o in others),
                want.tokens + sum(o.want.tokens for o in others),
                budget.tokens,
            ),
            granted(
                want.sequences,
                used.sequences,
                sum(o.lease.sequences for o in others),
                want.sequences + sum(o.want.sequences for o in others),
                budget.sequences,
            ),
        )
        leases[holder] = _Lease(grant, want, now + ttl)
        return grant

    async def release(self, replica: str, holder: str) -> None:
        self._replicas.get(replica, {}).pop(holder, None)

    async def close(self) -> None:
        return None
