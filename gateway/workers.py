"""`lockgate serve --workers N`: N gateway processes serving one port.

The parent binds the listening socket and runs uvicorn's process supervisor
(`uvicorn.supervisors.Multiprocess`): the workers are spawned (fresh interpreters, never forked from a
process with threads), share the socket (the kernel spreads connections over them), are replaced when one
dies or stops answering its health pings, and get SIGTERM at shutdown, which each turns into its own
graceful drain (`server.drain_timeout`). A worker that fails its start-up stops the whole server, exit code 3.

Each worker builds the app from the configuration the parent loaded and validated, handed over in the
environment as JSON (`CONFIG_ENV`), so a worker never reads a file or an environment the parent did not.
What the workers share lives outside them, which `config.check_workers` enforces: quotas in Redis, tenants,
registry, audit and appeals in PostgreSQL, console sessions in Redis, engines reached over HTTP. Per
worker: the admission queue and the router's view of each replica (each worker admits against the load the
replicas report, plus what it sent itself since, and leaves the other workers what they used of a remote
replica at its last report: `routing.replicas`), the audit spool (each worker claims a directory of its own,
`policy.audit.spool`), caches.

Metrics: the parent gives the workers a fresh prometheus_client multiprocess directory
(`PROMETHEUS_MULTIPROC_DIR`), so `/metrics`, whichever worker answers it, sums every worker's series; a dead
worker's live gauges are dropped (`mark_process_dead`), its counters stay. The directory is removed at exit.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Multiprocess

from gateway.config import Config
from gateway.observe.multiproc import ENV as METRICS_ENV
from gateway.observe.multiproc import mark_worker_dead
from gateway.server import log_off_the_loop, uvicorn_config

if TYPE_CHECKING:
    from litestar import Litestar

CONFIG_ENV = "LOCKGATE_WORKER_CONFIG"


def app() -> Litestar:
    """The app of one worker (uvicorn's factory, called in the worker process)."""
    from gateway.app import create_app

    config = msgspec.json.decode(os.environ[CONFIG_ENV], type=Config)
    log_off_the_loop(config.server.log_level.upper())
    return create_app(config, freeze_start_up=True)


def serve(config: Config) -> int:
    """Serve with `config.server.workers` processes until SIGINT or SIGTERM; the exit code."""
    metrics_dir = Path(tempfile.mkdtemp(prefix="lockgate-metrics-"))
    os.environ[METRICS_ENV] = str(metrics_dir)
    os.environ[CONFIG_ENV] = msgspec.json.encode(config).decode()
    settings = uvicorn_config(config, f"{__name__}:app", factory=True, workers=config.server.workers)
    listener = settings.bind_socket()
    try:
        supervisor = _Supervisor(settings, [listener], partial(mark_worker_dead, path=metrics_dir))
        supervisor.run()
        return 3 if supervisor.failed_start() else 0
    finally:
        listener.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


class _Supervisor(Multiprocess):
    """uvicorn's supervisor, telling `on_death` the pid of each worker it replaces."""

    def __init__(
        self, config: uvicorn.Config, sockets: list[socket.socket], on_death: Callable[[int], None]
    ) -> None:
        super().__init__(config, sockets=sockets)
        self._on_death = on_death

    def keep_subprocess_alive(self) -> None:
        before = {p.pid for p in self.processes}
        super().keep_subprocess_alive()
        for pid in before - {p.pid for p in self.processes}:
            if pid is not None:
                self._on_death(pid)

    def failed_start(self) -> bool:
        """Whether a worker exited because its start-up failed."""
        return any(p.exitcode == STARTUP_FAILURE for p in self.processes)
