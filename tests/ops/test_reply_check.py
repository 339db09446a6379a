"""The reply check (`python -m ops.eval replies`) against a scripted gateway: which answers count as cut,
blocked, answered or broken, and which prompts it sends."""

from __future__ import annotations

import json

import httpx

from guard.labelled import LabelledItem, load_items
from ops.eval.reply_check import check, everyday_prompts, render

DATA = "ops/eval/data/guard"


def prompt(n: int, language: str = "en") -> LabelledItem:
    return LabelledItem(
        id=f"none-l{n:02d}-{language}",
        text=f"prompt {n}",
        label="safe",
        category="benign",
        language=language,  # type: ignore[arg-type]
        severity="none",
        split="test",
        kind="everyday",
        family=f"none-l{n:02d}",
    )


def sse(*chunks: dict[str, object], done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


def delta(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


# What the scripted gateway answers to each prompt text.
SCRIPT = {
    "prompt 1": (200, sse(delta("Hello"), delta(" there", "stop"))),
    "prompt 2": (200, sse(delta("Sure,"), delta("", "content_filter"))),
    "prompt 3": (400, json.dumps({"error": {"code": "content_policy_violation"}}).encode()),
    "prompt 4": (503, json.dumps({"error": {"code": "overloaded"}}).encode()),
    "prompt 5": (200, sse(delta("Half"), done=False)),
}


def gateway(seen: list[dict[str, object]]) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        status, content = SCRIPT[body["messages"][0]["content"]]
        return httpx.Response(status, content=content)

    return httpx.AsyncClient(base_url="http://gw", transport=httpx.MockTransport(answer))


async def test_each_answer_is_classified_and_counted() -> None:
    seen: list[dict[str, object]] = []
    async with gateway(seen) as http:
        result = await check(http, [prompt(n) for n in range(1, 6)], "m", concurrency=3, max_tokens=64)
    assert [(a.id, a.verdict) for a in result.answers] == [
        ("none-l01-en", "completed"),
        ("none-l02-en", "cut"),
        ("none-l03-en", "blocked"),
        ("none-l04-en", "error"),
        ("none-l05-en", "error"),
    ]
    assert result.verdicts == {"completed": 1, "cut": 1, "blocked": 1, "error": 2}
    assert result.cut_by_language == {"en": 1}
    assert result.answers[0].chars == len("Hello there")
    assert result.answers[3].detail == "503 overloaded"
    # Every request is a streamed user turn as a client sends it.
    assert {(b["model"], b["stream"], b["max_tokens"]) for b in seen} == {("m", True, 64)}
    text = render(result)
    assert "1 cut by the output guard" in text
    assert "cut: none-l02-en" in text


def test_the_prompts_are_whole_scenarios_of_everyday_prompts_of_the_split() -> None:
    items = load_items(DATA)
    chosen = everyday_prompts(items, "test", 200)
    assert len(chosen) == 200
    assert {(i.split, i.kind, i.shape) for i in chosen} == {("test", "everyday", "prompt")}
    families = {i.family for i in chosen}
    assert len(families) == 20  # twenty scenarios, each in its ten languages
    assert len({i.language for i in chosen}) == 10
