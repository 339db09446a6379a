"""The guard wrappers the gateway builds: a guard loading in the background tells the cascade how large an
item is for it only once loaded (so a timeout on an oversized item is the item's own, never the breaker's)."""

from __future__ import annotations

import asyncio

from gateway.guards import LoadingGuard
from guard.base import Classifier, GuardError, GuardInput, ItemSized, Span
from tests.guard.fakes import Scripted, Sized

SMALL = GuardInput(direction="input", spans=(Span(text="hi", source="user"),))
LARGE = GuardInput(direction="input", spans=(Span(text="x" * 101, source="user"),))


async def test_a_loading_guard_is_item_sized_through_the_guard_it_loaded() -> None:
    loaded = asyncio.Event()

    async def load() -> Classifier:
        await loaded.wait()
        return Sized("emb@1", limit=100)

    guard = LoadingGuard("emb@1", load)
    assert isinstance(guard, ItemSized)
    # Still loading: a timeout now is the load's (the guard's own), so nothing is oversized.
    assert not guard.oversized(LARGE)
    loaded.set()
    await guard.ready()
    assert guard.oversized(LARGE)
    assert not guard.oversized(SMALL)


async def test_a_loading_guard_of_an_unsized_or_failed_guard_is_never_oversized() -> None:
    async def plain() -> Classifier:
        return Scripted("s@1", 0.0)

    async def broken() -> Classifier:
        raise GuardError("no artifact")

    unsized = LoadingGuard("s@1", plain)
    await unsized.ready()
    assert not unsized.oversized(LARGE)
    failed = LoadingGuard("b@1", broken)
    await asyncio.gather(failed.ready(), return_exceptions=True)
    assert not failed.oversized(LARGE)
