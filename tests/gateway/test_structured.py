"""Which client JSON schemas the gateway sends to xgrammar, which it refuses, and what it says then."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field
from xgrammar.testing import _is_grammar_accept_string

from gateway.generation import structured
from gateway.generation.structured import (
    MAX_SCHEMA_BRANCHES,
    MAX_SCHEMA_BRANCHES_TOTAL,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    MAX_SCHEMA_PATTERN_CHARS,
    MAX_SCHEMA_STRING_CHARS,
    SchemaError,
    check_bounds,
    prepare_schema,
    tool_call_schema,
)

MODEL_DIR = Path.home() / ".cache/lockgate/models/SmolLM2-135M-Instruct"


class Address(BaseModel):
    street: str
    zip: str | None = None


class Person(BaseModel):
    """What the openai SDK's `parse`, instructor and langchain send: nested models and Optional fields."""

    name: str = Field(description="full name", min_length=1)
    age: int = Field(ge=0, le=150)
    tags: list[str] = []
    address: Address
    home: Address | None = None
    kind: Literal["a", "b"] = "a"
    scores: dict[str, float] = {}


class Cat(BaseModel):
    pet: Literal["cat"]
    lives: int


class Dog(BaseModel):
    pet: Literal["dog"]
    good: bool


class Owner(BaseModel):
    animal: Cat | Dog = Field(discriminator="pet")


def accepts(text: str, instance: str) -> bool:
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=(",", ":"))
    return bool(_is_grammar_accept_string(grammar, instance))


NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1}},
            "required": ["id"],
        },
        "items": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3},
        "ref": {"$ref": "#/$defs/Point"},
        "either": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "when": {"type": "string", "format": "date"},
    },
    "required": ["user"],
    "$defs": {"Point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}]}},
}


@pytest.mark.parametrize(
    "schema",
    [
        NESTED,
        Person.model_json_schema(),
        Owner.model_json_schema(),
        {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        {"type": "object", "patternProperties": {"^x_[a-z]+$": {"type": "integer"}}},
        {"type": "integer", "format": "int64"},
    ],
    ids=["nested", "pydantic", "pydantic-discriminated", "oneOf-disjoint", "patternProperties", "int-format"],
)
@pytest.mark.parametrize("strict", [False, True])
def test_supported_schemas_compile_to_compact_json(schema: dict[str, Any], strict: bool) -> None:
    text = prepare_schema(schema, strict=strict)
    if strict:
        assert json.loads(text)[
            "properties" if "properties" in schema else "oneOf" if "oneOf" in schema else "type"
        ]
    else:
        assert text == json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def test_canonical_text_keeps_property_order_which_the_grammar_follows() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    text = prepare_schema(schema, strict=False)
    assert text == '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"integer"}}}'
    assert accepts(text, '{"b":1,"a":2}')
    assert not accepts(text, '{"a":2,"b":1}')


def test_pydantic_schema_enforces_nested_and_optional_fields() -> None:
    text = prepare_schema(Person.model_json_schema(), strict=True)
    good = '{"name":"Ann","age":30,"address":{"street":"Main"},"home":null}'
    assert accepts(text, good)
    assert accepts(
        text, '{"name":"Ann","age":30,"address":{"street":"Main","zip":null},"home":{"street":"x"}}'
    )
    assert not accepts(text, '{"name":"Ann","age":300,"address":{"street":"Main"}}')
    assert not accepts(text, '{"name":"Ann","age":30}')
    assert not accepts(text, '{"name":"Ann","age":30,"address":{"street":"Main","extra":1}}')


@pytest.mark.parametrize(
    ("schema", "keyword", "pointer"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems", "/uniqueItems"),
        ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "uniqueItems",
         "/properties/tags/uniqueItems"),
        ({"type": "array", "contains": {"const": 1}}, "contains", "/contains"),
        ({"type": "integer", "multipleOf": 3}, "multipleOf", "/multipleOf"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf", "/multipleOf"),
        ({"type": "string", "not": {"const": "a"}}, "not", "/not"),
        ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if", "/if"),
        ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas",
         "/dependentSchemas"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "/dependentRequired"),
        ({"type": "string", "contentEncoding": "base64"}, "contentEncoding", "/contentEncoding"),
        ({"$ref": "https://example.com/s.json"}, "$ref", "/$ref"),
        ({"$defs": {"A": {"$anchor": "a", "type": "integer"}}, "$ref": "#a"}, "$ref", "/$ref"),
        ({"$defs": {"A": {"type": "object"}}, "$ref": "#/$defs/A", "required": ["x"]}, "required",
         "/required"),
        ({"type": "string", "format": "binary"}, "format", "/format"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength", "/maxLength"),
        ({"type": "string", "format": "email", "minLength": 3}, "minLength", "/minLength"),
        ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, "allOf", "/allOf"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "/oneOf"),
        ({"minimum": 3}, "minimum", "/minimum"),
        ({"minLength": 2}, "minLength", "/minLength"),
        ({"minProperties": 1}, "minProperties", "/minProperties"),
        ({"type": "object", "properties": {"a": {}}, "patternProperties": {"^b$": {}}}, "patternProperties",
         "/patternProperties"),
        ({"type": "object", "propertyNames": {"pattern": "^a$"}, "properties": {"a": {}}}, "propertyNames",
         "/propertyNames"),
        ({"type": "array", "items": {"anyOf": [{"type": "string", "format": "regex"}]}}, "format",
         "/items/anyOf/0/format"),
        ({"$defs": {"a/b": {"type": "array", "uniqueItems": True}}}, "uniqueItems",
         "/$defs/a~1b/uniqueItems"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("strict", [False, True])
def test_unenforced_features_are_refused_by_name_and_pointer(
    schema: dict[str, Any], keyword: str, pointer: str, strict: bool
) -> None:
    with pytest.raises(SchemaError) as caught:
        prepare_schema(schema, strict=strict)
    assert caught.value.pointer == pointer
    assert f"'{keyword}'" in caught.value.message
    assert f"'{pointer}'" in caught.value.message


def test_pydantic_set_is_refused_because_uniqueness_is_not_enforced() -> None:
    class Tagged(BaseModel):
        tags: set[str]

    with pytest.raises(SchemaError, match="uniqueItems"):
        prepare_schema(Tagged.model_json_schema(), strict=True)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": 5}, "invalid JSON schema at '/type': 5 is not valid under any of the given schemas"),
        (
            {"properties": {"a": {"type": "strng"}}},
            "invalid JSON schema at '/properties/a/type': "
            "'strng' is not valid under any of the given schemas",
        ),
        ({"required": "a"}, "invalid JSON schema at '/required': 'a' is not of type 'array'"),
    ],
)
def test_invalid_json_schema_is_refused_with_jsonschema_reason(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaError) as caught:
        prepare_schema(schema, strict=False)
    assert caught.value.message == message
    assert caught.value.pointer == message.split("'")[1]


@pytest.mark.parametrize("schema", [[], "x", None, 5])
def test_non_object_is_refused(schema: object) -> None:
    with pytest.raises(SchemaError, match="must be a JSON object"):
        prepare_schema(schema, strict=False)


def test_compile_errors_become_schema_errors_without_log_prefix() -> None:
    with pytest.raises(
        SchemaError, match=r"^the JSON schema cannot be compiled to a grammar: Cannot find field"
    ):
        prepare_schema({"$ref": "#/$defs/Missing"}, strict=False)
    with pytest.raises(SchemaError, match="enum array must not be empty"):
        prepare_schema({"enum": []}, strict=False)


def test_size_and_depth_limits() -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(SchemaError, match="deeper than"):
        prepare_schema(deep, strict=False)
    shallow: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):
        shallow = {"type": "object", "properties": {"a": shallow}}
    prepare_schema(shallow, strict=False)
    described = {"type": "integer", "description": "a field described at some length " * 2}
    wide = {"type": "object", "properties": {f"p{i:05}": described for i in range(1000)}}
    assert len(json.dumps(wide)) > MAX_SCHEMA_BYTES
    with pytest.raises(SchemaError, match="larger than"):
        prepare_schema(wide, strict=False)


def branches(count: int) -> list[dict[str, Any]]:
    """`count` pairwise disjoint object branches (a required const key tells them apart)."""
    return [{"type": "object", "properties": {"k": {"const": i}}, "required": ["k"]} for i in range(count)]


LONG_PATTERN = "a" * (MAX_SCHEMA_PATTERN_CHARS + 1)
LONG_STRING = "x" * (MAX_SCHEMA_STRING_CHARS + 1)


@pytest.mark.parametrize(
    ("schema", "pointer", "says"),
    [
        ({"oneOf": branches(MAX_SCHEMA_BRANCHES + 1)}, "/oneOf", "has 129 branches; at most 128"),
        ({"type": "object", "properties": {"a": {"anyOf": [{"const": i} for i in range(129)]}}},
         "/properties/a/anyOf", "at most 128 in one 'anyOf'"),
        ({"type": "object", "properties": {"code": {"type": "string", "pattern": LONG_PATTERN}}},
         "/properties/code/pattern", "regular expression at '/properties/code/pattern' has 1001 characters"),
        ({"type": "object", "patternProperties": {LONG_PATTERN: {"type": "integer"}}},
         f"/patternProperties/{LONG_PATTERN}", "regular expression"),
        ({"type": "string", "description": LONG_STRING}, "/description",
         f"string at '/description' has {MAX_SCHEMA_STRING_CHARS + 1} characters; at most "
         f"{MAX_SCHEMA_STRING_CHARS}"),
        ({"type": "object", "properties": {LONG_STRING: {"type": "integer"}}}, f"/properties/{LONG_STRING}",
         "key at"),
        ({"enum": list(range(MAX_SCHEMA_NODES))}, None, f"more than {MAX_SCHEMA_NODES} values"),
        ({"type": "array", "items": {"enum": [{"a": [i]} for i in range(MAX_SCHEMA_NODES // 3)]}}, None,
         f"more than {MAX_SCHEMA_NODES} values"),
    ],
    ids=["oneOf", "anyOf-nested", "pattern", "patternProperties-key", "string", "key", "nodes-flat",
         "nodes-nested"],
)  # fmt: skip
def test_bounds_name_the_limit_and_where_it_was_passed(
    schema: dict[str, Any], pointer: str | None, says: str
) -> None:
    for check in (check_bounds, lambda s: prepare_schema(s, strict=False)):
        with pytest.raises(SchemaError) as caught:
            check(schema)
        assert caught.value.pointer == pointer
        assert says in caught.value.message


def test_bounds_count_branches_over_the_whole_schema() -> None:
    per_field = MAX_SCHEMA_BRANCHES
    fields = MAX_SCHEMA_BRANCHES_TOTAL // per_field
    within: dict[str, Any] = {
        "type": "object",
        "properties": {f"p{j}": {"anyOf": [{"const": i} for i in range(per_field)]} for j in range(fields)},
    }
    check_bounds(within)
    over = copy.deepcopy(within)
    over["properties"]["extra"] = {"anyOf": [{"const": 0}, {"const": 1}]}
    with pytest.raises(SchemaError, match=f"{MAX_SCHEMA_BRANCHES_TOTAL} in all anyOf/oneOf") as caught:
        check_bounds(over)
    assert caught.value.pointer is not None
    assert caught.value.pointer.endswith("/anyOf")


def test_schemas_at_the_limits_pass() -> None:
    check_bounds({"oneOf": branches(MAX_SCHEMA_BRANCHES)})
    check_bounds({"type": "string", "pattern": "a" * MAX_SCHEMA_PATTERN_CHARS})
    check_bounds({"type": "string", "description": "x" * MAX_SCHEMA_STRING_CHARS})
    check_bounds({"enum": list(range(MAX_SCHEMA_NODES - 2))})  # the object, its list, the values
    prepare_schema({"oneOf": branches(MAX_SCHEMA_BRANCHES)}, strict=True)


def test_a_huge_schema_is_refused_in_constant_time_without_validating_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The attack of issue 40: a oneOf of 1,600 object branches took 12.8 s of CPU (pairwise disjointness
    in pure Python) before the quota was reserved. Refused now before the validator or the disjointness
    check reads it; an array of a million values costs no more, since sizes are counted before reading."""

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("an expensive step ran on a schema over the limits")

    monkeypatch.setattr(jsonschema.validators, "validator_for", never)
    monkeypatch.setattr(structured._Marks, "of", never)
    monkeypatch.setattr(xgr.Grammar, "from_json_schema", never)
    for schema in (
        {"oneOf": branches(1600)},
        {"enum": list(range(1_000_000))},
        {"type": "object", "properties": {f"p{i}": {} for i in range(200_000)}},
    ):
        start = time.process_time()
        with pytest.raises(SchemaError):
            prepare_schema(schema, strict=True)
        assert time.process_time() - start < 0.01


def test_oneof_disjointness_reads_each_branch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = 0
    values = structured._values

    def counted(node: dict[str, Any]) -> frozenset[str] | None:
        nonlocal reads
        reads += 1
        return values(node)

    monkeypatch.setattr(structured, "_values", counted)
    prepare_schema({"oneOf": branches(MAX_SCHEMA_BRANCHES)}, strict=False)
    # Once per branch and once per required key; pairwise, it was 4 per pair (32,512 here).
    assert reads == 2 * MAX_SCHEMA_BRANCHES


def test_oneof_reads_a_referenced_schema_once_however_often_it_is_referenced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`$ref`s would otherwise multiply the work: 128 branches naming one 2,000-value enum."""
    reads: list[int] = []
    values = structured._values

    def counted(node: dict[str, Any]) -> frozenset[str] | None:
        reads.append(len(node.get("enum", ())))
        return values(node)

    monkeypatch.setattr(structured, "_values", counted)
    refs = [
        {
            "type": "object",
            "properties": {"k": {"const": i}, "e": {"$ref": "#/$defs/E"}},
            "required": ["k", "e"],
        }
        for i in range(MAX_SCHEMA_BRANCHES)
    ]
    prepare_schema({"oneOf": refs, "$defs": {"E": {"enum": list(range(2000))}}}, strict=False)
    assert reads.count(2000) == 1
    same = [{"$ref": "#/$defs/B"}] * 3
    defs = {"B": {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}}
    reads.clear()
    with pytest.raises(SchemaError, match="branches 0 and 1 may overlap"):
        prepare_schema({"oneOf": same, "$defs": defs}, strict=False)
    assert len(reads) == 2  # B itself and its key, once


def test_oneof_branches_apart_by_type_value_or_key_and_overlaps_named() -> None:
    apart = [
        {"type": "string"},
        {"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
        {"$ref": "#/$defs/B"},
        {"type": "integer", "const": 3},
    ]
    defs = {"B": {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}}, "required": ["kind"]}}
    prepare_schema({"oneOf": apart, "$defs": defs}, strict=False)
    overlap = {"type": "object", "properties": {"kind": {"enum": ["c", "d"]}}, "required": ["kind"]}
    with pytest.raises(SchemaError, match="branches 2 and 4 may overlap"):
        prepare_schema({"oneOf": [*apart, overlap], "$defs": defs}, strict=False)


def test_strict_adds_additional_properties_false_recursively_but_keeps_explicit_values() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "list": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}},
            "open": {"type": "object", "additionalProperties": True},
            "map": {"type": "object", "additionalProperties": {"type": "integer"}},
            "ref": {"$ref": "#/$defs/D"},
            "alt": {"anyOf": [{"type": "object", "properties": {"y": {"type": "string"}}}, {"type": "null"}]},
        },
        "$defs": {"D": {"type": "object", "properties": {"z": {"type": "boolean"}}}},
    }
    before = json.dumps(schema)
    out = json.loads(prepare_schema(schema, strict=True))
    assert json.dumps(schema) == before, "the caller's schema is not modified"
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["map"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in props["ref"]
    assert props["alt"]["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in json.loads(prepare_schema(schema, strict=False))


def test_xgrammar_defaults_without_strict() -> None:
    """What the engine enforces when the client's schema is used as given (xgrammar strict_mode)."""
    closed = prepare_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, strict=False)
    assert accepts(closed, '{"a":1}')
    assert not accepts(closed, '{"a":1,"b":2}')
    bare = prepare_schema({"type": "object"}, strict=False)
    assert accepts(bare, '{"b":2}')
    assert not accepts(prepare_schema({"type": "object"}, strict=True), '{"b":2}')
    # Untyped content is any JSON, but xgrammar 0.2.8 separates it with ", " whatever `separators` says.
    assert accepts(prepare_schema({"type": "array"}, strict=False), "[1, 2]")
    assert not accepts(prepare_schema({"type": "array"}, strict=False), "[1,2]")


TOOLS: list[tuple[str, dict[str, Any] | None]] = [
    ("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    ("ping", None),
    (
        "lookup",
        {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}},
    ),
]


def test_tool_call_schema_shape_matches_vllm() -> None:
    schema = tool_call_schema(TOOLS[:2], max_calls=1)
    assert schema == {
        "type": "array",
        "minItems": 1,
        "maxItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": TOOLS[0][1],
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["ping"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                },
            ],
        },
    }


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_call_schema_validates_calls(parallel: bool) -> None:
    params = TOOLS[2][1]
    assert params is not None
    schema = tool_call_schema(TOOLS, max_calls=2 if parallel else 1)
    assert "$defs" in params, "the caller's tools are not modified"
    assert schema["$defs"] == {"P": {"type": "integer"}}
    validator = jsonschema.Draft202012Validator(schema)
    one = {"name": "get_weather", "parameters": {"city": "Oslo"}}
    two = {"name": "lookup", "parameters": {"p": 3}}
    validator.validate([one])
    assert validator.is_valid([one, two]) is parallel
    assert not validator.is_valid([])
    assert not validator.is_valid([one, two, one]), "never more than max_calls"
    assert not validator.is_valid([{"name": "nope", "parameters": {}}])
    assert not validator.is_valid([{"name": "lookup", "parameters": {"p": "x"}}])
    text = prepare_schema(schema, strict=True)
    assert accepts(text, json.dumps([one], separators=(",", ":")))
    assert accepts(text, json.dumps([one, two], separators=(",", ":"))) is parallel
    assert not accepts(text, '[{"name":"get_weather","parameters":{"city":"Oslo"},"x":1}]')


def test_tool_call_schema_refuses_conflicting_defs_and_no_tools() -> None:
    a = {"type": "object", "$defs": {"P": {"type": "integer"}}}
    b = {"type": "object", "$defs": {"P": {"type": "string"}}}
    with pytest.raises(SchemaError, match="'P' has multiple schemas"):
        tool_call_schema([("a", a), ("b", b)], max_calls=4)
    with pytest.raises(SchemaError, match="must be an object"):
        tool_call_schema([("a", {"type": "object", "$defs": []})], max_calls=4)
    with pytest.raises(SchemaError, match="at least one tool"):
        tool_call_schema([], max_calls=4)


@pytest.mark.skipif(not MODEL_DIR.is_dir(), reason="default model not downloaded")
def test_grammar_matcher_accepts_valid_json_token_by_token() -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
    cases = [
        (Person.model_json_schema(), '{"name":"Ann","age":30,"address":{"street":"Main St"},"kind":"b"}'),
        (NESTED, '{"user":{"id":7},"items":["x","y"],"ref":[1.5,2],"code":"ABC","when":"2024-02-29"}'),
        (tool_call_schema(TOOLS, max_calls=4), '[{"name":"ping","parameters":{}}]'),
    ]
    for schema, instance in cases:
        text = prepare_schema(schema, strict=True)
        compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        matcher = xgr.GrammarMatcher(compiled)
        for token in tokenizer.encode(instance, add_special_tokens=False):
            assert matcher.accept_token(token), (instance, tokenizer.decode([token]))
        assert matcher.accept_token(tokenizer.eos_token_id)
        assert matcher.is_terminated()
        rejecting = xgr.GrammarMatcher(compiled)
        assert not rejecting.accept_string('{"nope"' if instance.startswith("{") else "{")
