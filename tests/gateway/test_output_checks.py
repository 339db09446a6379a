"""A response's output checks leave one audit record between them: the decisive or the last check, with how
many checks there were and the generated tokens they scored (over HTTP, and the choice of record in unit)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, cast

import msgspec
import openai
import pytest
from msgspec.structs import replace
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engines.base import EngineDelta
from engines.vllm_local import VllmLocalEngine
from gateway.app import create_app
from gateway.config import GuardConfig
from gateway.generation.prompts import PromptRenderer
from guard.base import GuardInput
from guard.moderator import OutputBlocked, moderate
from policy.safety.decision import Action, GuardDecision, GuardRecord, Source
from policy.safety.gate import Evaluation
from policy.safety.output import OutputChecks, OutputGuard
from policy.safety.records import audit_draft
from tests.conftest import MODEL, Tenancy, make_config, serving
from tests.gateway import test_guard_http
from tests.gateway.test_guard_http import Bed, content_of, policy, sse_events, stream_raw

# The guarded gateway of the guard's HTTP tests (simulated engines, the real gate, moderator and rules).
bed = test_guard_http.bed


def output_records(bed: Bed, request_id: str) -> list[GuardRecord]:
    return [r for r in bed.records.items if r.direction == "output" and r.request_id == request_id]


async def test_a_streamed_answer_leaves_one_output_record_with_its_check_count(bed: Bed) -> None:
    await bed.bind(policy(hold_back=4, check_every=4))
    raw = await stream_raw(bed, "Tell me a story")
    events = sse_events(raw)
    assert len(content_of(events).split(" ")) == 61  # 60 one-token deltas, each " word"
    request_id = events[0]["id"].removeprefix("chatcmpl-")
    [record] = output_records(bed, request_id)
    assert (record.action, record.source) == ("allow", "model")
    # Checks after 4, 8, ..., 56 tokens (never on the last delta's own turn), then the final one: 15, the
    # first scoring 4 tokens, the next 13 and the last 4 held + 4 new each.
    assert record.checks == 15
    assert record.guard_tokens == 4 + 13 * 8 + 8
    counts = bed.app.state.services.gate.counts
    assert counts[("output", "model", "allow")] == 1


async def test_a_blocked_stream_leaves_one_record_the_block_with_the_checks_before_it(bed: Bed) -> None:
    await bed.bind(policy())
    full = content_of(sse_events(await stream_raw(bed, "Tell me a story")))
    words = full.split(" ")[1:]
    await bed.bind(policy(output_block=f"{words[30]} {words[31]}", hold_back=4, check_every=4))
    events = sse_events(await stream_raw(bed, "Tell me a story"))
    request_id = events[0]["id"].removeprefix("chatcmpl-")
    [record] = output_records(bed, request_id)
    assert (record.action, record.source) == ("block", "rules")
    # The span ends with token 32: the check after 32 tokens is the first to hold it whole.
    assert record.checks == 8
    assert bed.outcomes.items[-1].status == "blocked"


async def test_a_whole_answer_leaves_one_output_record(bed: Bed) -> None:
    await bed.bind(policy(hold_back=4, check_every=4))
    response = await bed.chat("Tell me a story", max_tokens=40)
    assert response.status_code == 200
    [record] = output_records(bed, response.headers["x-request-id"])
    assert record.checks == 1  # 40 tokens fit one window of [guard] output_window_tokens
    assert record.guard_tokens == 40


async def test_the_guard_tokens_are_reported_in_usage_and_charged_as_a_line_of_their_own(bed: Bed) -> None:
    await bed.bind(policy(hold_back=4, check_every=4))
    before = await bed.tokens_level()
    events = sse_events(await stream_raw(bed, "Tell me a story", stream_options={"include_usage": True}))
    [last] = [e for e in events if isinstance(e, dict) and e.get("usage")]
    usage = last["usage"]
    assert usage["guard_tokens"] == 116
    chunk_usage = ChatCompletionChunk.model_validate(last).usage
    assert chunk_usage is not None
    assert chunk_usage.model_extra == {"guard_tokens": 116}
    # OpenAI's total stays prompt + completion; the guard's line is beside it.
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    charged = before - await bed.tokens_level()
    assert charged == pytest.approx(usage["prompt_tokens"] + usage["completion_tokens"] + 116, abs=0.01)
    # In the request's outcome (the log line, the metrics) too.
    assert bed.outcomes.items[-1].usage.guard_tokens == 116
    metrics = await bed.http.get("/metrics")
    [line] = [x for x in metrics.text.splitlines() if x.startswith("lockgate:guard_tokens_total{")]
    assert 'tenant="acme"' in line
    assert float(line.rsplit(" ", 1)[1]) >= 116


async def test_a_whole_answer_reports_its_guard_tokens_and_the_price_factor_applies(bed: Bed) -> None:
    await bed.bind(policy(hold_back=4, check_every=4))
    # The pipeline's settings (settlement reads the price there).
    gen = bed.app.state.services.generation
    gen.config = replace(gen.config, quota=replace(gen.config.quota, guard_token_price=0.5))
    before = await bed.tokens_level()
    response = await bed.chat("Tell me a story", max_tokens=40)
    usage = response.json()["usage"]
    assert usage["guard_tokens"] == 40
    # The OpenAI SDK takes the extra field and keeps it.
    parsed = ChatCompletion.model_validate(response.json()).usage
    assert parsed is not None
    assert parsed.model_extra == {"guard_tokens": 40}
    charged = before - await bed.tokens_level()
    assert charged == pytest.approx(usage["prompt_tokens"] + usage["completion_tokens"] + 20, abs=0.01)


async def test_an_unguarded_answer_has_openais_usage_exactly(bed: Bed) -> None:
    await bed.bind(msgspec.structs.replace(policy(), guard_output=False))
    usage = (await bed.chat("Tell me a story")).json()["usage"]
    assert "guard_tokens" not in usage


class FakeGate:
    """Evaluates a window by its text ("BAD": block, "MEH": flagged allow, else allow); records commits."""

    def __init__(self) -> None:
        self.committed: list[tuple[GuardRecord, int, int]] = []

    async def evaluate(self, policy: Any, item: GuardInput, context: Any) -> Evaluation:
        text = item.text()
        action: Action = "block" if "BAD" in text else "allow"
        flagged = "MEH" in text and action == "allow"
        source: Source = "band" if flagged else "rules"
        decision = GuardDecision(direction="output", action=action, source=source, flagged=flagged)
        record = GuardRecord(
            tenant="t",
            key_id="k",
            request_id="r",
            direction="output",
            policy="p@1",
            policy_hash="h",
            action=action,
            source=source,
            category="",
            flagged=flagged,
            runs=(),
            content_sha256="",
            content=text,
            at=0.0,
        )
        return Evaluation(decision=decision, record=record)

    async def commit(
        self, policy: Any, evaluation: Evaluation, *, checks: int, guard_tokens: int
    ) -> GuardDecision:
        return self.commit_allow(policy, evaluation, checks=checks, guard_tokens=guard_tokens)

    def commit_allow(
        self, policy: Any, evaluation: Evaluation, *, checks: int, guard_tokens: int
    ) -> GuardDecision:
        self.committed.append((evaluation.record, checks, guard_tokens))
        return evaluation.decision


class FakeGuard:
    """What `OutputChecks` reads of its request's `OutputGuard`."""

    def __init__(self) -> None:
        self.gate = FakeGate()
        self.ref = "p@1"
        self.policy = self
        self.context = None
        self.categories = ()
        self.cache_salt = "salt"
        self.timeline = self
        self.tracker = self
        self.decision: GuardDecision | None = None
        self.finished: list[str] = []

    def now(self) -> float:
        return 0.0

    def guard_check(self, direction: str, start: float, decision: GuardDecision) -> None:
        pass

    def finish(self, status: str) -> None:
        self.finished.append(status)

    def guard_scored(self, tokens: int) -> None:
        pass


async def words(texts: list[str]) -> AsyncGenerator[EngineDelta, None]:
    for i, text in enumerate(texts):
        yield EngineDelta(token_ids=(i,), text=text, finish_reason="stop" if i == len(texts) - 1 else None)


async def checked(texts: list[str], *, close_after: int | None = None) -> FakeGate:
    guard = FakeGuard()
    checks = OutputChecks(cast(OutputGuard, guard))
    out = moderate(
        words(texts), checks.check, hold_back=1, check_every=2, scored=checks.scored, done=checks.done
    )
    released = 0
    try:
        async for delta in out:
            released += len(delta.token_ids)
            if close_after is not None and released >= close_after:
                await out.aclose()
                break
    except OutputBlocked:
        assert guard.finished == ["blocked"]
    return guard.gate


@pytest.mark.parametrize(
    ("texts", "kept", "checks"),
    [
        # Clean: the last check is recorded (it holds the final window).
        (["a", "b", "c", "d", "e", "f", "g"], "fg", 4),
        # A flagged window is recorded even though later windows were clean: a reviewer must see it.
        (["a", "MEH", "c", "d", "MEH", "f", "g"], "aMEH", 4),
        # A block ends the checks and is the record.
        (["a", "b", "MEH", "BAD", "e", "f", "g"], "bMEHBAD", 2),
    ],
)
async def test_the_record_kept_is_the_block_else_the_first_flagged_else_the_last(
    texts: list[str], kept: str, checks: int
) -> None:
    gate = await checked(texts)
    [(record, count, tokens)] = gate.committed
    assert record.content == kept
    assert count == checks
    assert tokens > 0


async def test_a_stream_cut_short_still_leaves_its_one_record() -> None:
    # The client went away after the first release: the checks made so far are recorded once.
    gate = await checked(["a", "MEH", "c", "d", "e", "f", "g"], close_after=1)
    [(record, count, _)] = gate.committed
    assert record.flagged
    assert count == 1


async def test_the_audit_draft_of_an_output_record_says_how_many_checks_it_stands_for() -> None:
    evaluation = await FakeGate().evaluate(None, GuardInput(direction="output", spans=()), None)
    record = msgspec.structs.replace(evaluation.record, checks=15, guard_tokens=116)
    assert audit_draft(record).detail == "checks=15 guard_tokens=116"
    assert audit_draft(msgspec.structs.replace(record, direction="input")).detail == ""


async def test_on_the_real_engine_a_long_stream_is_checked_in_bounded_windows_and_metered(
    vllm_engine: VllmLocalEngine, renderer: PromptRenderer, tenancy: Tenancy
) -> None:
    # The built-in rules policy (hold back 8, check every 16) over SmolLM2, through the openai SDK: the
    # guard tokens it reports grow with the answer, not with its square (re-reading the whole output at
    # each check scored 64 tokens per generated token at 2,048 tokens).
    config = replace(make_config(), guard=GuardConfig(default_policy="rules"))
    app = create_app(config, engine=vllm_engine, renderer=renderer, tenants=tenancy.store)
    async with (
        serving(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=tenancy.consumer, max_retries=0) as sdk,
    ):
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a story about a lighthouse keeper."}],
            max_tokens=160,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"min_tokens": 160},
        )
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        assert usage is not None
        assert usage.completion_tokens == 160
        assert text
        guard_tokens = (usage.model_extra or {})["guard_tokens"]
        # Every generated token is read, and each of the 10 checks reads at most its 16 new tokens, the 8
        # held back before them and the deltas that straddle the window's edge (a delta holds a few tokens
        # at most when the engine steps while the gateway is busy).
        assert 160 <= guard_tokens <= 160 + 10 * (8 + 8)
