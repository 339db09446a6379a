"""Decide whether a client's JSON schema can be enforced by the engine, and name what cannot.

The engine constrains decoding with vLLM's xgrammar backend (xgrammar 0.2.8). It compiles schemas with
`strict_mode=True`, `any_whitespace=False`, `separators=(",", ":")`; `prepare_schema` compiles the same way.
Refused, with the keyword and its JSON pointer (found by experiment with xgrammar's matcher, plus everything
vLLM's `has_xgrammar_unsupported_json_features` rejects, since the engine would reject it without a reason):

- ignored by xgrammar: `not`, `if`/`then`/`else`, `dependentSchemas`, `dependentRequired`, `dependencies`,
  `contentEncoding`, `contentMediaType`, `contentSchema`, `$dynamicRef`, `$recursiveRef`, `$ref` to anything
  but `#` or `#/...` (remote and anchor refs accept any value), assertions beside a `$ref` (xgrammar drops
  them), `uniqueItems`/`contains`/`minContains`/`maxContains`, `multipleOf` (ignored for numbers; vLLM refuses
  it for integers too), `format` outside `STRING_FORMATS`, `minLength`/`maxLength` beside `pattern`/`format`,
  `allOf` with two or more branches, and `oneOf` whose branches are not provably disjoint (xgrammar falls back
  to anyOf);
- string, number, array and object keywords (`pattern`, `minimum`, `minItems`, `minProperties`, ...) in a
  schema without a `type` naming that type: xgrammar only applies them to a declared type;
- vLLM's `propertyNames`/`patternProperties` combinations (with `properties`, with each other, ...).

Enforced as JSON Schema says: types, `enum`/`const`, `properties`/`required`, `additionalProperties`,
`unevaluatedProperties`/`unevaluatedItems`, `items`/`prefixItems`, `minItems`/`maxItems`,
`minProperties`/`maxProperties`, `minimum`/`maximum` and the exclusive forms, `minLength`/`maxLength`, a
single `pattern` (as a full match: `^a` accepts only `a`, a stricter subset), `anyOf`, local `$ref`s.

Defaults of xgrammar's strict mode, used whatever `strict` says: an object with `properties` and no
`additionalProperties` forbids other keys; a bare `{"type": "object"}` or `{"type": "array"}` accepts any
content (xgrammar 0.2.8 writes untyped content with ", " and ": " whatever the separators). Properties
are generated in the schema's order, so `prepare_schema` keeps key order rather than sorting keys (sorting
would reorder fields such as `reasoning` before `answer`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jsonschema
import msgspec
import xgrammar as xgr


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


MAX_SCHEMA_BYTES = 64 * 1024
# Limits `check_bounds` applies in one linear pass before anything costlier (see there).
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_NODES = 5_000
MAX_SCHEMA_BRANCHES = 128
MAX_SCHEMA_BRANCHES_TOTAL = 1_024
MAX_SCHEMA_PATTERN_CHARS = 1_000
MAX_SCHEMA_STRING_CHARS = 8_192
# vLLM's STRING_SUPPORTED_FORMATS: the formats xgrammar turns into a grammar.
STRING_FORMATS = frozenset(
    _words(
        "email date time date-time duration ipv4 ipv6 hostname uuid uri uri-reference uri-template "
        "json-pointer relative-json-pointer"
    )
)
_IGNORED = _words(
    "not if then else dependentSchemas dependentRequired dependencies contentEncoding contentMediaType "
    "contentSchema $dynamicRef $recursiveRef uniqueItems contains minContains maxContains multipleOf"
)
_TYPED_KEYWORDS = {
    "string": ("pattern", "format", "minLength", "maxLength"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "array": ("minItems", "maxItems"),
    "object": ("minProperties", "maxProperties", "patternProperties", "propertyNames"),
}
# Keywords that may sit beside a `$ref` because they assert nothing.
_ANNOTATIONS = frozenset(
    _words(
        "$ref $defs definitions $schema $id $comment $anchor title description default examples deprecated "
        "readOnly writeOnly discriminator"
    )
)
_SINGLE = _words(
    "additionalProperties items not if then else contains propertyNames unevaluatedProperties "
    "unevaluatedItems additionalItems contentSchema"
)
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_XGR_LOG_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


class SchemaError(Exception):
    """A schema the gateway refuses: `message` says what is wrong, `pointer` where (a JSON pointer)."""

    def __init__(self, message: str, pointer: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.pointer = pointer


def prepare_schema(schema: object, *, strict: bool) -> str:
    """Validate `schema` and return the compact JSON text to send to the engine.

    `strict=True` is OpenAI's strict mode: every object schema without `additionalProperties` (or
    `unevaluatedProperties`) and without `anyOf`/`oneOf`/`allOf`/`$ref` gets `"additionalProperties": false`.
    Raises `SchemaError` for a non-object, an invalid JSON Schema, one over the size or depth limits, a
    keyword xgrammar does not enforce (named with its pointer), or a compile error. CPU-bound: run it in an
    executor.
    """
    if not isinstance(schema, dict):
        raise SchemaError("the JSON schema must be a JSON object")
    check_bounds(schema)
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"the JSON schema is not JSON: {exc}") from exc
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise SchemaError(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = _pointer(exc.path)
        raise SchemaError(f"invalid JSON schema at '{where}': {exc.message}", where) from exc
    # Each schema object is read once for `oneOf`, however many branches `$ref` it.
    seen = _Seen()
    for pointer, node in _subschemas(schema, ""):
        _check(node, pointer, schema, seen)
    if strict:
        schema = copy.deepcopy(schema)
        for _, node in _subschemas(schema, ""):
            if _is_plain_object(node):
                node["additionalProperties"] = False
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    try:
        xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=(",", ":"), strict_mode=True)
    except (RuntimeError, ValueError) as exc:
        reason = _XGR_LOG_PREFIX.sub("", str(exc).strip())
        raise SchemaError(f"the JSON schema cannot be compiled to a grammar: {reason}") from exc
    return text


def check_bounds(schema: object) -> None:
    """Refuse a schema over the size limits, reading at most `MAX_SCHEMA_NODES` of its values.

    Time linear in that: run it before anything whose cost grows faster with the schema (the validator, the
    `oneOf` disjointness check, the grammar compiler), and before the quota is reserved. The limits: at most
    `MAX_SCHEMA_NODES` JSON values (objects, arrays and scalars alike), containers nested less than
    `MAX_SCHEMA_DEPTH` deep, at most `MAX_SCHEMA_BRANCHES` branches in one `anyOf`/`oneOf` and
    `MAX_SCHEMA_BRANCHES_TOTAL` in all, regular expressions (`pattern`, `patternProperties` keys) of at most
    `MAX_SCHEMA_PATTERN_CHARS` characters and other strings (keys too) of at most `MAX_SCHEMA_STRING_CHARS`.
    Raises `SchemaError` naming the limit and where it was passed.
    """
    if not isinstance(schema, dict):
        raise SchemaError("the JSON schema must be a JSON object")
    # Paths are linked (parent, key) pairs, so that only a refusal pays for spelling its pointer.
    stack: list[tuple[object, int, _Path]] = [(schema, 0, None)]
    nodes = 1
    branches = 0
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_string(value, path, pattern=path is not None and path[1] == "pattern")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_SCHEMA_DEPTH:
            raise SchemaError(
                f"the JSON schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels "
                f"(at '{_spell(path)}')",
                _spell(path),
            )
        # Counted before the children are read: a huge object or array costs no more than the limit.
        nodes += len(value)
        if nodes > MAX_SCHEMA_NODES:
            raise SchemaError(
                f"the JSON schema has more than {MAX_SCHEMA_NODES} values (objects, arrays, strings, "
                "numbers, ...)"
            )
        if isinstance(value, list):
            stack.extend((item, depth + 1, (path, i)) for i, item in enumerate(value))
            continue
        patterns = path is not None and path[1] == "patternProperties"
        for key, item in value.items():
            _check_string(str(key), (path, key), pattern=patterns, key=True)
            if key in ("anyOf", "oneOf") and isinstance(item, list):
                branches += len(item)
                if len(item) > MAX_SCHEMA_BRANCHES or branches > MAX_SCHEMA_BRANCHES_TOTAL:
                    where = _spell((path, key))
                    raise SchemaError(
                        f"'{key}' at '{where}' has {len(item)} branches; at most {MAX_SCHEMA_BRANCHES} "
                        f"in one '{key}' and {MAX_SCHEMA_BRANCHES_TOTAL} in all anyOf/oneOf of a schema "
                        "are allowed",
                        where,
                    )
            stack.append((item, depth + 1, (path, key)))


# A JSON pointer as a linked list: None is the root, (parent, key) one step below the parent.
_Path = tuple[Any, object] | None


def _spell(path: _Path) -> str:
    parts: list[object] = []
    while path is not None:
        path, key = path
        parts.append(key)
    return _pointer(parts[::-1])


def _check_string(text: str, path: _Path, *, pattern: bool, key: bool = False) -> None:
    limit = MAX_SCHEMA_PATTERN_CHARS if pattern else MAX_SCHEMA_STRING_CHARS
    if len(text) > limit:
        what = "regular expression" if pattern else "key" if key else "string"
        where = _spell(path)
        raise SchemaError(
            f"the {what} at '{where}' has {len(text)} characters; at most {limit} are allowed", where
        )


def tool_call_schema(
    tools: Sequence[tuple[str, Mapping[str, Any] | None]], *, max_calls: int
) -> dict[str, Any]:
    """The schema for tool_choice "required", in vLLM's `get_json_schema_from_tools` shape.

    An array (`minItems` 1, `maxItems` `max_calls`: 1 when parallel calls are off; a bound otherwise, since a
    small model may repeat calls until max_tokens) of `{"name", "parameters"}` objects, one `anyOf`
    branch per `(name, parameters)` tool; missing or empty parameters become `{"type": "object",
    "properties": {}}`. Each tool's `$defs` move to the top level, as vLLM does; two tools defining one name
    differently raise `SchemaError`. The inputs are not modified.
    """
    if not tools:
        raise SchemaError('tool_choice "required" needs at least one tool')
    branches: list[dict[str, Any]] = []
    all_defs: dict[str, Any] = {}
    for name, params in tools:
        body = {k: v for k, v in params.items() if k != "$defs"} if params else {}
        defs = (params or {}).get("$defs", {})
        if not isinstance(defs, Mapping):
            raise SchemaError(f"'$defs' in the parameters of tool '{name}' must be an object", "/$defs")
        for def_name, def_schema in defs.items():
            if all_defs.setdefault(def_name, def_schema) != def_schema:
                where = f"/$defs/{_escape(def_name)}"
                raise SchemaError(f"tool definition '{def_name}' has multiple schemas", where)
        branches.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": body or {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            }
        )
    result: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "maxItems": max_calls,
        "items": {"type": "object", "anyOf": branches},
    }
    if all_defs:
        result["$defs"] = all_defs
    return result


def _check(node: dict[str, Any], at: str, root: dict[str, Any], seen: _Seen) -> None:
    types = _types(node)

    def refuse(keyword: str, why: str) -> SchemaError:
        where = f"{at}/{_escape(keyword)}"
        return SchemaError(f"'{keyword}' at '{where}' is not supported: {why}", where)

    for keyword in _IGNORED:
        if keyword in node:
            raise refuse(keyword, "the grammar backend does not enforce it")
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref != "#" and not ref.startswith("#/"):
            raise refuse("$ref", "only local references ('#' or '#/...') are resolved")
        for keyword in node:
            if keyword not in _ANNOTATIONS:
                raise refuse(
                    keyword, "keywords beside '$ref' are ignored; move them into the referenced schema"
                )
    stringy = not types or "string" in types
    if stringy and "format" in node and node["format"] not in STRING_FORMATS:
        raise refuse("format", f"supported formats are {', '.join(sorted(STRING_FORMATS))}")
    if stringy and ({"pattern", "format"} & node.keys()) and ({"minLength", "maxLength"} & node.keys()):
        length = "minLength" if "minLength" in node else "maxLength"
        raise refuse(length, "length limits are ignored beside 'pattern' or 'format'")
    if not types and not ({"enum", "const"} & node.keys()):
        for kind, keywords in _TYPED_KEYWORDS.items():
            for keyword in keywords:
                if keyword in node:
                    raise refuse(keyword, f'it is only enforced with an explicit "type" of {kind}')
    if "propertyNames" in node:
        names = node["propertyNames"]
        clash = [k for k in ("properties", "patternProperties") if k in node]
        if clash or node.get("unevaluatedProperties", True) is not True:
            raise refuse(
                "propertyNames", f"not combined with {clash[0] if clash else 'unevaluatedProperties'}"
            )
        if (
            isinstance(names, dict)
            and ({"pattern", "format"} & names.keys())
            and ({"minLength", "maxLength"} & names.keys())
        ):
            raise refuse("propertyNames", "length limits beside a pattern are not supported")
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and ("properties" in node or len(patterns) > 1):
        raise refuse("patternProperties", "only one pattern, and not combined with 'properties'")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise refuse("allOf", "only a single-branch allOf is enforced")
    branches = node.get("oneOf")
    if isinstance(branches, list):
        # Each branch is read once; the pairs (at most MAX_SCHEMA_BRANCHES, so about 8,000) compare sets.
        marks = [_Marks.of(branch, root, seen) for branch in branches]
        for i, a in enumerate(marks):
            for j in range(i + 1, len(marks)):
                if not a.disjoint(marks[j]):
                    raise refuse("oneOf", f"branches {i} and {j} may overlap and would be enforced as anyOf")


class _Seen:
    """What one schema's `oneOf` checks have read, by schema object: `$ref`s make many branches or keys
    point at one object, which is read once however often it is referenced."""

    def __init__(self) -> None:
        self.marks: dict[int, _Marks] = {}
        self._values: dict[int, frozenset[str] | None] = {}

    def values_of(self, node: dict[str, Any]) -> frozenset[str] | None:
        """`_values(node)`, computed once per object."""
        if id(node) not in self._values:
            self._values[id(node)] = _values(node)
        return self._values[id(node)]


class _Marks(msgspec.Struct, frozen=True):
    """What tells a `oneOf` branch apart: its types, its const/enum values, its required keys' values."""

    types: frozenset[str]
    values: frozenset[str] | None
    keyed: dict[str, frozenset[str]]

    @classmethod
    def of(cls, branch: object, root: dict[str, Any], seen: _Seen) -> _Marks:
        """The marks of `branch` (`$ref`s followed), from `seen` if its schema object was read before."""
        node = _resolve(branch, root)
        known = seen.marks.get(id(node))
        if known is None:
            known = seen.marks[id(node)] = cls._read(node, root, seen)
        return known

    @classmethod
    def _read(cls, node: dict[str, Any], root: dict[str, Any], seen: _Seen) -> _Marks:
        types = frozenset("number" if t == "integer" else t for t in _types(node))
        required = node.get("required", [])
        properties = node.get("properties", {})
        keyed: dict[str, frozenset[str]] = {}
        if isinstance(required, list) and isinstance(properties, dict):
            for key in required:
                if isinstance(key, str) and key in properties:
                    values = seen.values_of(_resolve(properties[key], root))
                    if values is not None:
                        keyed[key] = values
        return cls(types, _values(node), keyed)

    def disjoint(self, other: _Marks) -> bool:
        """Whether no value matches both branches, judged from types, const/enum, or a required const key."""
        if self.types and other.types and not self.types & other.types:
            return True
        if self.values is not None and other.values is not None and not self.values & other.values:
            return True
        # Over the smaller of the two: a pair costs at most the fewer required const keys.
        few, many = (
            (self.keyed, other.keyed) if len(self.keyed) <= len(other.keyed) else (other.keyed, self.keyed)
        )
        return any(not values & many[key] for key, values in few.items() if key in many)


def _resolve(node: object, root: dict[str, Any]) -> dict[str, Any]:
    for _ in range(MAX_SCHEMA_DEPTH):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            break
        node = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def _values(node: dict[str, Any]) -> frozenset[str] | None:
    if "const" in node:
        return frozenset((json.dumps(node["const"], sort_keys=True),))
    if isinstance(node.get("enum"), list):
        return frozenset(json.dumps(v, sort_keys=True) for v in node["enum"])
    return None


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, list):
        return {t for t in kind if isinstance(t, str)}
    return {kind} if isinstance(kind, str) else set()


def _is_plain_object(node: dict[str, Any]) -> bool:
    if {"additionalProperties", "unevaluatedProperties", "anyOf", "oneOf", "allOf", "$ref"} & node.keys():
        return False
    return "object" in _types(node) or "properties" in node


def _subschemas(node: object, at: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in `node` (itself first) with its JSON pointer, in document order."""
    if not isinstance(node, dict):
        return
    yield at, node
    for key in _SINGLE:
        if isinstance(node.get(key), dict):
            yield from _subschemas(node[key], f"{at}/{_escape(key)}")
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _subschemas(sub, f"{at}/{_escape(key)}/{_escape(name)}")
    for key in _LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _subschemas(sub, f"{at}/{key}/{i}")


def _escape(part: object) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def _pointer(path: Iterator[object] | Sequence[object]) -> str:
    return "".join(f"/{_escape(p)}" for p in path)
