"""Limits on request fields, checked first: a request over them costs little more than its decoding.

Each check is linear in the request and runs before the prompt is rendered, a schema compiled or the quota
reserved. Strings that no OpenAI limit covers but that cost us per token or per request get one here:
stop strings (vLLM matches every one against the output's tail after each token), message `name` (rendered
into the prompt by templates that take it) and `user` (a session key kept for replica affinity). Client
JSON schemas get the size limits of `structured.check_bounds`, before anything reads them more than once.
"""

from __future__ import annotations

import re

from gateway.errors import InvalidRequestError
from gateway.generation.constraints import checked
from gateway.schemas import ChatCompletionRequest, CompletionRequest

MAX_STOP_CHARS = 256
MAX_USER_CHARS = 256
# OpenAI's pattern for a message's `name`.
MESSAGE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_request(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse, naming the field, a stop string, `user`, message name or schema over its limit."""
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    for stop in stops:
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"stop sequences are at most {MAX_STOP_CHARS} characters (one has {len(stop)})",
                param="stop",
                code="invalid_value",
            )
    if req.user is not None and len(req.user) > MAX_USER_CHARS:
        raise InvalidRequestError(
            f"user is at most {MAX_USER_CHARS} characters", param="user", code="invalid_value"
        )
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req)


def _check_chat(req: ChatCompletionRequest) -> None:
    for i, message in enumerate(req.messages):
        if message.name is not None and not MESSAGE_NAME.fullmatch(message.name):
            raise InvalidRequestError(
                f"messages[{i}].name must be 1-64 letters, digits, '_' or '-'",
                param=f"messages[{i}].name",
                code="invalid_value",
            )
    # Every tool's schema, whatever tool_choice (each is written into the prompt at least); the response
    # format's and the one tool_choice "required" builds are checked where they are made (`constraint_of`).
    for i, tool in enumerate(req.tools or []):
        if tool.function.parameters is not None:
            checked(tool.function.parameters, False, f"tools[{i}].function.parameters")
