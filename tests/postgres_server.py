"""A private PostgreSQL cluster for fault tests: its own directory, port and socket, never the shared
server on 5432, so a test may stop it, kill it or pause it with SIGSTOP.

PostgreSQL refuses to run as root, so as root every server program runs as the `postgres` user (`runuser`).
The cluster is created once per test session (`initdb` takes a few seconds) and torn down at its end, also
after a failure: whatever state a test left it in (paused, stopped), teardown resumes, stops and deletes it.
Each test works in a schema of its own and leaves the server running (`ensure_running`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import free_port

# Bounds on the server programs: reached only by a hang.
COMMAND_WITHIN = 120.0


def _bin_dir() -> Path:
    """The newest installed PostgreSQL's programs (Debian layout: /usr/lib/postgresql/<major>/bin)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    if not found:
        pytest.fail("PostgreSQL server programs are required: none under /usr/lib/postgresql/*/bin")
    return found[-1].parent


class PrivatePostgres:
    """One PostgreSQL cluster in `root`, listening on 127.0.0.1:`port` (trust authentication)."""

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.data = root / "data"
        self._bin = _bin_dir()
        # As root, run the server programs as the cluster's owner; otherwise as ourselves.
        self._as_owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self._paused: list[int] = []
        self.running = False

    @property
    def dsn(self) -> str:
        """The connection string of its `postgres` database."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    async def _run(self, program: str, *args: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self._as_owner,
            str(self._bin / program),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        async with asyncio.timeout(COMMAND_WITHIN):
            out, _ = await proc.communicate()
        if proc.returncode != 0:
            server_log = self.root / "server.log"
            log = server_log.read_text(errors="replace") if server_log.exists() else ""
            command = " ".join((program, *args))
            raise RuntimeError(f"{command} failed ({proc.returncode}): {out.decode()}\n{log}")

    async def init(self) -> None:
        """Create the cluster (no fsync: a test cluster need not survive a power cut)."""
        await self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    async def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.root / "server.log")
        await self._run("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "-t", "60", "start")
        self.running = True

    async def stop(self) -> None:
        """Stop at once, as a crash would (`-m immediate`): every connection is cut."""
        await self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        self.running = False

    def pids(self) -> list[int]:
        """The postmaster, then every process it forked (backends, background workers)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # the process ended while we looked
            if int(fields[1]) == postmaster:
                children.append(int(stat.parent.name))
        return [postmaster, *children]

    def pause(self) -> None:
        """SIGSTOP the postmaster first (so it forks nothing more), then its children: slow, not dead."""
        self._paused = self.pids()
        for pid in self._paused:
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT everything `pause` stopped."""
        for pid in reversed(self._paused):
            with contextlib.suppress(ProcessLookupError):  # it ended (a stopped process can still be killed)
                os.kill(pid, signal.SIGCONT)
        self._paused = []

    async def ensure_running(self) -> None:
        """Undo whatever a test left: resume it if paused, start it if stopped."""
        self.resume()
        if not self.running:
            await self.start()

    async def destroy(self) -> None:
        """Stop the server (if up) and delete the cluster."""
        self.resume()
        if self.running:
            await self.stop()
        await asyncio.to_thread(shutil.rmtree, self.root, True)


@pytest.fixture(scope="session")
async def private_postgres() -> AsyncIterator[PrivatePostgres]:
    """A private PostgreSQL server for the whole session, deleted at its end; each test leaves it running."""
    root = Path(tempfile.mkdtemp(prefix="lockgate-pg-"))
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
    server = PrivatePostgres(root, free_port())
    try:
        await server.init()
        await server.start()
        yield server
    finally:
        await server.destroy()
