"""The registry refresher when its store fails, hangs or raises what nobody expected: it keeps the last
view, reports how stale it is (clock injected), never dies of an error, and recovers by itself.

The refresher's sleep is stepped by the test; `refresh_timeout` is real time, kept short, and nothing here
asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Literal, cast

import pytest

from registry import Registry, RegistryStore, UnavailableError
from tests.backends import FakeClock
from tests.registry import specs
from tests.registry.test_service import StepSleep

MAX_STALENESS = 30.0
REFRESH_TIMEOUT = 0.05

Mode = Literal["up", "down", "hang", "stuck", "bug"]


class SwitchedStore:
    """A registry store whose generation() answers, fails as unreachable, hangs, or raises a bug.

    "stuck" hangs and ignores cancellation until released, as a driver does that waits for a paused server
    to confirm a cancelled query."""

    def __init__(self, inner: RegistryStore) -> None:
        self.inner = inner
        self.mode: Mode = "up"
        self.release = asyncio.Event()
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def generation(self) -> int:
        self.calls += 1
        if self.mode == "stuck":
            while not self.release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await self.release.wait()
        if self.mode == "down":
            raise UnavailableError("database down")
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "bug":
            raise KeyError("a bug")
        return await self.inner.generation()


class Replica:
    """A second registry on the switched store, its refresher running on a stepped sleep."""

    def __init__(self, registry: Registry, store: SwitchedStore, clock: FakeClock, sleep: StepSleep) -> None:
        self.registry = registry
        self.store = store
        self.clock = clock
        self.sleep = sleep


@pytest.fixture
async def replica(registry: Registry) -> AsyncIterator[Replica]:
    store = SwitchedStore(registry.store)
    clock = FakeClock()
    sleep = StepSleep()
    live = await Registry.load(
        cast(RegistryStore, store), clock, 0.25, refresh_timeout=REFRESH_TIMEOUT, sleep=sleep
    )
    task = asyncio.create_task(live.run_refresher())
    await sleep.asleep()
    yield Replica(live, store, clock, sleep)
    store.release.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_failing_store_makes_the_registry_stale_with_its_age(
    replica: Replica, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    health = replica.registry.health(MAX_STALENESS)
    assert (health.ready, health.age_s, health.refresher) == (True, 0.0, "running")
    replica.store.mode = "down"
    with caplog.at_level(logging.WARNING, logger="lockgate.registry"):
        await replica.sleep.step()
    assert "database down" in caplog.text
    replica.clock.advance(MAX_STALENESS)
    await replica.sleep.step()
    health = replica.registry.health(MAX_STALENESS)
    assert (health.ready, health.stale, health.age_s) == (True, False, MAX_STALENESS)  # not past it yet
    replica.clock.advance(1)
    health = replica.registry.health(MAX_STALENESS)
    assert (health.ready, health.stale, health.age_s) == (False, True, MAX_STALENESS + 1)
    assert health.consecutive_failures == 2
    assert health.last_error is not None
    assert "database down" in health.last_error
    assert replica.registry.view.generation == 0  # the last view is still served

    await specs.seed(registry, "1")  # a change made elsewhere meanwhile
    replica.store.mode = "up"
    await replica.sleep.step()
    health = replica.registry.health(MAX_STALENESS)
    assert (health.ready, health.age_s, health.consecutive_failures, health.last_error) == (
        True,
        0.0,
        0,
        None,
    )
    assert replica.registry.resolve_model("chat", "r").ref == "chat@1"


async def test_a_hanging_store_times_out_and_is_never_stacked(replica: Replica) -> None:
    replica.store.mode = "hang"
    await replica.sleep.step()  # the tick ends (the refresh timed out) while the store still hangs
    health = replica.registry.health(MAX_STALENESS)
    assert health.consecutive_failures == 1
    assert health.last_error is not None
    assert "longer than" in health.last_error
    replica.clock.advance(MAX_STALENESS + 1)
    assert replica.registry.health(MAX_STALENESS).stale

    replica.store.mode = "up"
    replica.store.release.set()  # the hung call returns; the cancelled refresh is gone
    await replica.sleep.step()
    health = replica.registry.health(MAX_STALENESS)
    assert (health.stale, health.consecutive_failures) == (False, 0)


async def test_a_refresh_whose_cancellation_hangs_is_not_stacked_with_another(replica: Replica) -> None:
    replica.store.mode = "stuck"
    await replica.sleep.step()
    await replica.sleep.step()
    health = replica.registry.health(MAX_STALENESS)
    assert health.consecutive_failures == 2
    assert health.last_error is not None
    assert "still stuck" in health.last_error
    assert replica.store.calls == 2  # the load and the first tick: the second tick asked nothing
    replica.store.mode = "up"
    replica.store.release.set()  # the stuck refresh goes on and succeeds: that counts
    async with asyncio.timeout(10):
        while replica.registry.health(MAX_STALENESS).consecutive_failures:  # noqa: ASYNC110 - its own task
            await asyncio.sleep(0)
    await replica.sleep.step()
    assert replica.registry.health(MAX_STALENESS).consecutive_failures == 0
    assert replica.store.calls == 3


async def test_an_unexpected_exception_is_logged_and_the_refresher_goes_on(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    replica.store.mode = "bug"
    with caplog.at_level(logging.ERROR, logger="lockgate.registry"):
        await replica.sleep.step()
        await replica.sleep.step()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert all(r.exc_info and isinstance(r.exc_info[1], KeyError) for r in errors)  # with the traceback
    health = replica.registry.health(MAX_STALENESS)
    assert (health.refresher, health.consecutive_failures) == ("running", 2)
    replica.store.mode = "up"
    await replica.sleep.step()
    assert replica.registry.health(MAX_STALENESS).consecutive_failures == 0


async def test_a_refresher_that_ended_makes_the_registry_not_ready(registry: Registry) -> None:
    sleep = StepSleep()
    live = Registry(registry.store, FakeClock(), sleep=sleep)
    assert live.health(MAX_STALENESS).refresher == "not_started"
    task = asyncio.create_task(live.run_refresher())
    await sleep.asleep()
    assert live.health(MAX_STALENESS).ready
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    health = live.health(MAX_STALENESS)
    assert (health.refresher, health.stale, health.ready) == ("stopped", False, False)
    with pytest.raises(ValueError, match="refresh_timeout"):
        Registry(registry.store, FakeClock(), refresh_timeout=0)
