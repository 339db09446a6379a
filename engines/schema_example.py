"""An example instance of a JSON schema: what the simulator emits under a `json_schema` constraint.

It covers the subset that tool parameters and structured outputs use in practice: the types, `properties`
with `required`, `items`/`prefixItems` with `minItems`/`maxItems`, `enum`, `const`, `anyOf`/`oneOf` (first
branch), `allOf`, `$ref` into `#/$defs` or `#/definitions` (or `#`), numeric bounds and `multipleOf`, string
lengths and a few `format`s. Keywords it does not know (`pattern`, `uniqueItems`, `not`, ...) are ignored,
so such a schema may get an instance that does not validate; an empty schema gets `null`.

Choices (which optional properties, how many items, which value in a range) come from the `random.Random`
passed in, so one seed gives one instance.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

Schema = Mapping[str, Any]

# Past this depth of nesting, only what the schema requires is generated, so recursive schemas end.
_MAX_DEPTH = 6
_WORDS = ("alpha", "bravo", "city", "delta", "echo", "field", "green", "house", "island", "juliet", "kilo")
_FORMATS = {
    "date-time": "2024-01-02T03:04:05Z",
    "date": "2024-01-02",
    "time": "03:04:05Z",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "uuid": "123e4567-e89b-12d3-a456-426614174000",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "hostname": "example.com",
}


class SchemaError(ValueError):
    """The schema cannot be followed: a `$ref` that does not resolve, or a schema that is not an object."""


def example_instance(schema: Schema | bool, rng: random.Random | None = None) -> Any:
    """A JSON value (dicts, lists, str, int, float, bool, None) valid against `schema`.

    `rng` decides the free choices; without one they are the simplest (first enum value, lowest bound,
    required properties only, fewest items).
    """
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, Mapping):
        raise SchemaError(f"a schema must be an object, got {type(schema).__name__}")
    return _Generator(schema, rng).value(schema, 0)


class _Generator:
    def __init__(self, root: Schema, rng: random.Random | None) -> None:
        self.root = root
        self.rng = rng

    def value(self, schema: Schema | bool, depth: int) -> Any:
        if isinstance(schema, bool) or not isinstance(schema, Mapping):
            return None
        schema = self.resolve(schema, depth)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.pick(schema["enum"])
        kind = _type_of(schema)
        if kind == "object":
            return self.object(schema, depth)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "string":
            return self.string(schema)
        if kind == "integer":
            return self.integer(schema)
        if kind == "number":
            return self.number(schema)
        if kind == "boolean":
            return self.pick([True, False])
        return None

    def resolve(self, schema: Schema, depth: int) -> Schema:
        """`schema` with its `$ref`, `allOf` and first `anyOf`/`oneOf` branch merged in."""
        followed = False  # a $ref followed here: choosing it again could go round a cycle forever
        for _ in range(64):
            if "$ref" in schema:
                followed = True
                rest = {k: v for k, v in schema.items() if k != "$ref"}
                schema = _merge(self.lookup(schema["$ref"]), rest)
            elif isinstance(schema.get("allOf"), list):
                merged: Schema = {k: v for k, v in schema.items() if k != "allOf"}
                for part in schema["allOf"]:
                    if isinstance(part, Mapping):
                        merged = _merge(merged, part)
                schema = merged
            elif key := next((k for k in ("anyOf", "oneOf") if isinstance(schema.get(k), list)), None):
                branches = [b for b in schema[key] if isinstance(b, Mapping)]
                rest = {k: v for k, v in schema.items() if k != key}
                if not branches:
                    schema = rest
                    continue
                # Deep down or in a $ref cycle, prefer a branch that does not recurse, so recursion ends.
                plain = [b for b in branches if "$ref" not in b] if followed or depth > _MAX_DEPTH else []
                schema = _merge(rest, (plain or branches)[0])
            else:
                return schema
        raise SchemaError("the schema's $ref/allOf/anyOf nesting does not end")

    def lookup(self, ref: object) -> Schema:
        if ref == "#":
            return self.root
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise SchemaError(f"only local $refs are supported, got {ref!r}")
        node: Any = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                raise SchemaError(f"$ref {ref!r} does not resolve")
            node = node[part]
        if not isinstance(node, Mapping):
            raise SchemaError(f"$ref {ref!r} is not a schema object")
        return node

    def pick(self, options: list[Any]) -> Any:
        return options[0] if self.rng is None else self.rng.choice(options)

    def between(self, lo: int, hi: int) -> int:
        return lo if self.rng is None or hi <= lo else self.rng.randint(lo, hi)

    def object(self, schema: Schema, depth: int) -> dict[str, Any]:
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        names = schema.get("required")
        required = [r for r in names if isinstance(r, str)] if isinstance(names, list) else []
        extra = schema.get("additionalProperties")
        out: dict[str, Any] = {}
        for name, sub in props.items():
            optional = name not in required
            if optional and (self.rng is None or depth >= _MAX_DEPTH or self.rng.random() < 0.5):
                continue
            out[name] = self.value(sub, depth + 1)
        for name in required:
            if name not in out:
                out[name] = self.value(extra if isinstance(extra, Mapping) else {}, depth + 1)
        return out

    def array(self, schema: Schema, depth: int) -> list[Any]:
        low = _int(schema.get("minItems"), 0)
        high = _int(schema.get("maxItems"), max(low, 3 if depth < _MAX_DEPTH else low))
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = schema.get("items", {})
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, schema.get("additionalItems", {})
        count = self.between(low, max(low, min(high, low + 2)))
        if depth >= _MAX_DEPTH:
            count = low
        return [self.value(prefix[i] if i < len(prefix) else items, depth + 1) for i in range(count)]

    def string(self, schema: Schema) -> str:
        fmt = schema.get("format")
        low = _int(schema.get("minLength"), 0)
        high = _int(schema.get("maxLength"), -1)
        if isinstance(fmt, str) and fmt in _FORMATS and low <= len(_FORMATS[fmt]) <= (high % (1 << 30)):
            return _FORMATS[fmt]
        high = high if high >= 0 else max(low, 12)
        length = self.between(max(low, min(high, 1)), min(high, max(low, 12)))
        text = ""
        while len(text) < length:
            text += ("" if not text else " ") + self.pick(list(_WORDS))
        return text[:length]

    def integer(self, schema: Schema) -> int:
        lo, hi = _bounds(schema)
        low = math.ceil(lo) if math.isfinite(lo) else None
        high = math.floor(hi) if math.isfinite(hi) else None
        if low is not None and lo == low and _exclusive(schema, "exclusiveMinimum", lo):
            low += 1
        if high is not None and hi == high and _exclusive(schema, "exclusiveMaximum", hi):
            high -= 1
        if low is None:
            low = min(0, high) if high is not None else 0
        if high is None:
            high = low + 100
        step = schema.get("multipleOf")
        if isinstance(step, int) and not isinstance(step, bool) and step > 0:
            first = -(-low // step) * step
            return first + step * self.between(0, max(0, (high - first) // step))
        return self.between(low, high)

    def number(self, schema: Schema) -> float | int:
        step = schema.get("multipleOf")
        if isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0:
            lo, hi = _bounds(schema)
            if lo <= 0 <= hi and not (lo == 0 and _exclusive(schema, "exclusiveMinimum", lo)):
                return 0
            # A whole multiple of the step; (k * step) / step is exact for small k.
            k = math.ceil(lo / step) if math.isfinite(lo) else math.floor(hi / step)
            return k * step
        lo, hi = _bounds(schema)
        low = lo if math.isfinite(lo) else min(0.0, hi - 100.0)
        high = hi if math.isfinite(hi) else low + 100.0
        if self.rng is not None:
            candidate = round(self.rng.uniform(low, high), 2)
            if _inside(candidate, schema, lo, hi):
                return candidate
        for candidate in (low, (low + high) / 2, high):
            if _inside(candidate, schema, lo, hi):
                return candidate
        return (low + high) / 2


def _type_of(schema: Schema) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list):
        # Any listed type will do; a concrete one shows the shape better than null.
        kinds = [k for k in kind if isinstance(k, str)]
        kind = next((k for k in kinds if k != "null"), kinds[0] if kinds else None)
    if isinstance(kind, str):
        return kind
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return None


def _merge(base: Schema, more: Schema) -> dict[str, Any]:
    """`more` over `base`, with their `properties` and `required` united rather than replaced."""
    out = {**base, **more}
    if isinstance(base.get("properties"), Mapping) and isinstance(more.get("properties"), Mapping):
        out["properties"] = {**base["properties"], **more["properties"]}
    if isinstance(base.get("required"), list) and isinstance(more.get("required"), list):
        out["required"] = list(dict.fromkeys([*base["required"], *more["required"]]))
    return out


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _bounds(schema: Schema) -> tuple[float, float]:
    """The closed hull [lo, hi] of the allowed range; exclusive bounds are checked by `_exclusive`."""
    lo, hi = -math.inf, math.inf
    for key in ("minimum", "exclusiveMinimum"):
        if (v := _number(schema.get(key))) is not None:
            lo = max(lo, v)
    for key in ("maximum", "exclusiveMaximum"):
        if (v := _number(schema.get(key))) is not None:
            hi = min(hi, v)
    return lo, hi


def _exclusive(schema: Schema, key: str, bound: float) -> bool:
    """Whether `bound` itself is excluded: draft 6+ numeric `exclusive*`, or draft 4's boolean form."""
    value = schema.get(key)
    if value is True:
        return True
    return _number(value) == bound


def _inside(x: float, schema: Schema, lo: float, hi: float) -> bool:
    if not lo <= x <= hi:
        return False
    if x == lo and _exclusive(schema, "exclusiveMinimum", lo):
        return False
    return not (x == hi and _exclusive(schema, "exclusiveMaximum", hi))
