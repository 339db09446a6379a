"""Request bodies to typed requests, with errors that name the offending field.

msgspec reports the location of a problem ("Expected `int`, got `str` - at `$.messages[2].content`"); that
location becomes the OpenAI error's `param`.
"""

from __future__ import annotations

import re
from typing import Any, Generic, TypeVar

import msgspec
from litestar import Request
from litestar.exceptions import ClientException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge

from gateway.edge.adapter import body_limit
from gateway.errors import ClientClosedError, InvalidRequestError
from gateway.inbound import Inbound

T = TypeVar("T")

_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_FIELD = re.compile(r"(?:unknown|required) field `(?P<field>[^`]+)`")


def _param(message: str) -> tuple[str | None, str]:
    """Split a msgspec message into (field path, message without the location suffix)."""
    path = ""
    match = _AT.search(message)
    if match:
        path = match.group("path")
        message = message[: match.start()]
    field = _FIELD.search(message)
    if field:
        name = field.group("field")
        path = f"{path}.{name}" if path else name
    return (path or None), message


async def read_body(request: Request[Any, Any, Any]) -> bytes:
    """The whole body of a request to a Litestar route, within the route's limit (`read_limited`)."""
    return await read_limited(request, body_limit(request.route_handler))


async def read_limited(inbound: Inbound, limit: int | None) -> bytes:
    """The whole body, as Litestar's `Request.body()` reads it: over `limit` bytes (None: no limit), by its
    `content-length` or by what arrives, 413 (Litestar's `RequestEntityTooLarge`, rendered by the app's
    handlers); a `content-length` that is not a number, 400; ClientClosedError if the client left first."""
    announced = inbound.headers.get("content-length")
    if announced is not None and limit is not None:
        try:
            too_long = int(announced) > limit
        except ValueError:
            raise ClientException(f"Invalid content-length: {announced!r}") from None
        if too_long:
            raise RequestEntityTooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await inbound.receive()
        if message["type"] == "http.disconnect":
            raise ClientClosedError("the client disconnected before sending its whole request")
        if message["type"] == "http.request":
            if chunk := message.get("body", b""):
                size += len(chunk)
                if limit is not None and size > limit:
                    raise RequestEntityTooLarge
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Decoder(Generic[T]):
    """A reusable JSON decoder for one request type."""

    def __init__(self, type_: type[T]) -> None:
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(type_)

    def decode(self, body: bytes) -> T:
        """Decode `body` or raise `InvalidRequestError` naming the field."""
        if not body.strip():
            raise InvalidRequestError("the request body is empty; send a JSON object", code="invalid_json")
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            param, message = _param(str(exc))
            code = "unsupported_parameter" if "unknown field" in message else "invalid_value"
            if "unknown field" in message:
                message = f"{message}: this field is unknown or not supported by this gateway"
            raise InvalidRequestError(message, param=param, code=code) from exc
        except msgspec.DecodeError as exc:
            raise InvalidRequestError(
                f"the request body is not valid JSON: {exc}", code="invalid_json"
            ) from exc
