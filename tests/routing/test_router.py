"""`Router`: KV-budget dispatch, weights and health filtering, load / prefix / session scoring, the escape
hatch and failover, on fake engines (and the simulated engine end to end) with a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.base import (
    EngineDeadError,
    EngineOverloadedError,
    EngineRequest,
    EngineRequestError,
    Health,
    SamplingSpec,
)
from engines.breaker import BreakerPolicy
from engines.simulated import SimulatedEngine, SimulatorConfig
from routing.affinity import PrefixMemory, SessionMemory, prefix_block_hashes
from routing.config import ReplicaConfig, RouterConfig
from routing.replicas import Replica
from routing.router import (
    NoHealthyReplicaError,
    RequestTooLargeError,
    Router,
    RouteRequest,
    is_replica_failure,
    may_fail_over,
    session_key,
)
from tests.routing.test_replicas import CONFIG, SHA_A, SHA_B, FakeClock, FakeEngine, make_replica, state

PREFIX = tuple(range(1000, 1064))  # four 16-token blocks


def route(
    rid: str = "r",
    *,
    prompt: Sequence[int] = PREFIX,
    max_tokens: int = 10,
    sha: str = SHA_A,
    session: str | None = None,
    salt: str | None = None,
) -> RouteRequest:
    """A routing request."""
    return RouteRequest(
        request_id=rid,
        weights_sha256=sha,
        prompt_token_ids=tuple(prompt),
        max_tokens=max_tokens,
        session=session,
        cache_salt=salt,
    )


async def replicas(
    *loads: int, capacity: int = 1000, sha: str = SHA_A, clock: FakeClock | None = None
) -> tuple[list[Replica], list[FakeEngine]]:
    """Refreshed replicas "a", "b", ... reporting `loads` requests running each."""
    clock = clock or FakeClock()
    engines = [FakeEngine(chr(ord("a") + i), capacity=capacity, running=n) for i, n in enumerate(loads)]
    reps = [make_replica(e, clock, sha=sha) for e in engines]
    await asyncio.gather(*(r.refresh() for r in reps))
    return reps, engines


async def test_least_loaded_wins_without_affinity() -> None:
    reps, _ = await replicas(3, 1, 2)
    assert Router(RouterConfig()).choose(route(prompt=()), reps, 0.0) is reps[1]


async def test_ties_break_by_replica_id() -> None:
    reps, _ = await replicas(0, 0, 0)
    router = Router(RouterConfig())
    assert router.choose(route(prompt=()), list(reversed(reps)), 0.0) is reps[0]


async def test_own_unreported_requests_count_as_load() -> None:
    reps, _ = await replicas(0, 0)
    router = Router(RouterConfig(prefix_weight=0.0))
    first = router.dispatch(route("1", prompt=()), reps, 0.0)
    second = router.dispatch(route("2", prompt=()), reps, 0.0)
    assert {first, second} == set(reps)


async def test_a_stale_report_of_own_finished_requests_is_not_load() -> None:
    """Two idle engines, one of which last reported a request of this gateway's that has since ended: two
    requests at once go one to each (the report would otherwise make the engine look busy)."""
    engines = [FakeEngine("a", capacity=1000), FakeEngine("b", capacity=1000)]
    reps = [make_replica(e, FakeClock()) for e in engines]
    await reps[0].refresh()
    reps[0].reserve("old", 300, 50)
    engines[0].set_load(running=1, waiting=0, used=300)
    for r in reps:
        await r.refresh()
    reps[0].release("old")  # ended after the report
    router = Router(RouterConfig(prefix_weight=0.0))
    chosen = [router.dispatch(route(str(i), prompt=tuple(range(100))), reps, 0.0) for i in range(2)]
    assert {c.replica_id for c in chosen if c is not None} == {"a", "b"}


async def test_no_room_returns_none_until_a_release() -> None:
    reps, _ = await replicas(0, capacity=1000)
    router = Router(RouterConfig())
    prompt = tuple(range(850))
    chosen = router.dispatch(route("1", prompt=prompt, max_tokens=10_000), reps, 0.0)
    assert chosen is reps[0]
    assert reps[0].held_tokens == 950  # growth reserve capped at 100 of max_tokens 10,000
    assert router.dispatch(route("2", prompt=tuple(range(60)), max_tokens=1), reps, 0.0) is None
    reps[0].release("1")
    assert router.dispatch(route("2", prompt=tuple(range(60)), max_tokens=1), reps, 0.0) is reps[0]


async def test_a_request_that_never_fits_is_refused() -> None:
    reps, _ = await replicas(0, 0, capacity=100)
    with pytest.raises(RequestTooLargeError) as info:
        Router(RouterConfig()).choose(route(prompt=tuple(range(90)), max_tokens=20), reps, 0.0)
    assert info.value.status == 400


async def test_before_the_first_report_requests_wait() -> None:
    engine = FakeEngine("a")
    replica = make_replica(engine, FakeClock())
    assert Router(RouterConfig()).choose(route(), [replica], 0.0) is None


async def test_only_replicas_serving_the_weights_are_chosen() -> None:
    clock = FakeClock()
    a = make_replica(FakeEngine("a"), clock, sha=SHA_A)
    b = make_replica(FakeEngine("b", running=5), clock, sha=SHA_B)
    await a.refresh()
    await b.refresh()
    router = Router(RouterConfig())
    assert router.choose(route(sha=SHA_B), [a, b], 0.0) is b
    with pytest.raises(NoHealthyReplicaError) as info:
        router.choose(route(sha="c" * 64), [a, b], 0.0)
    assert info.value.code == "no_healthy_replica"
    assert info.value.status == 503


async def test_unhealthy_replicas_only_is_no_healthy_replica() -> None:
    reps, engines = await replicas(0)
    engines[0].health_value = Health(ready=False, detail="down")
    await reps[0].refresh()
    with pytest.raises(NoHealthyReplicaError):
        Router(RouterConfig()).choose(route(), reps, 0.0)


async def serve(router: Router, reps: Sequence[Replica], request: RouteRequest, now: float) -> Replica | None:
    """What the pipeline does: dispatch, generate, report the outcome to the replica, release."""
    replica = router.dispatch(request, reps, now)
    if replica is None:
        return None
    engine_request = EngineRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=SamplingSpec(max_tokens=request.max_tokens),
    )
    try:
        async for _ in replica.engine.generate(engine_request):
            pass
    except (EngineDeadError, EngineRequestError) as exc:
        if is_replica_failure(exc):
            replica.record_failure()
    else:
        replica.record_success()
    finally:
        replica.release(request.request_id)
    return replica


async def test_a_replica_that_keeps_dying_is_skipped_until_its_trial_succeeds() -> None:
    clock = FakeClock()
    reps, engines = await replicas(0, 5, clock=clock)
    router = Router(RouterConfig())
    engines[0].fail = EngineDeadError("engine core died")
    for i in range(3):
        assert await serve(router, reps, route(f"d{i}", prompt=()), clock.now) is reps[0]
    assert state(reps[0]) == "open"
    assert await serve(router, reps, route("x", prompt=()), clock.now) is reps[1]
    clock.now += CONFIG.breaker.cooldown
    assert state(reps[0]) == "half_open"
    engines[0].fail = None
    assert await serve(router, reps, route("trial", prompt=()), clock.now) is reps[0]
    assert state(reps[0]) == "closed"


async def test_half_open_replica_takes_one_trial_at_a_time() -> None:
    clock = FakeClock()
    reps, _ = await replicas(0, 5, clock=clock)
    for _ in range(3):
        reps[0].record_failure()
    clock.now += CONFIG.breaker.cooldown
    router = Router(RouterConfig())
    assert router.dispatch(route("trial", prompt=()), reps, clock.now) is reps[0]
    assert router.dispatch(route("next", prompt=()), reps, clock.now) is reps[1]


async def test_prefix_affinity_follows_the_leading_blocks() -> None:
    reps, engines = await replicas(1, 0)
    router = Router(RouterConfig())
    assert router.choose(route("1", prompt=(*PREFIX, 1, 2, 3)), reps, 0.0) is reps[1]
    engines[0].set_load(running=0)
    engines[1].set_load(running=1)
    await asyncio.gather(*(r.refresh() for r in reps))
    # Same four leading blocks, another tail: b (1 busier) still wins on its cached prefix.
    assert router.choose(route("2", prompt=(*PREFIX, 9, 9)), reps, 0.0) is reps[1]
    # Another prefix goes by load.
    assert router.choose(route("3", prompt=tuple(range(64))), reps, 0.0) is reps[0]
    # Same tokens under another tenant's cache salt share nothing.
    assert router.choose(route("4", prompt=PREFIX, salt="other"), reps, 0.0) is reps[0]


async def test_session_affinity_sticks() -> None:
    reps, engines = await replicas(1, 0)
    router = Router(RouterConfig(prefix_weight=0.0))
    assert router.choose(route("1", prompt=(), session="s1"), reps, 0.0) is reps[1]
    engines[1].set_load(running=3)
    await reps[1].refresh()
    assert router.choose(route("2", prompt=(), session="s1"), reps, 1.0) is reps[1]
    assert router.choose(route("3", prompt=(), session="s2"), reps, 1.0) is reps[0]
    # Forgotten after its time to live: goes by load again.
    assert router.choose(route("4", prompt=(), session="s1"), reps, 1.0 + 901.0) is reps[0]


async def test_session_on_an_unhealthy_replica_moves() -> None:
    reps, engines = await replicas(1, 0)
    router = Router(RouterConfig())
    assert router.choose(route("1", prompt=(), session="s"), reps, 0.0) is reps[1]
    engines[1].health_value = Health(ready=False)
    await reps[1].refresh()
    assert router.choose(route("2", prompt=(), session="s"), reps, 0.0) is reps[0]
    engines[1].health_value = Health(ready=True)
    await reps[1].refresh()
    assert router.choose(route("3", prompt=(), session="s"), reps, 0.0) is reps[0]  # rebound


async def test_escape_hatch_overrides_affinity_when_imbalanced() -> None:
    reps, engines = await replicas(1, 0)
    config = RouterConfig(session_weight=100.0, prefix_weight=100.0, imbalance_margin=4)
    router = Router(config)
    assert router.choose(route("1", session="s"), reps, 0.0) is reps[1]
    engines[0].set_load(running=0)
    engines[1].set_load(running=4)
    await asyncio.gather(*(r.refresh() for r in reps))
    assert router.choose(route("2", session="s"), reps, 0.0) is reps[1]  # within the margin
    engines[1].set_load(running=5)
    await reps[1].refresh()
    assert router.choose(route("3", session="s"), reps, 0.0) is reps[0]


async def test_exclude_fails_over_to_another_replica() -> None:
    reps, _ = await replicas(0, 3)
    router = Router(RouterConfig())
    assert router.choose(route(), reps, 0.0, exclude={"a"}) is reps[1]
    with pytest.raises(NoHealthyReplicaError, match="excluding a, b"):
        router.choose(route(), reps, 0.0, exclude={"a", "b"})


def test_failover_rule() -> None:
    for exc in (EngineDeadError("x"), EngineOverloadedError("x"), ConnectionResetError()):
        assert may_fail_over(exc, first_token_sent=False, attempt=1)
        assert not may_fail_over(exc, first_token_sent=True, attempt=1)
        assert not may_fail_over(exc, first_token_sent=False, attempt=2)
    assert not may_fail_over(EngineRequestError("bad"), first_token_sent=False, attempt=1)
    assert not may_fail_over(TimeoutError(), first_token_sent=False, attempt=1)
    assert is_replica_failure(EngineDeadError("x"))
    assert is_replica_failure(ConnectionRefusedError())
    assert not is_replica_failure(EngineOverloadedError("x"))
    assert not is_replica_failure(EngineRequestError("x"))


def test_session_key() -> None:
    assert session_key("abc", "user-1", tenant="t") == "t\x00abc"
    assert session_key(None, "user-1", tenant="t") == "t\x00user-1"
    assert session_key(None, None) is None
    assert session_key("", "") is None


def test_prefix_hashes_chain_and_memories_are_bounded() -> None:
    a = prefix_block_hashes(list(range(40)), block_size=16, depth=8)
    assert len(a) == 2  # the partial third block is not hashed
    b = prefix_block_hashes([*range(16), 99, *range(17, 40)], block_size=16, depth=8)
    assert a[0] == b[0]
    assert a[1] != b[1]
    assert len(prefix_block_hashes(list(range(1000)), block_size=16, depth=3)) == 3
    assert prefix_block_hashes(list(range(16)), block_size=16, depth=3, salt="t") != a[:1]
    memory = PrefixMemory(3)
    memory.remember(a)
    assert memory.matched(a) == 2
    assert memory.matched(b) == 1
    memory.remember(prefix_block_hashes(list(range(500, 548)), block_size=16, depth=8))
    assert len(memory) == 3
    assert memory.matched(a) == 0  # the oldest hashes were forgotten
    sessions = SessionMemory(2, ttl=10.0)
    for i in range(3):
        sessions.bind(f"s{i}", "a", 0.0)
    assert len(sessions) == 2
    assert sessions.get("s0", 0.0) is None
    assert sessions.get("s2", 10.0) == "a"
    assert sessions.get("s2", 10.1) is None


async def test_end_to_end_on_simulated_engines() -> None:
    clock = FakeClock()
    config = SimulatorConfig(decode_step_s=0.0, decode_step_s_per_seq=0.0, prefill_s_per_token=0.0)
    engines = [SimulatedEngine(config, replica_id=f"sim-{i}") for i in range(2)]
    for engine in engines:
        await engine.start()
    try:
        reps = [
            Replica(e, pool="default", weights_sha256=SHA_A, config=ReplicaConfig(), clock=clock)
            for e in engines
        ]
        await asyncio.gather(*(r.refresh() for r in reps))
        assert reps[0].kv_capacity_tokens == config.kv_capacity_tokens
        router = Router(RouterConfig())
        chosen = {
            await serve(router, reps, route(f"r{i}", prompt=tuple(range(i, i + 40))), 0.0) for i in range(4)
        }
        assert chosen <= set(reps)
        assert all(r.held_tokens == 0 and state(r) == "closed" for r in reps)
    finally:
        for engine in engines:
            await engine.shutdown()


# -- property ---------------------------------------------------------------------------------------------

_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("dispatch"),
            st.integers(0, 300),  # prompt tokens
            st.integers(1, 400),  # max tokens
            st.sampled_from([SHA_A, SHA_B]),
            st.sampled_from([None, "s1", "s2"]),
        ),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 200)),
        st.tuples(st.just("fail"), st.integers(0, 2)),
        st.tuples(st.just("tick"), st.floats(0.0, 20.0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, capacities=st.lists(st.integers(0, 1500), min_size=3, max_size=3))
def test_property_chosen_replica_has_room_and_budget_balances(
    ops: list[tuple[object, ...]], capacities: list[int]
) -> None:
    clock = FakeClock()
    config = ReplicaConfig(growth_reserve_cap=128, breaker=BreakerPolicy(threshold=2, cooldown=10.0))
    reps = [
        make_replica(FakeEngine(f"r{i}"), clock, sha=(SHA_A, SHA_A, SHA_B)[i], config=config, budget=cap)
        for i, cap in enumerate(capacities)
    ]
    router = Router(RouterConfig(prefix_lru_size=8, session_lru_size=2))
    live: list[tuple[str, Replica]] = []
    for n, op in enumerate(ops):
        if op[0] == "dispatch":
            _, prompt, max_tokens, sha, session = op
            assert isinstance(prompt, int)
            assert isinstance(max_tokens, int)
            assert isinstance(sha, str)
            request = route(
                f"q{n}",
                prompt=tuple(range(prompt)),
                max_tokens=max_tokens,
                sha=sha,
                session=session if isinstance(session, str) else None,
            )
            try:
                before = {r.replica_id: r.held_tokens for r in reps}
                chosen = router.choose(request, reps, clock.now)
            except (NoHealthyReplicaError, RequestTooLargeError):
                continue
            if chosen is None:
                assert not any(
                    r.routable and r.weights_sha256 == sha and r.fits(prompt, max_tokens) for r in reps
                )
                continue
            assert chosen.routable
            assert chosen.weights_sha256 == sha
            need = prompt + chosen.growth_reserve(max_tokens)
            assert chosen.kv_capacity_tokens - before[chosen.replica_id] - need >= 0
            chosen.reserve(request.request_id, prompt, chosen.growth_reserve(max_tokens))
            live.append((request.request_id, chosen))
        elif op[0] == "release" and live:
            index = op[1]
            assert isinstance(index, int)
            rid, replica = live.pop(index % len(live))
            assert replica.release(rid)
        elif op[0] == "grow" and live:
            index, tokens = op[1], op[2]
            assert isinstance(index, int)
            assert isinstance(tokens, int)
            rid, replica = live[index % len(live)]
            replica.grow(rid, tokens)
        elif op[0] == "fail":
            index = op[1]
            assert isinstance(index, int)
            reps[index].record_failure()
        elif op[0] == "tick":
            seconds = op[1]
            assert isinstance(seconds, float)
            clock.now += seconds
        for r in reps:
            assert r.held_tokens >= 0
            assert r.in_flight == sum(1 for _, owner in live if owner is r)
    for rid, replica in live:
        assert replica.release(rid)
    assert all(r.held_tokens == 0 and r.in_flight == 0 for r in reps)


def choices(rid: str, n: int, *, per_choice: int = 10, prompt: Sequence[int] = PREFIX) -> RouteRequest:
    """A request for `n` choices of `per_choice` tokens each (the reserve admission asks for: n x max)."""
    return RouteRequest(
        request_id=rid,
        weights_sha256=SHA_A,
        prompt_token_ids=tuple(prompt),
        max_tokens=n * per_choice,
        sequences=n,
    )


async def test_the_choices_of_one_request_spread_over_idle_replicas() -> None:
    reps, _ = await replicas(0, 0)
    router = Router(RouterConfig())
    placement = router.dispatch_choices(choices("r", 2), reps, 0.0)
    assert placement == [reps[0], reps[1]]
    # Each replica holds its choice: the prompt and one choice's reserve, one sequence.
    assert [(r.held_tokens, r.sequences) for r in reps] == [(len(PREFIX) + 10, 1)] * 2
    for r in reps:
        assert r.release("r")
    assert [r.held_tokens for r in reps] == [0, 0]


async def test_choices_go_where_the_load_is_least() -> None:
    reps, _ = await replicas(5, 0)
    router = Router(RouterConfig(prefix_weight=0.0))
    # Each choice placed counts as one more queued sequence: three choices fill the gap of five only partly.
    assert router.place(choices("r", 3, prompt=()), reps, 0.0) == [reps[1]] * 3
    assert router.place(choices("s", 8, prompt=()), reps, 0.0) == [reps[1]] * 5 + [reps[0], reps[1], reps[0]]


async def test_a_cached_prefix_keeps_choices_together_until_their_load_outweighs_it() -> None:
    reps, _ = await replicas(0, 0)
    router = Router(RouterConfig(kv_weight=0.0))
    router.dispatch(route("earlier", prompt=PREFIX), reps[1:], 0.0)  # reps[1] has the prefix
    reps[1].release("earlier")
    # prefix_weight 2 against queue_weight 1 per choice: two choices share the cached prompt, the third
    # is worth the other replica.
    assert router.place(choices("r", 3), reps, 0.0) == [reps[1], reps[1], reps[0]]


async def test_a_request_too_large_for_one_replica_runs_spread_over_two() -> None:
    reps, _ = await replicas(0, 0, capacity=240)
    router = Router(RouterConfig(prefix_weight=0.0))
    prompt = tuple(range(150))
    # Two choices of 60 tokens: 150 + 120 reserved fits no replica alone, 150 + 60 fits each.
    assert not any(r.fits(150, 120, 2) for r in reps)
    assert router.dispatch_choices(choices("r", 2, per_choice=60, prompt=prompt), reps, 0.0) == reps
    # Nothing fits now: a wait. A choice that fits no replica even idle: too large, not a wait.
    assert router.place(choices("s", 2, per_choice=60, prompt=prompt), reps, 0.0) is None
    with pytest.raises(RequestTooLargeError):
        router.place(choices("t", 2, per_choice=60, prompt=tuple(range(250))), reps, 0.0)


async def test_choices_respect_each_replicas_sequence_limit() -> None:
    clock = FakeClock()
    engines = [FakeEngine("a", max_running=1), FakeEngine("b", max_running=4)]
    reps = [make_replica(e, clock, config=msgspec.structs.replace(CONFIG, engine_queue=0)) for e in engines]
    await asyncio.gather(*(r.refresh() for r in reps))
    router = Router(RouterConfig(prefix_weight=0.0))
    router.dispatch(route("busy-a", prompt=()), reps[:1], 0.0)  # "a" runs its one sequence
    router.dispatch(route("busy-b", prompt=()), reps[1:], 0.0)  # "b" has room for three more
    assert router.place(choices("r", 3, prompt=()), reps, 0.0) == [reps[1]] * 3
    assert router.place(choices("s", 4, prompt=()), reps, 0.0) is None
