"""Engine capacity shared by gateway processes: a ledger of capacity leases per engine replica.

Every gateway process that dispatches to an engine replica holds a lease there: KV tokens and sequences it
may have in flight on the engine. A process admits requests against its own lease alone, in the event loop
and without a round trip (`Replica.fits`); it renews the lease from the shared ledger every
`routing.replicas.refresh_interval`, asking for what it holds in flight plus what waits in its queue. The
ledger keeps the leases of one replica within the engine's budget:

    grant_i = max(used_i, min(want_i, target_i, budget - sum of the other leases))

where `target_i` is `want_i` while the wants fit the budget together, else the budget's share in proportion
to the wants. A lease is never cut below what its holder has in flight (those requests cannot be recalled);
it shrinks as they end, so the sum of the leases never exceeds the budget: at a renewal of holder i, with
its old lease L_i >= used_i and the others' O, the new sum O + max(used_i, x) with x <= budget - O is at
most max(O + L_i, budget). A lease lapses `ttl` seconds after its last renewal (a gateway that died: its
requests ended with its connections). Between two renewals a process's in-flight work stays within its
lease, so the engine's never exceeds the budget, whatever the load reports say.
"""

from __future__ import annotations

from typing import Protocol

import msgspec


class Capacity(msgspec.Struct, frozen=True):
    """KV tokens and sequences (a budget, a want, a use or a lease)."""

    tokens: int
    sequences: int


NOTHING = Capacity(0, 0)


class LedgerUnavailableError(Exception):
    """The ledger could not be reached; the caller keeps its last lease until it lapses."""


class CapacityLedger(Protocol):
    """The shared record of capacity leases, one set per engine replica (module docstring)."""

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
        """Renew `holder`'s lease on `replica` for `ttl` seconds from `now`: the lease granted (never less
        than `used`). Raises LedgerUnavailableError."""
        ...

    async def release(self, replica: str, holder: str) -> None:
        """Give `holder`'s lease on `replica` back (a gateway that stops)."""
        ...

    async def close(self) -> None:
        """Release the ledger's connections."""
        ...


def granted(want: int, used: int, others_lease: int, wants: int, budget: int) -> int:
    """One dimension of the grant (module docstring): `wants` is the sum of every holder's want, this one's
    included."""
    target = want if wants <= budget else budget * want // max(wants, 1)
    return max(used, max(0, min(want, target, budget - others_lease)))
