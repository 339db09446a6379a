"""`Replica`: KV budget accounting, load refresh and the circuit breaker, on fake engines and a fake clock.

`FakeEngine` and `FakeClock` are imported by the router tests too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

import msgspec
import pytest

from engines.base import (
    Engine,
    EngineDeadError,
    EngineDelta,
    EngineDrainingError,
    EngineLoad,
    EngineRequest,
    Health,
    Usage,
)
from engines.breaker import BreakerPolicy
from routing.config import ReplicaConfig
from routing.replicas import Replica, ReplicaUnavailableError, kv_tokens_for_bytes
from tests.registry.specs import LLAMA3_8B

SHA_A = "a" * 64
SHA_B = "b" * 64


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """An engine whose load and health are whatever the test sets; `generate` fails with `fail` if set."""

    def __init__(
        self,
        replica_id: str,
        *,
        capacity: int = 1000,
        running: int = 0,
        waiting: int = 0,
        max_running: int = 0,
    ) -> None:
        self.replica_id = replica_id
        self.model_name = "fake"
        self.max_model_len = 4096
        self.load_value = EngineLoad(
            running=running,
            waiting=waiting,
            kv_tokens_used=0,
            kv_tokens_capacity=capacity,
            max_running=max_running,
        )
        self.health_value = Health(ready=True)
        self.raise_on_check: Exception | None = None
        self.hang = False  # health() never returns (a hung engine)
        self.fail: Exception | None = None
        self.health_calls = 0

    def set_load(
        self, *, running: int = 0, waiting: int = 0, used: int = 0, capacity: int | None = None
    ) -> None:
        """Report this load from now on (the same sequence limit)."""
        cap = self.load_value.kv_tokens_capacity if capacity is None else capacity
        self.load_value = msgspec.structs.replace(
            self.load_value, running=running, waiting=waiting, kv_tokens_used=used, kv_tokens_capacity=cap
        )

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        """One token, or the configured failure before it."""
        if self.fail is not None:
            raise self.fail
        yield EngineDelta(
            token_ids=(1,),
            text="x",
            finish_reason="stop",
            usage=Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=1),
        )

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        """Not used by routing."""
        return {t: 0.0 for t in token_ids}

    async def load(self) -> EngineLoad:
        """The load the test set."""
        if self.raise_on_check is not None:
            raise self.raise_on_check
        return self.load_value

    async def health(self) -> Health:
        """The health the test set (or an error, or a hang)."""
        self.health_calls += 1
        if self.raise_on_check is not None:
            raise self.raise_on_check
        if self.hang:
            await asyncio.Event().wait()
        return self.health_value

    async def start(self) -> None:
        """Nothing to start."""

    async def shutdown(self) -> None:
        """Nothing to stop."""


def state(replica: Replica) -> str:
    """The breaker state, as a plain str (mypy keeps a property's literal narrowed across calls)."""
    return replica.breaker_state


CONFIG = ReplicaConfig(growth_reserve_cap=100, breaker=BreakerPolicy(threshold=3, cooldown=10.0))


def make_replica(
    engine: FakeEngine,
    clock: FakeClock,
    *,
    sha: str = SHA_A,
    config: ReplicaConfig = CONFIG,
    budget: int | None = None,
) -> Replica:
    """A replica of `engine` serving weights `sha` (`budget`: its KV byte budget in tokens)."""
    return Replica(
        engine, pool="default", weights_sha256=sha, config=config, clock=clock, kv_budget_tokens=budget
    )


async def test_fake_engine_is_an_engine() -> None:
    assert isinstance(FakeEngine("a"), Engine)


async def test_capacity_comes_from_the_engine_after_refresh() -> None:
    engine, clock = FakeEngine("a", capacity=1000), FakeClock()
    replica = make_replica(engine, clock)
    assert replica.kv_capacity_tokens == 0
    assert not replica.fits(1, 1)  # nothing fits before the first report: requests stay queued
    await replica.refresh()
    assert replica.kv_capacity_tokens == 1000
    assert replica.last_load == engine.load_value
    engine.set_load(capacity=2000)
    await replica.refresh()
    assert replica.kv_capacity_tokens == 2000


async def test_a_byte_budget_converts_with_the_registry_bytes_per_token() -> None:
    per_token = LLAMA3_8B.kv_bytes_per_token()
    assert per_token == 2 * 32 * 8 * 128 * 2
    assert kv_tokens_for_bytes(8 * 2**30, per_token) == 65536
    assert kv_tokens_for_bytes(per_token - 1, per_token) == 0
    with pytest.raises(ValueError, match="positive"):
        kv_tokens_for_bytes(100, 0)


async def test_a_byte_budget_gives_capacity_before_the_engine_reports_and_bounds_it_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine("a", capacity=0)  # reports no capacity (a remote server without cache_config_info)
    replica = make_replica(engine, FakeClock(), budget=500)
    assert replica.kv_capacity_tokens == 500
    assert replica.fits(100, 100)  # the budget alone lets requests in before any report
    await replica.refresh()
    assert replica.kv_capacity_tokens == 500
    engine.set_load(capacity=480)  # within a tenth of the budget: agreement, nothing said
    with caplog.at_level("WARNING", logger="lockgate.routing"):
        await replica.refresh()
    assert replica.kv_capacity_tokens == 480
    assert not caplog.records
    engine.set_load(capacity=2000)  # KV kept in another dtype than the registry assumes
    with caplog.at_level("WARNING", logger="lockgate.routing"):
        await replica.refresh()
        await replica.refresh()
    assert replica.kv_capacity_tokens == 500  # the smaller holds
    [record] = caplog.records  # said once
    assert "reports 2000 KV tokens" in record.getMessage()
    assert "gives 500" in record.getMessage()
    engine.set_load(capacity=200)
    await replica.refresh()
    assert replica.kv_capacity_tokens == 200


async def test_growth_reserve_is_capped() -> None:
    replica = make_replica(FakeEngine("a"), FakeClock())
    assert replica.growth_reserve(5) == 5
    assert replica.growth_reserve(100) == 100
    assert replica.growth_reserve(100_000) == 100


async def test_kv_budget_reserve_and_release() -> None:
    replica = make_replica(FakeEngine("a", capacity=1000), FakeClock())
    await replica.refresh()
    # 800 prompt + min(5000, 100) reserve = 900 of 1000.
    assert replica.fits(800, 5000)
    replica.reserve("r1", 800, replica.growth_reserve(5000))
    assert replica.held_tokens == 900
    assert replica.fits(50, 50)  # exactly 1000: capacity - held - need == 0 fits
    assert not replica.fits(50, 51)
    with pytest.raises(ReplicaUnavailableError, match="no room"):
        replica.reserve("r2", 50, 51)
    with pytest.raises(ValueError, match="already holds"):
        replica.reserve("r1", 1, 1)
    assert replica.release("r1")
    assert not replica.release("r1")  # a second release is a no-op
    assert replica.held_tokens == 0
    assert replica.fits(50, 51)


async def test_sequences_in_flight_stay_within_the_engines_limit_plus_its_queue() -> None:
    # The engine runs 2 sequences at once; 1 more may wait in its own queue.
    config = msgspec.structs.replace(CONFIG, engine_queue=1)
    replica = make_replica(FakeEngine("a", capacity=100_000, max_running=2), FakeClock(), config=config)
    assert replica.sequence_limit == 0  # nothing reported yet: no limit but the KV budget's
    await replica.refresh()
    assert replica.sequence_limit == 3
    replica.reserve("r1", 10, 10)
    replica.reserve("r2", 10, 10, sequences=2)  # two choices: two sequences
    assert replica.sequences == 3
    assert not replica.fits(10, 10)  # plenty of KV, no sequence
    with pytest.raises(ReplicaUnavailableError, match="no room"):
        replica.reserve("r3", 10, 10)
    replica.release("r1")
    assert replica.sequences == 2
    assert replica.fits(10, 10)
    assert not replica.fits(10, 10, sequences=2)
    replica.release("r2")
    # An idle replica takes a request of more choices than the limit: nothing else could ever make room.
    assert replica.fits(10, 10, sequences=5)
    replica.reserve("r4", 10, 10, sequences=5)
    assert replica.sequences == 5
    assert not replica.fits(1, 1)
    replica.release("r4")
    assert replica.sequences == 0


async def test_an_engine_that_does_not_report_its_limit_is_bounded_by_kv_alone() -> None:
    replica = make_replica(FakeEngine("a", capacity=100_000), FakeClock())
    await replica.refresh()
    for i in range(50):
        replica.reserve(f"r{i}", 10, 10)
    assert replica.sequences == 50
    assert replica.fits(10, 10)


async def test_processes_sharing_an_engine_leave_the_others_their_sequences() -> None:
    # Two gateway processes dispatch to an engine of 4 sequences (no queue); the other one runs 3 there.
    config = msgspec.structs.replace(CONFIG, engine_queue=0)
    engine = FakeEngine("a", capacity=100_000, max_running=4, running=3)
    shared = Replica(
        engine, pool="default", weights_sha256=SHA_A, config=config, clock=FakeClock(), shared_by=2
    )
    alone = make_replica(engine, FakeClock(), config=config)
    await shared.refresh()
    await alone.refresh()
    for i in range(2):  # 4 - 3 = 1, but never less than an even share of 4 // 2 = 2
        assert shared.fits(10, 10)
        shared.reserve(f"r{i}", 10, 10)
    assert not shared.fits(10, 10)
    for i in range(4):  # one process counts nothing of the report: all 4 are its own
        alone.reserve(f"r{i}", 10, 10)
    assert not alone.fits(10, 10)
    # The next report shows the other process gone: 2 running, both this process's own.
    engine.set_load(running=2)
    await shared.refresh()
    for i in range(2, 4):
        assert shared.fits(10, 10)
        shared.reserve(f"r{i}", 10, 10)
    assert not shared.fits(10, 10)
    # The other process is back with 4: this one keeps its even share (its 4 are reported with them).
    engine.set_load(running=4, waiting=4)
    await shared.refresh()
    assert not shared.fits(10, 10)
    shared.release("r0")
    shared.release("r1")
    assert not shared.fits(10, 10)  # 2 of its own in flight: its share
    shared.release("r2")
    assert shared.fits(10, 10)


async def test_processes_sharing_an_engine_leave_the_others_their_kv() -> None:
    engine = FakeEngine("a", capacity=1000)
    replica = Replica(
        engine, pool="default", weights_sha256=SHA_A, config=CONFIG, clock=FakeClock(), shared_by=2
    )
    engine.set_load(used=700)  # the other process's requests hold 700 tokens of the cache
    await replica.refresh()
    # With nothing of its own in flight a process takes any request that fits the whole cache.
    assert replica.fits(800, 100)
    replica.reserve("big", 800, 100)
    assert not replica.fits(1, 0)
    replica.release("big")
    replica.reserve("r1", 200, 100)  # holds 300 of the budget: its prompt and a reserve of 100
    # 1000 - 700 = 300 would leave it nothing more; its even share is 500.
    assert replica.fits(150, 50)
    assert not replica.fits(150, 51)
    # The next report: 500 used, of which this process's prompt of 200 and 50 tokens of output (the engine
    # allocates no reserve ahead): the other's part is 250.
    replica.grow("r1", 50)
    engine.set_load(used=500)
    await replica.refresh()
    assert replica.fits(400, 50)  # 300 held + 450 = 750 = 1000 - 250
    assert not replica.fits(400, 51)
    with pytest.raises(ValueError, match="shared_by"):
        Replica(engine, pool="default", weights_sha256=SHA_A, config=CONFIG, clock=FakeClock(), shared_by=0)


class SharedEngine(FakeEngine):
    """An engine that reports as running every sequence the gateway processes in `processes` hold."""

    def __init__(self, max_running: int) -> None:
        super().__init__("shared", capacity=100_000, max_running=max_running)
        self.processes: list[Replica] = []

    async def load(self) -> EngineLoad:
        """The sequences every process holds, running."""
        running = sum(p.sequences for p in self.processes)
        return msgspec.structs.replace(self.load_value, running=running)


async def test_two_processes_on_one_engine_settle_at_its_limit_each_keeping_its_share() -> None:
    config = msgspec.structs.replace(CONFIG, engine_queue=0)
    engine = SharedEngine(max_running=8)
    a, b = (
        Replica(engine, pool="default", weights_sha256=SHA_A, config=config, clock=FakeClock(), shared_by=2)
        for _ in range(2)
    )
    engine.processes = [a, b]

    def fill(process: Replica, name: str) -> int:
        taken = 0
        while process.fits(10, 10):
            process.reserve(f"{name}{process.sequences}-{taken}", 10, 10)
            taken += 1
        return taken

    for process in (a, b):
        await process.refresh()
    assert fill(a, "a") == 8  # alone on the engine
    await b.refresh()
    assert fill(b, "b") == 4  # its even share, while `a` still holds all 8: 12 until the next report
    for process in (a, b):
        await process.refresh()
    assert fill(a, "a") == fill(b, "b") == 0
    # As their requests end, neither takes more than its share back: the engine settles at its limit.
    for process, name in ((a, "a"), (b, "b")):
        for held in [f"{name}{i}-{i}" for i in range(process.sequences)][:5]:
            process.release(held)
    assert (a.sequences, b.sequences) == (3, 0)
    assert fill(a, "a") == 1
    assert fill(b, "b") == 4
    assert a.sequences + b.sequences == 8
    for process in (a, b):
        await process.refresh()
    assert fill(a, "a") == fill(b, "b") == 0


async def test_grow_counts_output_past_the_reserve() -> None:
    replica = make_replica(FakeEngine("a", capacity=1000), FakeClock())
    await replica.refresh()
    replica.reserve("r1", 100, 50)
    replica.grow("r1", 30)
    assert replica.held_tokens == 150  # within the reserve: no change
    replica.grow("r1", 40)
    assert replica.held_tokens == 170  # 70 output tokens > 50 reserved
    replica.grow("unknown", 10)
    replica.release("r1")
    assert replica.held_tokens == 0


async def test_load_is_the_last_reports_other_work_plus_own_requests_now() -> None:
    engine = FakeEngine("a", running=3, waiting=1)
    replica = make_replica(engine, FakeClock())
    await replica.refresh()
    assert replica.queue_depth == 4  # others' work only
    replica.reserve("r1", 10, 10)
    replica.reserve("r2", 10, 10)
    assert replica.queue_depth == 6  # own requests count at once, before a report shows them
    engine.set_load(running=5, waiting=1, used=40)
    await replica.refresh()
    assert replica.queue_depth == 6  # the report's 6 include the two own ones: not counted twice
    # 40 KV tokens used, 20 of them the own prompts: others use 20, own requests hold 40 with reserves.
    assert replica.kv_utilisation == pytest.approx(0.06)
    # Own requests that end after the report stop counting at once: the report is stale about them.
    replica.release("r1")
    replica.release("r2")
    assert replica.queue_depth == 4
    assert replica.kv_utilisation == pytest.approx(0.02)


async def test_fatal_errors_open_the_breaker_then_half_open_trial_closes_it() -> None:
    clock = FakeClock()
    replica = make_replica(FakeEngine("a"), clock)
    await replica.refresh()
    for _ in range(3):
        assert replica.routable
        replica.record_failure()
    assert state(replica) == "open"
    assert not replica.routable
    with pytest.raises(ReplicaUnavailableError, match="out of service"):
        replica.reserve("r1", 1, 1)
    clock.now += 10.0
    assert state(replica) == "half_open"
    assert replica.routable
    replica.reserve("trial", 1, 1)
    assert not replica.routable  # one trial at a time
    with pytest.raises(ReplicaUnavailableError):
        replica.reserve("r2", 1, 1)
    replica.record_success()
    replica.release("trial")
    assert state(replica) == "closed"
    assert replica.routable


async def test_failed_trial_reopens_and_an_ended_trial_closes() -> None:
    clock = FakeClock()
    replica = make_replica(FakeEngine("a"), clock)
    await replica.refresh()
    for _ in range(3):
        replica.record_failure()
    clock.now += 10.0
    replica.reserve("trial", 1, 1)
    replica.record_failure()
    replica.release("trial")
    assert state(replica) == "open"
    clock.now += 10.0
    replica.reserve("trial2", 1, 1)
    replica.release("trial2")  # ended without a fatal error: the engine served it
    assert state(replica) == "closed"


async def test_a_replica_that_is_not_ready_is_out_until_it_is_ready_again() -> None:
    clock, engine = FakeClock(), FakeEngine("a")
    replica = make_replica(engine, clock)
    await replica.refresh()
    engine.health_value = Health(ready=False, detail="restarting")
    for _ in range(5):
        await replica.refresh()
        assert not replica.routable  # at once
    # An honest "not ready" (an engine restarting) is no fault: back as soon as it says ready.
    assert state(replica) == "closed"
    engine.health_value = Health(ready=True)
    await replica.refresh()
    assert replica.routable


async def test_failed_health_checks_take_the_replica_out_then_a_probe_brings_it_back() -> None:
    clock, engine = FakeClock(), FakeEngine("a")
    replica = make_replica(engine, clock)
    await replica.refresh()
    engine.raise_on_check = EngineDeadError("connection refused")
    await replica.refresh()
    assert not replica.routable  # at once, before the breaker opens
    assert state(replica) == "closed"
    await replica.refresh()
    await replica.refresh()
    assert state(replica) == "open"
    engine.raise_on_check = None
    calls = engine.health_calls
    await replica.refresh()
    assert engine.health_calls == calls  # not asked while open
    clock.now += 10.0
    engine.health_value = Health(ready=True)
    await replica.refresh()  # the half-open probe
    assert state(replica) == "closed"
    assert replica.routable


async def test_failed_probe_reopens() -> None:
    clock, engine = FakeClock(), FakeEngine("a")
    replica = make_replica(engine, clock)
    engine.raise_on_check = EngineDeadError("gone")
    for _ in range(3):
        await replica.refresh()
    assert state(replica) == "open"
    assert "EngineDeadError: gone" in replica.health_detail
    clock.now += 10.0
    await replica.refresh()
    assert state(replica) == "open"
    assert not replica.routable


async def test_a_trial_request_holds_the_slot_so_refresh_only_reads_load() -> None:
    clock, engine = FakeClock(), FakeEngine("a")
    replica = make_replica(engine, clock)
    await replica.refresh()
    for _ in range(3):
        replica.record_failure()
    clock.now += 10.0
    replica.reserve("trial", 1, 1)
    calls = engine.health_calls
    engine.set_load(running=1)
    await replica.refresh()
    assert engine.health_calls == calls
    assert replica.queue_depth == 1
    assert state(replica) == "half_open"


async def test_refresh_is_bounded_by_its_timeout() -> None:
    config = ReplicaConfig(refresh_timeout=0.01, breaker=BreakerPolicy(threshold=1, cooldown=10.0))
    engine = FakeEngine("a")
    replica = make_replica(engine, FakeClock(), config=config)
    engine.hang = True
    await replica.refresh()
    assert not replica.routable
    assert state(replica) == "open"
    assert "TimeoutError" in replica.health_detail


async def test_a_cancelled_probe_does_not_hold_the_trial_slot() -> None:
    clock, engine = FakeClock(), FakeEngine("a")
    replica = make_replica(engine, clock)
    await replica.refresh()
    for _ in range(3):
        replica.record_failure()
    clock.now += 10.0
    engine.hang = True
    task = asyncio.create_task(replica.refresh())
    await asyncio.sleep(0)
    assert not replica.routable  # the probe holds the slot
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert state(replica) == "open"
    clock.now += 10.0
    engine.hang = False
    await replica.refresh()
    assert state(replica) == "closed"


async def test_a_replica_that_refused_work_for_shutting_down_is_out_until_it_has_left() -> None:
    clock, engine = FakeClock(), FakeEngine("a")
    replica = make_replica(engine, clock)
    await replica.refresh()
    # A vLLM told to stop answers new requests with an empty stream while /health still says ready (and a
    # request sent in its teardown would hang): out of routing, whatever the health checks say.
    await replica.judge_failure(EngineDrainingError("shutting down"))
    assert replica.draining
    assert not replica.routable
    for _ in range(5):
        clock.now += 1.0
        await replica.refresh()
        assert not replica.routable
    assert state(replica) == "closed"  # a drain is not a fault: nothing counts toward the breaker
    # The process has left: the checks fail, and its successor is judged by the health checks afresh.
    engine.raise_on_check = EngineDeadError("connection refused")
    await replica.refresh()
    assert not replica.draining
    engine.raise_on_check = None
    await replica.refresh()
    assert replica.routable


async def test_a_drain_that_never_ends_lapses_after_its_hold() -> None:
    clock, engine = FakeClock(), FakeEngine("a")
    replica = make_replica(engine, clock)
    await replica.judge_failure(EngineDrainingError("shutting down"))
    clock.now += CONFIG.drain_hold - 1
    assert not replica.routable
    clock.now += 2
    assert replica.routable  # a refusal that was no drain (or a drain that stalled) does not ban it for good
