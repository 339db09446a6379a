"""Fixtures for the engine tests: `contract_engine` yields every Engine the contract suite must hold for."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from engines.base import Engine
from engines.simulated import SimulatedEngine, SimulatorConfig


@pytest_asyncio.fixture(scope="module")
async def contract_simulator() -> AsyncIterator[SimulatedEngine]:
    """A simulator with fast steps on the real clock: the contract polls load() as it would a real engine."""
    config = SimulatorConfig(decode_step_s=0.001, decode_step_s_per_seq=0.0001, prefill_s_per_token=0.00001)
    simulator = SimulatedEngine(config, replica_id="contract-sim")
    await simulator.start()
    yield simulator
    await simulator.shutdown()


@pytest.fixture(scope="module", params=["contract_simulator", "vllm_engine"], ids=["simulated", "vllm_local"])
def contract_engine(request: pytest.FixtureRequest) -> Engine:
    """A started engine of each kind: the simulator, and the session's real vLLM engine."""
    engine: Engine = request.getfixturevalue(request.param)
    return engine
