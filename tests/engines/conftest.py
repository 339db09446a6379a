"""Fixtures for the engine tests: `contract_engine` yields every Engine the contract suite must hold for."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from engines.base import Engine
from engines.simulated import SimulatedEngine, SimulatorConfig


async def _build(kind: str) -> Engine:
    """Build and start one engine of the given kind."""
    if kind == "simulated":
        # Fast steps on the real clock: the contract polls load() as it would poll a real engine.
        config = SimulatorConfig(
            decode_step_s=0.001, decode_step_s_per_seq=0.0001, prefill_s_per_token=0.00001
        )
        engine = SimulatedEngine(config, replica_id="contract-sim")
        await engine.start()
        return engine
    raise ValueError(f"unknown engine kind {kind!r}")


@pytest_asyncio.fixture(scope="module", params=["simulated"], ids=str)
async def contract_engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    """A started engine of each kind; module-scoped because a real engine is slow to build."""
    engine = await _build(request.param)
    try:
        yield engine
    finally:
        await engine.shutdown()
