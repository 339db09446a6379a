"""Private `redis-server` processes for fault and cluster tests: their own ports and directories, never the
shared server on 6379. Start-up waits on the server's own "ready" line, not on a timer."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import redis.asyncio

from tests.conftest import free_port

READY = b"Ready to accept connections"
START_WITHIN = 30.0


class RedisServer:
    """One `redis-server` process on 127.0.0.1:`port`, without persistence, in `directory`."""

    def __init__(self, port: int, directory: Path, *extra: str) -> None:
        self.port = port
        self.directory = directory
        self.extra = extra
        self._proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """The server's URL."""
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        """Start the process and wait (bounded) until it says it accepts connections."""
        self.directory.mkdir(parents=True, exist_ok=True)
        proc = await asyncio.create_subprocess_exec(
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            *self.extra,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self._proc = proc
        assert proc.stdout is not None
        log: list[bytes] = []
        try:
            async with asyncio.timeout(START_WITHIN):
                while READY not in (line := await proc.stdout.readline()):
                    if not line:
                        raise RuntimeError(f"redis-server on {self.port} exited: {b''.join(log)!r}")
                    log.append(line)
        except BaseException:
            await self.kill()
            raise
        # Keep reading its log so a full pipe never blocks the server.
        self._drain = asyncio.create_task(_discard(proc.stdout))

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (slow, not dead)."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    async def kill(self) -> None:
        """SIGKILL the process (resumed first if paused) and reap it; its data is gone."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        await proc.wait()
        if self._drain is not None:
            await asyncio.gather(self._drain, return_exceptions=True)
            self._drain = None


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


@asynccontextmanager
async def redis_server(directory: Path) -> AsyncIterator[RedisServer]:
    """A private Redis on a free port; killed afterwards whatever happened."""
    server = RedisServer(free_port(), directory)
    try:
        await server.start()
        yield server
    finally:
        await server.kill()


async def _cluster_ok(port: int) -> bool:
    client = redis.asyncio.Redis(host="127.0.0.1", port=port)
    try:
        info = await client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    finally:
        await client.aclose()
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


@asynccontextmanager
async def redis_cluster(directory: Path, masters: int = 3) -> AsyncIterator[list[RedisServer]]:
    """A Redis Cluster of `masters` private primaries (no replicas) on ports of its own, formed with
    `redis-cli --cluster create`; every process is killed afterwards."""
    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(masters):
            port = free_port()
            node = RedisServer(
                port,
                directory / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                # An explicit bus port: port + 10000 (the default) may be taken or out of range.
                "--cluster-port",
                str(free_port()),
                "--cluster-node-timeout",
                "5000",
            )
            stack.push_async_callback(node.kill)
            await node.start()
            nodes.append(node)
        create = await asyncio.create_subprocess_exec(
            "redis-cli",
            "--cluster",
            "create",
            *(f"127.0.0.1:{node.port}" for node in nodes),
            "--cluster-replicas",
            "0",
            "--cluster-yes",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        async with asyncio.timeout(60):
            out, _ = await create.communicate()
        assert create.returncode == 0, out.decode(errors="replace")
        # Gossip has no event to wait on: poll each node's view, bounded.
        async with asyncio.timeout(30):
            for node in nodes:
                while not await _cluster_ok(node.port):  # noqa: ASYNC110 - polling another process's state
                    await asyncio.sleep(0.05)
        yield nodes
