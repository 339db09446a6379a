"""Guard calls on a pool of generation replicas are spread over the replicas, not sent to the first."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from engines.base import EngineDeadError, EngineRequestError
from routing.config import RouterConfig
from routing.guard_calls import ReplicaScorer, by_pool
from routing.replicas import Replica
from routing.router import Router
from tests.routing.test_replicas import CONFIG, FakeClock, FakeEngine, make_replica


class HeldEngine(FakeEngine):
    """Scores only once `release` is set; counts the calls it got."""

    def __init__(self, replica_id: str, **load: int) -> None:
        super().__init__(replica_id, **load)
        self.release = asyncio.Event()
        self.release.set()
        self.calls = 0

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        self.calls += 1
        await self.release.wait()
        return {t: float(-priority) for t in token_ids}


def pool(*engines: HeldEngine) -> tuple[ReplicaScorer, list[Replica]]:
    clock = FakeClock()
    replicas = [make_replica(e, clock) for e in engines]
    return ReplicaScorer(replicas, Router(RouterConfig()), clock), replicas


async def test_calls_in_flight_go_to_different_replicas() -> None:
    a, b = HeldEngine("a"), HeldEngine("b")
    scorer, _ = pool(a, b)
    a.release.clear()
    b.release.clear()
    calls = [asyncio.create_task(scorer.score_next_token([1, 2], [7], priority=3)) for _ in range(4)]
    await asyncio.sleep(0)
    assert (a.calls, b.calls) == (2, 2)
    a.release.set()
    b.release.set()
    assert await asyncio.gather(*calls) == [{7: -3.0}] * 4  # the engine's answer, priority passed on


async def test_calls_sharing_a_prompt_prefix_go_where_it_was_sent() -> None:
    a, b = HeldEngine("a"), HeldEngine("b")
    scorer, _ = pool(a, b)
    template = list(range(100, 164))  # four 16-token blocks: a guard's template
    a.release.clear()
    held = asyncio.create_task(scorer.score_next_token([1], [7]))  # "a" is busy with one call
    await asyncio.sleep(0)
    await scorer.score_next_token([*template, 1], [7])  # so the template's first call goes to "b"
    a.release.set()
    await held
    assert (a.calls, b.calls) == (1, 1)
    for i in range(3):  # both idle now: the template stays where it is cached
        await scorer.score_next_token([*template, 2 + i], [7])
    assert (a.calls, b.calls) == (1, 4)
    await scorer.score_next_token(list(range(500, 564)), [7])  # another prompt: no pull, ties by id
    assert (a.calls, b.calls) == (2, 4)


async def test_with_no_call_in_flight_the_replica_the_router_counts_less_busy_is_asked() -> None:
    busy, idle = HeldEngine("busy", running=5), HeldEngine("idle", running=1)
    scorer, replicas = pool(busy, idle)
    for replica in replicas:
        await replica.refresh()
    for _ in range(3):
        await scorer.score_next_token([1], [7])
    assert (busy.calls, idle.calls) == (0, 3)


async def test_a_replica_out_of_routing_is_skipped_unless_every_one_is() -> None:
    down, up = HeldEngine("down"), HeldEngine("up")
    scorer, replicas = pool(down, up)
    replicas[0].health_ready = False
    for _ in range(3):
        await scorer.score_next_token([1], [7])
    assert (down.calls, up.calls) == (0, 3)
    replicas[1].health_ready = False
    await scorer.score_next_token([1], [7])  # none routable: asked anyway, its error would be the guard's
    assert down.calls + up.calls == 4


def test_scorers_are_one_per_pool_and_their_context_is_the_shortest() -> None:
    short, long, other = HeldEngine("short"), HeldEngine("long"), HeldEngine("other")
    short.max_model_len = 1024
    clock = FakeClock()
    replicas = [make_replica(e, clock) for e in (short, long)]
    replicas.append(Replica(other, pool="guard", weights_sha256="b" * 64, config=CONFIG, clock=clock))
    scorers = by_pool(replicas, Router(RouterConfig()), clock)
    assert list(scorers) == ["default", "guard"]
    assert [r.replica_id for r in scorers["default"].replicas] == ["short", "long"]
    assert scorers["default"].max_model_len == 1024
    assert scorers["guard"].max_model_len == 4096


class FailingEngine(HeldEngine):
    """Fails every scoring call with `error`."""

    def __init__(self, replica_id: str, error: Exception) -> None:
        super().__init__(replica_id)
        self.error = error

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        self.calls += 1
        raise self.error


async def test_guard_calls_that_find_the_replica_dead_open_its_breaker() -> None:
    dead, up = FailingEngine("dead", EngineDeadError("engine core died")), HeldEngine("up")
    scorer, replicas = pool(dead, up)
    replicas[1].health_ready = False  # every call goes to "dead" while it is routable
    for _ in range(CONFIG.breaker.threshold):
        with pytest.raises(EngineDeadError):
            await scorer.score_next_token([1], [7])
    assert replicas[0].breaker.state == "open"
    assert not replicas[0].routable
    replicas[1].health_ready = True
    for _ in range(3):
        await scorer.score_next_token([1], [7])
    assert (dead.calls, up.calls) == (CONFIG.breaker.threshold, 3)


async def test_a_guard_call_refused_for_its_own_sake_does_not_count_against_the_replica() -> None:
    engine = FailingEngine("a", EngineRequestError("prompt too long"))
    scorer, replicas = pool(engine)
    for _ in range(CONFIG.breaker.threshold + 1):
        with pytest.raises(EngineRequestError):
            await scorer.score_next_token([1], [7])
    assert replicas[0].breaker.state == "closed"
    assert replicas[0].routable
