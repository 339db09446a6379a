"""The soak benchmark's gateway: `lockgate serve` (one process, configured from the environment) with two
signal hooks the benchmark uses.

    SIGUSR1  kill the active engine as its process dying would: the simulator's `kill()`, or SIGKILL to an
             in-process vLLM engine's core processes. The engine's supervisor notices and restarts it.
    SIGUSR2  log how many of the engines killed so far (for vLLM: the engine and its `AsyncLLM`, two
             objects) are still referenced after a full collection (`soak: dead engines still referenced: N
             of M`): a dead engine must not be kept alive by what built or served it.

Both run on the event loop (`call_soon_threadsafe` from the handler), never inside the handler itself.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("lockgate.soak")

DEAD_LINE = "soak: dead engines still referenced:"


class _Hooks:
    """The signal hooks of one app."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._dead: list[weakref.ref[Any]] = []

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, lambda _n, _f: self._soon(self.kill))
        signal.signal(signal.SIGUSR2, lambda _n, _f: self._soon(self.report))

    @staticmethod
    def _soon(action: Callable[[], None]) -> None:
        # A Python signal handler runs in the main thread between two bytecodes: here, inside the loop.
        asyncio.get_running_loop().call_soon_threadsafe(action)

    def kill(self) -> None:
        supervised = self._app.state.services.engine
        engine = supervised.engine
        self._dead.append(weakref.ref(engine))
        if hasattr(engine, "engine_core_pids"):  # vLLM in this process: its engine core dies
            self._dead.append(weakref.ref(engine.llm))  # its AsyncLLM must go too, not the wrapper alone
            for pid in engine.engine_core_pids():
                os.kill(pid, signal.SIGKILL)
        else:
            engine.kill("killed by the soak benchmark")
        log.warning("soak: engine %s killed (%d so far)", engine.replica_id, len(self._dead))

    def report(self) -> None:
        gc.collect()
        alive = sum(ref() is not None for ref in self._dead)
        log.warning("%s %d of %d", DEAD_LINE, alive, len(self._dead))


def main() -> int:
    """Serve as `lockgate serve` does, with the hooks installed once the app is built."""
    import uvicorn

    from engines.vllm_local import offline_environment
    from gateway.app import create_app
    from gateway.config import load_config
    from gateway.server import log_off_the_loop, uvicorn_config

    config = load_config(None)
    os.environ.update(offline_environment(Path(config.model.data_dir)))
    listener = log_off_the_loop(config.server.log_level.upper())
    try:
        app = create_app(config, freeze_start_up=True)
        _Hooks(app).install()
        uvicorn.Server(uvicorn_config(config, app)).run()
    finally:
        listener.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
