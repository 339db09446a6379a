"""The reply check: everyday prompts sent to a running gateway as a user would, counting the answers the
output guard cuts (issue 41: "everyday assistant replies never cut by the output guard in a 200-reply check").

    python -m ops.eval replies --url http://127.0.0.1:8080 --key "$KEY" [--data ops/eval/data/guard]
                               [--split test] [--count 200] [--concurrency 2] [--max-tokens 128] [--json]

The prompts are the everyday prompts (kind `everyday`) of the split, whole scenarios in id order (each in its
ten languages), so `--count 200` is twenty scenarios in every language. Each is one streamed chat completion
(`temperature` 0.7, the model's own answer, whatever it is): the answer is `cut` when a choice ends with
`finish_reason: content_filter`, `blocked` when the input guard refused the prompt (400
`content_policy_violation`), `completed` otherwise; any other status or a broken stream is an `error`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Literal

import httpx
import msgspec

from guard.labelled import LabelledItem

Verdict = Literal["completed", "cut", "blocked", "error"]


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """What happened to one prompt."""

    id: str
    language: str
    verdict: Verdict
    detail: str = ""  # the error's code or status, for `blocked` and `error`
    chars: int = 0  # characters of answer text received


class ReplyCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The check's counts, overall and per language, and every answer."""

    total: int
    verdicts: dict[str, int]
    cut_by_language: dict[str, int]
    answers: list[Answer]


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


class _ErrorBody(msgspec.Struct):
    code: str | None = None


class _Error(msgspec.Struct):
    error: _ErrorBody


def everyday_prompts(items: Sequence[LabelledItem], split: str, count: int) -> list[LabelledItem]:
    """The first `count` everyday prompts of `split`, whole scenarios in family then id order."""
    chosen = [i for i in items if i.split == split and i.shape == "prompt" and i.kind == "everyday"]
    return sorted(chosen, key=lambda i: (i.family, i.id))[:count]


async def ask(http: httpx.AsyncClient, item: LabelledItem, model: str, max_tokens: int) -> Answer:
    """Send one prompt, streamed, and classify the answer."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": item.text}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": True,
    }
    chars = 0
    finishes: list[str] = []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raw = await response.aread()
                try:
                    code = msgspec.json.decode(raw, type=_Error).error.code or ""
                except msgspec.DecodeError:
                    code = ""
                verdict: Verdict = "blocked" if code == "content_policy_violation" else "error"
                detail = f"{response.status_code} {code}"
                return Answer(id=item.id, language=item.language, verdict=verdict, detail=detail)
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = msgspec.json.decode(data, type=_Chunk)
                for choice in chunk.choices:
                    chars += len(choice.delta.content or "") if choice.delta else 0
                    if choice.finish_reason:
                        finishes.append(choice.finish_reason)
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        return Answer(id=item.id, language=item.language, verdict="error", detail=type(exc).__name__)
    if "content_filter" in finishes:
        return Answer(id=item.id, language=item.language, verdict="cut", chars=chars)
    if not done or not finishes:
        return Answer(id=item.id, language=item.language, verdict="error", detail="stream cut short")
    return Answer(id=item.id, language=item.language, verdict="completed", chars=chars)


async def check(
    http: httpx.AsyncClient,
    prompts: Sequence[LabelledItem],
    model: str,
    *,
    concurrency: int = 2,
    max_tokens: int = 128,
) -> ReplyCheck:
    """Ask every prompt, `concurrency` at a time, and count the verdicts."""
    gate = asyncio.Semaphore(concurrency)

    async def one(item: LabelledItem) -> Answer:
        async with gate:
            return await ask(http, item, model, max_tokens)

    answers = await asyncio.gather(*(one(item) for item in prompts))
    verdicts = Counter(a.verdict for a in answers)
    cut = Counter(a.language for a in answers if a.verdict == "cut")
    return ReplyCheck(
        total=len(answers),
        verdicts={v: verdicts.get(v, 0) for v in ("completed", "cut", "blocked", "error")},
        cut_by_language=dict(sorted(cut.items())),
        answers=list(answers),
    )


def render(result: ReplyCheck) -> str:
    """The check as a few lines of text."""
    v = result.verdicts
    lines = [
        f"{result.total} everyday prompts: {v['completed']} answered, {v['cut']} cut by the output guard, "
        f"{v['blocked']} blocked at the input, {v['error']} errors",
    ]
    if result.cut_by_language:
        lines.append("cut by language: " + ", ".join(f"{k} {n}" for k, n in result.cut_by_language.items()))
    for answer in result.answers:
        if answer.verdict != "completed":
            lines.append(f"  {answer.verdict}: {answer.id} {answer.detail}".rstrip())
    return "\n".join(lines) + "\n"
