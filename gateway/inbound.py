"""What the generation pipeline reads of an HTTP request: its ASGI scope, its receive channel and its headers.

Litestar's `Request` is an `Inbound` (the generation routes' Litestar handlers pass theirs). The fast path
(`gateway.edge.fastpath`) builds an `AsgiInbound` straight from the ASGI call instead: Litestar's connection
object, its case-insensitive header multidict and its body stream (an async generator) cost about 10 us
per request, more than the fast path uses of them.
"""

from __future__ import annotations

from typing import Protocol

from litestar.types import Receive, Scope


class HeaderLookup(Protocol):
    """Headers by lower-case name; a repeated header reads as its first value (as Litestar's do)."""

    def get(self, key: str, /) -> str | None:
        """The header's value, or None."""
        ...


class Inbound(Protocol):
    """An HTTP request as the generation pipeline reads it."""

    @property
    def scope(self) -> Scope:
        """The ASGI connection scope (its `state` holds the request's id and timeline)."""
        ...

    @property
    def receive(self) -> Receive:
        """The ASGI receive channel: the body, then the client's disconnect."""
        ...

    @property
    def headers(self) -> HeaderLookup:
        """The request headers."""
        ...


class AsgiInbound:
    """An `Inbound` over one ASGI call; headers decoded once, as Latin-1, names lower-cased."""

    __slots__ = ("headers", "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        # Reversed, so that the first of a repeated header is the one kept.
        self.headers: dict[str, str] = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in reversed(list(scope.get("headers", ())))
        }
