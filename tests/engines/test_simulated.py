"""Simulator-specific behaviour: timing model, admission, capacity, faults. All timing is virtual."""

from __future__ import annotations

import asyncio
import json
import math
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import jsonschema
import pytest
import pytest_asyncio

from engines.base import (
    EngineDeadError,
    EngineDelta,
    EngineOverloadedError,
    EngineRequest,
    EngineRequestError,
    OutputConstraint,
    SamplingSpec,
)
from engines.schema_example import SchemaError, example_instance
from engines.simulated import SimulatedEngine, SimulatorConfig, difficulty

PROMPT = tuple(range(100, 110))


class VirtualClock:
    """A clock that only moves when the engine sleeps, so step times are exact and tests never wait."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)  # let consumers and the test run, as a real sleep would


Make = Callable[[SimulatorConfig], Awaitable[tuple[SimulatedEngine, VirtualClock]]]


@pytest_asyncio.fixture
async def make() -> AsyncIterator[Make]:
    """Build started engines on virtual clocks; shut them all down after the test."""
    engines: list[SimulatedEngine] = []

    async def build(config: SimulatorConfig) -> tuple[SimulatedEngine, VirtualClock]:
        clock = VirtualClock()
        engine = SimulatedEngine(config, clock=clock, sleep=clock.sleep)
        await engine.start()
        engines.append(engine)
        return engine, clock

    yield build
    for engine in engines:
        await engine.shutdown()


def req(
    rid: str | None = None,
    *,
    prompt: tuple[int, ...] = PROMPT,
    priority: int = 0,
    deadline: float | None = None,
    **sampling: object,
) -> EngineRequest:
    spec = SamplingSpec(**{"max_tokens": 5, **sampling})  # type: ignore[arg-type]
    rid = rid or uuid.uuid4().hex
    return EngineRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=spec, priority=priority, deadline=deadline
    )


async def collect(engine: SimulatedEngine, request: EngineRequest) -> list[EngineDelta]:
    return [d async for d in engine.generate(request)]


def token_ids(deltas: list[EngineDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    for _ in range(1000):
        if await condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_step_time_grows_with_batch_size(make: Make) -> None:
    config = SimulatorConfig(decode_step_s=0.01, decode_step_s_per_seq=0.001, prefill_s_per_token=0.0)
    engine, clock = await make(config)
    await collect(engine, req(max_tokens=5))
    assert clock.sleeps == pytest.approx([0.011] * 5)

    clock.sleeps.clear()
    start = clock.now
    await asyncio.gather(*(collect(engine, req(max_tokens=5)) for _ in range(8)))
    assert clock.sleeps == pytest.approx([0.018] * 5)
    assert clock.now - start == pytest.approx(5 * 0.018)


async def test_prefill_charged_on_admission_step(make: Make) -> None:
    config = SimulatorConfig(decode_step_s=0.01, decode_step_s_per_seq=0.0, prefill_s_per_token=0.001)
    engine, clock = await make(config)
    await collect(engine, req(max_tokens=3))
    assert clock.sleeps == pytest.approx([0.01 + 0.001 * len(PROMPT), 0.01, 0.01])


async def test_admission_is_fifo_by_priority(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(max_batch=1))
    finished: list[str] = []

    async def run(rid: str, priority: int) -> None:
        await collect(engine, req(rid, priority=priority, max_tokens=2))
        finished.append(rid)

    blocker = engine.generate(req("a", max_tokens=100))
    await anext(blocker)
    tasks = [asyncio.create_task(run(rid, prio)) for rid, prio in [("b", 0), ("c", -1), ("d", 0)]]

    async def all_waiting() -> bool:
        return (await engine.load()).waiting == 3

    await until(all_waiting)
    assert (await engine.load()).running == 1
    async for _ in blocker:
        pass
    await asyncio.gather(*tasks)
    assert finished == ["c", "b", "d"]


async def test_kv_capacity_makes_requests_wait(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(kv_capacity_tokens=100, max_model_len=200))
    events: list[str] = []

    async def run(rid: str, request: EngineRequest) -> None:
        async for delta in engine.generate(request):
            if f"{rid}-first" not in events:
                events.append(f"{rid}-first")
            if delta.finish_reason is not None:
                events.append(f"{rid}-done")

    big = asyncio.create_task(run("big", req(prompt=tuple(range(40)), max_tokens=40)))  # reserves 80
    small = asyncio.create_task(run("small", req(prompt=tuple(range(10)), max_tokens=15)))  # 25 > 20 left

    async def one_waits() -> bool:
        load = await engine.load()
        return (load.running, load.waiting, load.kv_tokens_used) == (1, 1, 80)

    await until(one_waits)
    await asyncio.gather(big, small)
    assert events == ["big-first", "big-done", "small-first", "small-done"]
    load = await engine.load()
    assert (load.running, load.waiting, load.kv_tokens_used, load.kv_tokens_capacity) == (0, 0, 0, 100)
    with pytest.raises(EngineRequestError):  # could never fit, so it must not wait forever
        await collect(engine, req(prompt=tuple(range(60)), max_tokens=50))


async def test_waiting_request_past_deadline_is_aborted(make: Make) -> None:
    engine, clock = await make(SimulatorConfig(max_batch=1))
    blocker = asyncio.create_task(collect(engine, req(max_tokens=20)))
    await asyncio.sleep(0)
    late = await collect(engine, req(deadline=clock.now + 0.05))
    assert [(d.token_ids, d.finish_reason) for d in late] == [((), "abort")]
    assert late[0].usage is not None
    assert late[0].usage.completion_tokens == 0
    assert (await blocker)[-1].finish_reason == "length"


async def test_fail_after_tokens_raises(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(fail_after_tokens=3))
    seen: list[int] = []

    async def consume() -> None:
        async for delta in engine.generate(req(max_tokens=10)):
            seen.extend(delta.token_ids)

    with pytest.raises(EngineRequestError):
        await consume()
    assert len(seen) == 3
    load = await engine.load()
    assert (load.running, load.kv_tokens_used) == (0, 0)


async def test_overload_raises(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(max_batch=1, max_waiting=2))
    blocker = engine.generate(req(max_tokens=100))
    await anext(blocker)
    queued = [asyncio.create_task(collect(engine, req())) for _ in range(2)]

    async def queue_full() -> bool:
        return (await engine.load()).waiting == 2

    await until(queue_full)
    with pytest.raises(EngineOverloadedError):
        await anext(engine.generate(req()))
    await blocker.aclose()
    await asyncio.gather(*queued)


async def test_seeded_output_is_deterministic(make: Make) -> None:
    engine, _ = await make(SimulatorConfig())
    a = token_ids(await collect(engine, req(max_tokens=10, seed=42)))
    b = token_ids(await collect(engine, req(max_tokens=10, seed=42)))
    c = token_ids(await collect(engine, req(max_tokens=10, seed=43)))
    assert a == b
    assert a != c
    # Without a seed the request id decides.
    same = [token_ids(await collect(engine, req("fixed", max_tokens=10))) for _ in range(2)]
    other = token_ids(await collect(engine, req("other", max_tokens=10)))
    assert same[0] == same[1] != other


async def test_stop_strings(make: Make) -> None:
    engine, _ = await make(SimulatorConfig())
    full = await collect(engine, req(max_tokens=12, temperature=0.0))
    full_text = "".join(d.text for d in full)
    # One stop that is a whole token and one that spans two tokens.
    for stop in (full[3].text, full[2].text[-2:] + full[3].text[:3]):
        deltas = await collect(engine, req(max_tokens=12, temperature=0.0, stop=(stop,)))
        text = "".join(d.text for d in deltas)
        assert text == full_text[: full_text.index(stop)]
        assert deltas[-1].finish_reason == "stop"
        assert token_ids(deltas) == token_ids(full)[: len(token_ids(deltas))]
    assert full[-1].finish_reason == "length"


async def test_logprobs_shape(make: Make) -> None:
    engine, _ = await make(SimulatorConfig())
    deltas = await collect(engine, req(max_tokens=6, logprobs=3))
    for delta in deltas:
        assert delta.logprobs is not None
        (lp,) = delta.logprobs
        assert lp.token_id == delta.token_ids[0]
        assert len(lp.top) == 3
        assert (lp.top[0].token_id, lp.top[0].logprob) == (lp.token_id, lp.logprob)
        values = [alt.logprob for alt in lp.top]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0.0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1.0
    assert all(d.logprobs is None for d in await collect(engine, req(max_tokens=3)))


async def test_closing_or_cancelling_frees_at_once(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(max_batch=1))
    running = engine.generate(req(max_tokens=100))
    await anext(running)
    waiting = asyncio.create_task(collect(engine, req()))

    async def queued() -> bool:
        return (await engine.load()).waiting == 1

    await until(queued)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert (await engine.load()).waiting == 0
    await running.aclose()
    load = await engine.load()
    assert (load.running, load.waiting, load.kv_tokens_used) == (0, 0, 0)


async def test_a_slow_reader_gets_every_delta_in_order(make: Make) -> None:
    # Deltas the scheduler makes while the stream is not read wait for it, none lost, none merged.
    engine, _ = await make(SimulatorConfig())
    stream = engine.generate(req(max_tokens=6, seed=3))
    first = await anext(stream)

    async def finished() -> bool:
        return (await engine.load()).running == 0

    await until(finished)  # every step ran while nobody read
    rest = [d async for d in stream]
    assert [len(d.token_ids) for d in [first, *rest]] == [1] * 6
    assert [d.finish_reason for d in rest] == [None] * 4 + ["length"]
    again = await collect(engine, req(max_tokens=6, seed=3))
    assert token_ids([first, *rest]) == token_ids(again)


async def test_too_long_is_refused(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(max_model_len=64))
    with pytest.raises(EngineRequestError):
        await collect(engine, req(prompt=tuple(range(65)), max_tokens=1))
    with pytest.raises(EngineRequestError):
        await collect(engine, req(prompt=tuple(range(60)), max_tokens=5))


async def test_score_next_token(make: Make) -> None:
    engine, clock = await make(SimulatorConfig())
    named = list(range(0, 32000, 7))  # thousands of ids: the favourites of any prompt among them
    scores = await engine.score_next_token(list(PROMPT), named)
    assert scores == await engine.score_next_token(list(PROMPT), named)
    assert sorted(scores) == named
    assert all(v <= 0.0 for v in scores.values())
    assert sum(math.exp(v) for v in scores.values()) <= 1.0
    # A value depends on the prompt and the id only, not on which other ids are named.
    assert await engine.score_next_token(list(PROMPT), [named[3]]) == {named[3]: scores[named[3]]}
    assert scores != await engine.score_next_token([*PROMPT, 1], named)
    assert clock.now > 0.0  # the prefill took simulated time


async def test_score_next_token_whole_vocabulary_sums_to_at_most_one(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(vocab_size=500))
    scores = await engine.score_next_token(list(PROMPT), list(range(500)))
    assert 0.9 < sum(math.exp(v) for v in scores.values()) <= 1.0  # favourites jitter by up to e**-0.09


async def test_score_next_token_refuses_bad_ids_and_long_prompts(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(vocab_size=500, max_model_len=64))
    for ids in ([], [500], [-1]):
        with pytest.raises(EngineRequestError):
            await engine.score_next_token(list(PROMPT), ids)
    with pytest.raises(EngineRequestError):
        await engine.score_next_token(list(range(64)), [1])
    assert await engine.score_next_token(list(range(63)), [1])


async def test_shutdown_aborts_in_flight(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(max_batch=1))
    assert (await engine.health()).ready
    tasks = [asyncio.create_task(collect(engine, req(max_tokens=1000))) for _ in range(2)]

    async def one_each() -> bool:
        load = await engine.load()
        return (load.running, load.waiting) == (1, 1)

    await until(one_each)
    await engine.shutdown()
    for deltas in await asyncio.gather(*tasks):
        assert deltas[-1].finish_reason == "abort"
    assert not (await engine.health()).ready
    load = await engine.load()
    assert (load.running, load.waiting, load.kv_tokens_used) == (0, 0, 0)
    with pytest.raises(EngineDeadError):
        await collect(engine, req())
    with pytest.raises(EngineDeadError):
        await engine.score_next_token(list(PROMPT), [2])


async def test_not_ready_before_start() -> None:
    engine = SimulatedEngine(SimulatorConfig())
    assert not (await engine.health()).ready
    await engine.start()
    assert (await engine.health()).ready
    await engine.shutdown()


# Structured outputs, logit_bias and min_tokens.

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer"},
            "capital": {"type": "boolean"},
            "note": {"type": ["string", "null"], "minLength": 30},
        },
        "required": ["city", "population", "capital"],
        "additionalProperties": False,
    },
    {  # vLLM's tool_choice="required" shape, with shared $defs
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "unit": {"$ref": "#/$defs/unit"},
                                "days": {"type": "integer", "minimum": 1, "exclusiveMaximum": 8},
                            },
                            "required": ["unit", "days"],
                        },
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {"name": {"const": "noop"}, "parameters": {"type": "object"}},
                    "required": ["name"],
                },
            ],
        },
        "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
    },
    {  # recursive, draft-7 definitions
        "definitions": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                    "children": {"type": "array", "items": {"$ref": "#/definitions/node"}, "maxItems": 3},
                },
                "required": ["value", "children"],
            }
        },
        "$ref": "#/definitions/node",
    },
    {
        "allOf": [
            {
                "properties": {"a": {"type": "integer", "multipleOf": 7, "minimum": 10, "maximum": 60}},
                "required": ["a"],
            },
            {"properties": {"b": {"type": "number", "minimum": -5.5, "maximum": -5.25}}, "required": ["b"]},
        ],
        "properties": {
            "when": {"type": "string", "format": "date-time"},
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 2, "maxLength": 3},
                "minItems": 2,
                "maxItems": 2,
            },
        },
        "required": ["when", "tags"],
    },
    {"oneOf": [{"type": "null"}, {"type": "string"}]},
    {"prefixItems": [{"type": "integer"}, {"const": "x"}], "minItems": 2, "maxItems": 2},
    {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
    {},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_schema_example_validates(schema: dict[str, Any]) -> None:
    jsonschema.validate(example_instance(schema), schema)
    instances = [example_instance(schema, random.Random(seed)) for seed in range(100)]
    for instance in instances:
        jsonschema.validate(instance, schema)
    # One seed gives one instance.
    assert instances[7] == example_instance(schema, random.Random(7))


def test_schema_example_refuses_unresolvable_refs() -> None:
    for ref in ("#/$defs/missing", "https://example.com/schema.json"):
        with pytest.raises(SchemaError):
            example_instance({"$ref": ref})


def _json(kind: str, schema: dict[str, Any] | None = None) -> OutputConstraint:
    return OutputConstraint(kind=kind, schema=json.dumps(schema) if schema is not None else "")  # type: ignore[arg-type]


def _text(deltas: list[EngineDelta]) -> str:
    return "".join(d.text for d in deltas)


async def test_json_schema_constraint_streams_a_valid_instance(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(vocab_size=1000))
    for schema in SCHEMAS:
        for seed in range(10):
            deltas = await collect(
                engine, req(max_tokens=2000, seed=seed, constraint=_json("json_schema", schema))
            )
            jsonschema.validate(json.loads(_text(deltas)), schema)
            assert deltas[-1].finish_reason == "stop"
            # One token per step, like free text, and the text really is spread over them.
            assert all(len(d.token_ids) == 1 and d.text for d in deltas)
            assert all(0 <= t < 1000 for t in token_ids(deltas))
    # Greedy output depends on the prompt only, as without a constraint.
    greedy = [
        _text(
            await collect(
                engine, req(max_tokens=2000, temperature=0.0, constraint=_json("json_schema", SCHEMAS[0]))
            )
        )
        for _ in range(2)
    ]
    assert greedy[0] == greedy[1]


async def test_json_object_constraint_gives_an_object(make: Make) -> None:
    engine, _ = await make(SimulatorConfig())
    for seed in range(5):
        deltas = await collect(engine, req(max_tokens=200, seed=seed, constraint=_json("json_object")))
        assert isinstance(json.loads(_text(deltas)), dict)
        assert deltas[-1].finish_reason == "stop"
        assert len(deltas) > 1


async def test_constrained_output_is_cut_at_max_tokens(make: Make) -> None:
    engine, _ = await make(SimulatorConfig())
    constraint = _json("json_schema", SCHEMAS[0])
    full = _text(await collect(engine, req(max_tokens=500, seed=9, constraint=constraint)))
    cut = await collect(engine, req(max_tokens=3, seed=9, constraint=constraint))
    assert cut[-1].finish_reason == "length"
    assert len(cut) == 3
    assert full.startswith(_text(cut))
    assert len(_text(cut)) < len(full)


async def test_constrained_output_pads_to_min_tokens_or_past_eos(make: Make) -> None:
    engine, _ = await make(SimulatorConfig())
    constraint = _json("json_object")
    full = await collect(engine, req(max_tokens=100, seed=4, constraint=constraint))
    need = len(full) + 5
    padded = await collect(engine, req(max_tokens=100, seed=4, min_tokens=need, constraint=constraint))
    assert len(token_ids(padded)) == need
    assert padded[-1].finish_reason == "stop"
    assert _text(padded) == _text(full) + " " * 5  # whitespace is all the grammar allows after the value
    ignoring = await collect(engine, req(max_tokens=need + 3, seed=4, ignore_eos=True, constraint=constraint))
    assert (len(ignoring), ignoring[-1].finish_reason) == (need + 3, "length")
    assert json.loads(_text(ignoring)) == json.loads(_text(full))


async def test_logprobs_of_constrained_tokens_carry_their_text(make: Make) -> None:
    engine, _ = await make(SimulatorConfig())
    deltas = await collect(engine, req(max_tokens=200, logprobs=2, constraint=_json("json_object")))
    for delta in deltas:
        assert delta.logprobs is not None
        assert delta.logprobs[0].token == delta.text == delta.logprobs[0].top[0].token


async def test_min_tokens_holds_back_stop_strings(make: Make) -> None:
    engine, _ = await make(SimulatorConfig())
    full = await collect(engine, req(max_tokens=12, temperature=0.0))
    stop = full[1].text
    early = await collect(engine, req(max_tokens=12, temperature=0.0, stop=(stop,)))
    assert len(token_ids(early)) <= 2
    late = await collect(engine, req(max_tokens=12, temperature=0.0, stop=(stop,), min_tokens=6))
    assert len(token_ids(late)) >= 6
    assert token_ids(late) == token_ids(full)[: len(token_ids(late))]
    assert _text(full).startswith(_text(late))


async def test_logit_bias_bans_and_forces(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(vocab_size=10))
    bans = tuple((t, -100.0) for t in range(7))
    free = await collect(engine, req(max_tokens=200, seed=1, logit_bias=bans))
    assert set(token_ids(free)) <= {7, 8, 9}
    json_out = await collect(
        engine, req(max_tokens=200, seed=1, logit_bias=bans, constraint=_json("json_object"))
    )
    assert set(token_ids(json_out)) <= {7, 8, 9}
    assert isinstance(json.loads(_text(json_out)), dict)
    mild = await collect(engine, req(max_tokens=200, seed=1, logit_bias=((3, -5.0),)))
    assert 3 in token_ids(mild)  # only a ban keeps a token out
    forced = await collect(engine, req(max_tokens=20, seed=1, logit_bias=((4, 100.0),)))
    assert set(token_ids(forced)) == {4}


async def test_sampling_extras_are_accepted(make: Make) -> None:
    engine, _ = await make(SimulatorConfig())
    deltas = await collect(
        engine,
        req(
            max_tokens=5,
            frequency_penalty=1.0,
            presence_penalty=-1.0,
            repetition_penalty=1.3,
            top_k=5,
            min_p=0.1,
        ),
    )
    assert (len(deltas), deltas[-1].finish_reason) == (5, "length")


@pytest.mark.parametrize(
    ("n", "sampling"),
    [
        (2, {}),
        (1, {"logit_bias": ((10, 1.0), (32000, -100.0))}),
        (1, {"logit_bias": ((-1, -100.0),)}),
        (1, {"constraint": OutputConstraint(kind="json_schema", schema="{not json")}),
        (1, {"constraint": OutputConstraint(kind="json_schema", schema="[1]")}),
        (1, {"constraint": _json("json_schema", {"$ref": "#/$defs/missing"})}),
    ],
)
async def test_requests_an_engine_cannot_serve_are_refused(
    make: Make, n: int, sampling: dict[str, Any]
) -> None:
    engine, _ = await make(SimulatorConfig())
    spec = SamplingSpec(**{"max_tokens": 5, **sampling})
    with pytest.raises(EngineRequestError):
        await collect(engine, EngineRequest(request_id="bad", prompt_token_ids=PROMPT, sampling=spec, n=n))
    assert (await engine.load()).waiting == 0


async def test_banning_every_token_is_refused(make: Make) -> None:
    engine, _ = await make(SimulatorConfig(vocab_size=4))
    with pytest.raises(EngineRequestError):
        await collect(engine, req(logit_bias=tuple((t, -100.0) for t in range(4))))


async def test_a_declared_skill_says_whether_each_answer_is_right_and_how_sure_it_is(make: Make) -> None:
    noise = 0.2
    prompts = [(1, 2, 3, i) for i in range(40)]
    hard = [p for p in prompts if difficulty(p) >= 0.5]
    easy = [p for p in prompts if difficulty(p) < 0.5]
    assert hard
    assert easy
    settings = SimulatorConfig(skill=0.5, confident_logprob=-0.3, unsure_logprob=-1.5, logprob_noise=noise)
    engine, _ = await make(settings)
    for prompt, right in [*((p, False) for p in hard), *((p, True) for p in easy)]:
        deltas = await collect(engine, req(prompt=prompt, logprobs=0))
        text = "".join(d.text for d in deltas)
        assert text.startswith(" right" if right else " wrong")
        chosen = [entry.logprob for d in deltas for entry in d.logprobs or ()]
        assert len(chosen) == 5
        centre = -0.3 if right else -1.5
        assert all(centre - noise <= lp <= min(0.0, centre + noise) for lp in chosen)
    # The difficulty is the question's: the same last tokens after any preamble (another chat template).
    long = tuple(range(100))
    assert difficulty((7, *long)) == difficulty(long)
