"""Chat messages as clients send them, reduced to the text each contributes to the prompt.

Clients that run tool loops send back what the SDK gave them (`message.model_dump()`): `content: null` beside
`tool_calls`, `refusal`, `annotations`, `audio: null`, `function_call: null`. All of that is accepted. What
the model cannot take is refused by name: image, audio and file parts (the model reads text only), assistant
audio, and the legacy `function_call` (send `tool_calls`).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.errors import InvalidRequestError
from gateway.schemas import ChatMessage, ContentPart

_NOT_TEXT = {"image_url": "an image", "input_audio": "audio", "file": "a file"}


def _part_text(part: ContentPart, role: str, where: str) -> str:
    if part.type in _NOT_TEXT:
        raise InvalidRequestError(
            f"{where} is {_NOT_TEXT[part.type]} (`{part.type}` part): this model accepts text only",
            param=f"{where}.type",
            code="unsupported_content",
        )
    if part.type == "text" and part.text is not None:
        return part.text
    if part.type == "refusal" and role == "assistant" and part.refusal is not None:
        return part.refusal
    raise InvalidRequestError(
        f"{where}: a `{part.type}` part is not valid in a {role} message (text parts need `text`)",
        param=f"{where}.type",
        code="invalid_value",
    )


def message_text(message: ChatMessage, index: int) -> str:
    """The text `message` contributes to the prompt; InvalidRequestError naming the field it cannot take."""
    where = f"messages[{index}]"
    if message.audio is not None:
        raise InvalidRequestError(
            f"{where}.audio: this model accepts text only", param=f"{where}.audio", code="unsupported_content"
        )
    if message.function_call is not None:
        raise InvalidRequestError(
            f"{where}.function_call (the legacy functions API) is not supported; send tool_calls",
            param=f"{where}.function_call",
            code="unsupported_parameter",
        )
    if message.role != "assistant" and message.tool_calls:
        raise InvalidRequestError(
            f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls"
        )
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidRequestError(
            f"{where}: a tool message needs the tool_call_id it answers", param=f"{where}.tool_call_id"
        )
    content = message.content
    if content is None:
        if message.role == "assistant" and (message.tool_calls or message.refusal is not None):
            return message.refusal or ""
        raise InvalidRequestError(f"{where}.content is required", param=f"{where}.content")
    if isinstance(content, str):
        return content
    return "".join(_part_text(part, message.role, f"{where}.content[{j}]") for j, part in enumerate(content))


def message_texts(messages: Sequence[ChatMessage]) -> list[str]:
    """The text of every message, in order."""
    if not messages:
        raise InvalidRequestError("messages must contain at least one message", param="messages")
    return [message_text(message, i) for i, message in enumerate(messages)]
