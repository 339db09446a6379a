"""What decoding is constrained to (a required or named tool call, or the response format), in two steps.

Planning (`constraint_of`) reads the request and runs only what is linear in it: the schema size limits
(`structured.check_bounds`) and, for tool_choice "required", the combined schema. Compiling a schema
(`structured.prepare_schema`: the JSON Schema validator, the `oneOf` disjointness check, xgrammar) costs up
to about 2 s of CPU on the tokenizer threads every tenant shares, so the pipeline runs it (`compile_schema`,
from `planning.compile_pending`) only after the request's quota is reserved: a client pays for its schemas in
requests.
Nothing in the prompt depends on the compiled schema, so the token count that the reservation is made for
is exact before it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

import msgspec

from engines.base import OutputConstraint
from gateway.errors import InvalidRequestError
from gateway.generation.structured import SchemaError, check_bounds, prepare_schema, tool_call_schema
from gateway.generation.tools import ToolUse
from gateway.schemas import ChatCompletionRequest


class PendingSchema(msgspec.Struct, frozen=True, kw_only=True):
    """A client schema within the size limits, to compile after the quota is reserved."""

    schema: dict[str, Any]
    strict: bool
    # The request field it came from, named in any refusal.
    param: str


def schema_error(exc: SchemaError, param: str) -> InvalidRequestError:
    """The 400 for a schema refused at `param`."""
    return InvalidRequestError(f"{param}: {exc.message}", param=param, code="invalid_schema")


def checked(schema: dict[str, Any], strict: bool, param: str) -> PendingSchema:
    """`schema` as a pending constraint once within the size limits (linear); 400 naming `param` if not."""
    try:
        check_bounds(schema)
    except SchemaError as exc:
        raise schema_error(exc, param) from exc
    return PendingSchema(schema=schema, strict=strict, param=param)


def constraint_of(
    req: ChatCompletionRequest, use: ToolUse | None, max_tool_calls: int
) -> OutputConstraint | PendingSchema | None:
    """What decoding is constrained to: a schema still to compile, `json_object`, or nothing."""
    fmt = req.response_format
    wants_json = fmt is not None and fmt.type != "text"
    if use is not None and use.mode in ("required", "named"):
        if wants_json:
            raise InvalidRequestError(
                f"response_format {fmt.type if fmt else ''} cannot be combined with "
                f"tool_choice {use.mode!r}: "
                "both constrain the whole output",
                param="response_format",
                code="unsupported_value",
            )
        if use.mode == "named":
            index = next(i for i, t in enumerate(use.tools) if t.name == use.named)
            tool = use.tools[index]
            return checked(tool.parameters, tool.strict, f"tools[{index}].function.parameters")
        max_calls = max_tool_calls if use.parallel else 1
        try:
            schema = tool_call_schema([(t.name, t.parameters) for t in use.tools], max_calls=max_calls)
        except SchemaError as exc:
            raise schema_error(exc, "tools") from exc
        return checked(schema, all(t.strict for t in use.tools), "tools")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputConstraint(kind="json_object")
    given = fmt.json_schema
    if given is None or given.schema_ is None:
        raise InvalidRequestError(
            "response_format json_schema needs json_schema.schema",
            param="response_format.json_schema.schema",
        )
    return checked(given.schema_, bool(given.strict), "response_format.json_schema.schema")


async def compile_schema(pending: PendingSchema, executor: Executor) -> OutputConstraint:
    """The engine constraint of a pending schema; 400 naming the field if the schema is refused. CPU work: run
    in `executor`, off the event loop."""
    loop = asyncio.get_running_loop()
    try:
        text = await loop.run_in_executor(
            executor, lambda: prepare_schema(pending.schema, strict=pending.strict)
        )
    except SchemaError as exc:
        raise schema_error(exc, pending.param) from exc
    return OutputConstraint(kind="json_schema", schema=text)
