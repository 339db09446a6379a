"""Fixtures for the engine tests: `contract_engine` yields every Engine the contract suite must hold for; the
remote one runs on the session's real `vllm serve` replica (`vllm_server`, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from engines.base import Engine, EngineError
from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.vllm_remote import RemoteEngineConfig, VllmRemoteEngine
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, SESSION_DIR
from tests.vllm_server import MAX_NUM_SEQS, SERVER_START_TIMEOUT


@pytest_asyncio.fixture(scope="module")
async def contract_simulator() -> AsyncIterator[SimulatedEngine]:
    """A simulator with fast steps on the real clock: the contract polls load() as it would a real engine."""
    config = SimulatorConfig(decode_step_s=0.001, decode_step_s_per_seq=0.0001, prefill_s_per_token=0.00001)
    simulator = SimulatedEngine(config, replica_id="contract-sim")
    await simulator.start()
    yield simulator
    await simulator.shutdown()


@pytest.fixture(
    scope="module",
    params=["contract_simulator", "vllm_engine", "vllm_remote"],
    ids=["simulated", "vllm_local", "vllm_remote"],
)
def contract_engine(request: pytest.FixtureRequest) -> Engine:
    """A started engine of each kind: the simulator, the session's in-process vLLM engine, and a remote
    engine on the session's real `vllm serve` replica."""
    engine: Engine = request.getfixturevalue(request.param)
    return engine


@pytest.fixture(scope="session")
async def vllm_remote(vllm_server: str, renderer: PromptRenderer) -> AsyncIterator[VllmRemoteEngine]:
    """A remote engine on the session's real server (started: /health answered and the model checked)."""
    config = RemoteEngineConfig(
        url=vllm_server,
        served_model=MODEL,
        max_model_len=2048,
        first_token_timeout=120.0,
        token_timeout=60.0,
        pool_size=16,
        # The contract polls load() for ~2 s after a close: scrape often enough to see it.
        metrics_interval=0.2,
        start_timeout=SERVER_START_TIMEOUT,
        max_num_seqs=MAX_NUM_SEQS,
    )
    tokenizer = renderer.tokenizer
    engine = VllmRemoteEngine(config, token_text=lambda t: str(tokenizer.decode([t])))
    try:
        await engine.start()
    except EngineError as exc:
        log = SESSION_DIR.glob("vllm-server-*.log")
        tail = "\n".join(p.read_text(errors="replace")[-3000:] for p in log)
        raise RuntimeError(f"the vLLM server did not come up: {exc}\n{tail}") from exc
    yield engine
    await engine.shutdown()
