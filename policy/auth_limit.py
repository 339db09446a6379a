"""`FailedAuthLimit`: a token bucket of failed authentications per source (the client's address), so that a
flood of made-up keys from one source cannot keep the tenant store busy.

Each failed authentication takes a token from its source's bucket (`burst` tokens, refilled at `per_second`),
and so does each store lookup, when it starts (given back if the key is good): concurrent lookups of one
source cannot outrun its bucket. A source whose bucket is empty is throttled: the authenticator serves it
only keys it has cached (no store lookup), and answers anything else 429 with the wait until its next token.
A legitimate key behind the same address (a NAT) therefore keeps working while it is cached, and every other
source is untouched.

A source is an IPv4 address, or an IPv6 /64 (what one subscriber is given, so an attacker cannot take a new
address for each try). Memory is bounded: at most `max_sources` buckets, the least recently used dropped
first (a dropped source starts again with a full bucket: churning that many sources already gives an
attacker that many buckets).
"""

from __future__ import annotations

import ipaddress

import msgspec

from policy.clock import Clock


class _Bucket(msgspec.Struct, gc=False):
    tokens: float
    at: float


def source_of(host: str | None) -> str:
    """The source an address counts against: an IPv4 address, an IPv6 /64, or the text itself ("" if none)."""
    if not host:
        return ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class FailedAuthLimit:
    """Failed authentications per source, as token buckets (module docstring)."""

    def __init__(self, clock: Clock, *, burst: float, per_second: float, max_sources: int = 100_000) -> None:
        """`burst` failures at once, then `per_second`; `burst` <= 0 turns the limit off."""
        self._clock = clock
        self._burst = float(burst)
        self._rate = float(per_second)
        self._max = max(1, max_sources)
        # Invariant: 0 <= tokens <= burst for every bucket, as of its `at`.
        self._buckets: dict[str, _Bucket] = {}

    @property
    def enabled(self) -> bool:
        """Whether failures are limited at all."""
        return self._burst > 0

    def _level(self, bucket: _Bucket, now: float) -> float:
        return min(self._burst, bucket.tokens + max(0.0, now - bucket.at) * self._rate)

    def retry_after(self, source: str) -> float | None:
        """Seconds until `source` may fail again, or None while it is not throttled."""
        if not self.enabled:
            return None
        bucket = self._buckets.get(source)
        if bucket is None:
            return None
        level = self._level(bucket, self._clock())
        if level >= 1.0:
            return None
        return (1.0 - level) / self._rate if self._rate > 0 else 86_400.0

    def take(self, source: str) -> bool:
        """Take a token from `source`'s bucket (a failure, or a store lookup that may turn out one); False,
        and nothing taken, when it has none."""
        if not self.enabled:
            return True
        now = self._clock()
        bucket = self._buckets.pop(source, None)
        level = self._burst if bucket is None else self._level(bucket, now)
        while len(self._buckets) >= self._max:
            del self._buckets[next(iter(self._buckets))]
        # The newest last: the least recently used is dropped first.
        taken = level >= 1.0
        self._buckets[source] = _Bucket(tokens=level - 1.0 if taken else level, at=now)
        return taken

    def failed(self, source: str) -> None:
        """One failed authentication of `source` (that cost no store lookup)."""
        self.take(source)

    def refund(self, source: str) -> None:
        """Give back the token a store lookup took: the key was good (or the store could not answer)."""
        bucket = self._buckets.get(source)
        if bucket is not None:
            now = self._clock()
            bucket.tokens = min(self._burst, self._level(bucket, now) + 1.0)
            bucket.at = now
