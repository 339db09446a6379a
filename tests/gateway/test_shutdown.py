"""Graceful shutdown of a real `lockgate serve`: SIGTERM drains, then aborts, and leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import MODEL, eventually, free_port

# uvicorn re-raises the SIGTERM it caught once its graceful shutdown is complete, so that a supervisor sees
# the process end by that signal; a crash during shutdown would show another code.
CLEAN_EXIT = (0, -signal.SIGTERM)
STREAM_BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "stream": True,
}


@asynccontextmanager
async def lockgate_serve(
    model_dir: Path, tmp_path: Path, **env: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, dict[str, str]]]:
    """`lockgate serve` in a child process; yields it, its URL and the headers of a consumer key."""
    port = free_port()
    environ = {
        **os.environ,
        "LOCKGATE_MODEL__DATA_DIR": str(model_dir.parent),
        "LOCKGATE_STORAGE__SQLITE_PATH": str(tmp_path / "lockgate.sqlite3"),
        "LOCKGATE_SERVER__PORT": str(port),
        "LOCKGATE_SERVER__LOG_LEVEL": "warning",
        "LOCKGATE_GUARD__DEFAULT_POLICY": "rules",
        # As `make_config`: a loaded test machine must not read as this server's overload.
        "LOCKGATE_OVERLOAD__CPU_SHEDDING": "false",
        **env,
    }
    bootstrap = await asyncio.create_subprocess_exec(
        *(
            sys.executable,
            "-m",
            "gateway.cli",
            "admin",
            "create-key",
            "--tenant",
            "acme",
            "--role",
            "consumer",
        ),
        env=environ,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    key = (await bootstrap.communicate())[0].decode().strip()
    assert bootstrap.returncode == 0
    headers = {"authorization": f"Bearer {key}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", env=environ, stdout=asyncio.subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url) as http:

            async def ready() -> bool:
                assert proc.returncode is None, "lockgate serve exited during start-up"
                try:
                    return (await http.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            # Event-driven (ready, or the process exited); the bound only guards against a hang. The first
            # start on a host (or under another CPU affinity) also measures the engine's step budget.
            await eventually(ready, within=900)
        yield proc, url, headers
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


async def refused(url: str) -> bool:
    """New requests are no longer served: the connection is refused, or (a connection accepted in the instant
    the listener closed) dropped without an answer."""
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            await http.get("/healthz")
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False


async def read_stream(response: httpx.Response, events: list[str]) -> None:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            events.append(line.removeprefix("data: "))


async def test_sigterm_drains_in_flight_streams_and_leaves_no_process(
    model_dir: Path, tmp_path: Path
) -> None:
    async with lockgate_serve(model_dir, tmp_path, LOCKGATE_SERVER__DRAIN_TIMEOUT="60") as (
        proc,
        url,
        headers,
    ):
        children = descendants(proc.pid)
        assert children, "vLLM's engine core runs in a child process"
        events: list[str] = []
        async with (
            httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as http,
            http.stream(
                "POST", "/v1/chat/completions", json={**STREAM_BODY, "max_tokens": 60, "min_tokens": 60}
            ) as response,
        ):
            reader = asyncio.create_task(read_stream(response, events))
            await eventually(lambda: _at_least(events, 3), within=30)
            proc.send_signal(signal.SIGTERM)
            await eventually(lambda: refused(url), within=10)
            await reader
        # The stream that was in flight at SIGTERM ran to its end.
        assert events[-1] == "[DONE]"
        finish = [
            json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]
        ]
        assert finish[-1] == "length"
        async with asyncio.timeout(300):  # the engine shuts down; a hang guard, not a figure
            assert await proc.wait() in CLEAN_EXIT
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"orphan processes: {alive}"


async def _at_least(events: list[str], count: int) -> bool:
    return len(events) >= count


async def test_sigterm_aborts_what_outlives_the_drain_timeout(model_dir: Path, tmp_path: Path) -> None:
    env = {
        "LOCKGATE_ENGINE__KIND": "simulated",
        "LOCKGATE_ENGINE__SIMULATOR__DECODE_STEP_S": "0.05",
        "LOCKGATE_SERVER__DRAIN_TIMEOUT": "1",
    }
    async with lockgate_serve(model_dir, tmp_path, **env) as (proc, url, headers):
        events: list[str] = []
        async with (
            httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as http,
            http.stream("POST", "/v1/chat/completions", json={**STREAM_BODY, "max_tokens": 1500}) as response,
        ):
            reader = asyncio.create_task(read_stream(response, events))
            await eventually(lambda: _at_least(events, 3), within=30)
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.RemoteProtocolError):
                # The server gives up on the stream after the drain timeout and closes the connection.
                await reader
        assert "[DONE]" not in events
        async with asyncio.timeout(30):
            assert await proc.wait() in CLEAN_EXIT
