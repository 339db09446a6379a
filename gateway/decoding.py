"""Request bodies to typed requests, with errors that name the offending field.

msgspec reports the location of a problem ("Expected `int`, got `str` - at `$.messages[2].content`"); that
location becomes the OpenAI error's `param`.
"""

from __future__ import annotations

import re
from typing import Any, Generic, TypeVar

import msgspec
from litestar import Request
from litestar.exceptions import InternalServerException

from gateway.errors import ClientClosedError, InvalidRequestError

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
    """The whole body (over the size limit: 413), or ClientClosedError if the client left first."""
    try:
        return await request.body()
    except InternalServerException as exc:
        # Litestar's way of saying the client disconnected before the body was complete.
        if "disconnected" in str(exc.detail):
            raise ClientClosedError("the client disconnected before sending its whole request") from exc
        raise


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
