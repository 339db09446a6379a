"""W3C trace context for one request: a trace id taken from a valid incoming `traceparent`, else a new one,
and the span id of the gateway's own root span.

`traceparent: 00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>`: a version of `ff`, an all-zero id
or anything malformed is ignored (W3C Trace Context, section 3.2), and the request starts a trace of its own.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from typing import Protocol

HEADER = b"traceparent"


class HasTraceIds(Protocol):
    """A request's trace id and the span id of its root span (a `RequestTimeline`)."""

    @property
    def trace_id(self) -> str: ...

    @property
    def span_id(self) -> str: ...


_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def new_trace_id() -> str:
    """A random, non-zero 128-bit trace id as 32 lowercase hex digits (ids need not be unguessable)."""
    return f"{random.getrandbits(128) or 1:032x}"


def new_span_id() -> str:
    """A random, non-zero 64-bit span id as 16 lowercase hex digits."""
    return f"{random.getrandbits(64) or 1:016x}"


def parse_traceparent(value: bytes) -> tuple[str, str] | None:
    """(trace id, parent span id) of a valid `traceparent` value, else None."""
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, parent_id = (match.group(i).decode() for i in (1, 2, 3))
    # Version 00 has exactly four fields; later versions may append more.
    if version == "ff" or (version == "00" and match.group(5)):
        return None
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    return trace_id, parent_id


def inbound_trace(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str, str]:
    """(trace id, parent span id) for a request with these ASGI headers: the client's when its
    `traceparent` is valid, else a new trace id and no parent ("")."""
    for name, value in headers:
        if name == HEADER:
            parsed = parse_traceparent(value)
            if parsed is not None:
                return parsed
            break
    return new_trace_id(), ""


def traceparent_of(timeline: HasTraceIds) -> str:
    """The W3C `traceparent` that makes a downstream call (a remote engine's request) a child of this
    request's root span."""
    return f"00-{timeline.trace_id}-{timeline.span_id}-01"
