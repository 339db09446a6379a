"""The reaper: engine processes stop when the process that started them is killed, and only then."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from engines.reaper import Reaper, reap
from engines.vllm_local import VllmLocalEngine

# An upper bound for a process to be gone once it should be (a failure bound, not a measured figure).
GONE_WITHIN_S = 60.0

# A stand-in engine core: a process with a child of its own (vLLM's worker); it prints the child's id.
CORE = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(worker.pid, flush=True)
time.sleep(600)
"""

# A stand-in gateway: a child from before its reaper (not the engine's), then a reaper and the core; it
# prints `ids: core worker reaper other`, tells the reaper the core's id unless told to leave it adopting (a
# gateway killed while its engine starts), then waits to be killed. The reaper's `adopted <pid>` lines go
# to the same output.
GATEWAY = """
import subprocess, sys, time
from engines.reaper import Reaper
other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
reaper = Reaper.start(grace=float(sys.argv[3]), report=sys.stdout)
core = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
worker = core.stdout.readline().strip()
if sys.argv[4] == "watch":
    reaper.watch([core.pid])
print("ids:", core.pid, worker, reaper.pid, other.pid, flush=True)
time.sleep(600)
"""


def _ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE  # exited; its new parent has not collected it
    except psutil.NoSuchProcess:
        return True


def _wait_ended(processes: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running after `GONE_WITHIN_S` (none once all have ended)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    running = processes
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = [p for p in running if not _ended(p)]
    return running


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process
    process.kill()
    process.wait()


@pytest.mark.parametrize("told", ["watch", "adopting"])
@pytest.mark.parametrize("core_mode", ["obey-term", "ignore-term"])
def test_killing_the_gateway_stops_its_engine_processes(core_mode: str, told: str) -> None:
    gateway = subprocess.Popen(
        [sys.executable, "-c", GATEWAY, CORE, core_mode, "0.5", told], stdout=subprocess.PIPE, text=True
    )
    assert gateway.stdout is not None
    ids: list[int] = []
    adopted: set[int] = set()
    # Until the ids, and while adopting, until the watcher has seen the core.
    while not ids or (told == "adopting" and ids[0] not in adopted):
        kind, *numbers = gateway.stdout.readline().split()
        if kind == "ids:":
            ids = [int(n) for n in numbers]
        else:
            adopted.add(int(numbers[0]))
    processes = [psutil.Process(pid) for pid in ids]
    *engine, other = processes
    try:
        assert not any(_ended(p) for p in processes)
        gateway.kill()  # as the OOM killer would: no clean-up runs in it
        gateway.wait()
        # The core (even one that ignores SIGTERM: killed after the grace), its worker, and the reaper.
        assert _wait_ended(engine) == []
        # A child the gateway started before its reaper is none of the engine's.
        assert not _ended(other)
    finally:
        for process in processes:
            if not _ended(process):
                process.kill()


def test_stopping_the_reaper_leaves_the_engine_running(sleeper: subprocess.Popen[bytes]) -> None:
    reaper = Reaper.start(grace=0.1)
    reaper.watch([sleeper.pid])
    assert reaper.pids == (sleeper.pid,)
    watcher = psutil.Process(reaper.pid)
    reaper.stop()
    assert _wait_ended([watcher]) == []
    assert sleeper.poll() is None


def test_reap_signals_only_the_process_it_was_given(sleeper: subprocess.Popen[bytes]) -> None:
    created = psutil.Process(sleeper.pid).create_time()
    # Another process that reused the id (another start time) is left alone.
    assert reap([(sleeper.pid, created + 1.0)], grace=0.1) == []
    assert sleeper.poll() is None
    assert reap([(sleeper.pid, created)], grace=5.0) == [sleeper.pid]
    assert sleeper.poll() is not None  # ended (reap collected it: psutil waits on its own children)


def test_reap_skips_a_process_that_is_already_gone(sleeper: subprocess.Popen[bytes]) -> None:
    created = psutil.Process(sleeper.pid).create_time()
    sleeper.kill()
    sleeper.wait()
    assert reap([(sleeper.pid, created)], grace=0.1) == []


async def test_the_vllm_engine_core_is_watched(vllm_engine: VllmLocalEngine) -> None:
    reaper = vllm_engine.reaper
    assert reaper is not None
    assert reaper.pids == tuple(vllm_engine.engine_core_pids()) != ()
    watcher = psutil.Process(reaper.pid)
    assert watcher.ppid() == os.getpid()
    assert not _ended(watcher)
