"""Engine processes that end with the gateway, even when it is killed.

vLLM runs its engine core in a child process (and that core its workers). When the gateway exits normally it
stops them; when it is killed (SIGKILL, the OOM killer) the core is re-parented and runs on with its model
and KV cache in memory, holding the accelerator, until someone finds it. A `Reaper` is a small watcher
process (`python -m engines.reaper`) started beside the engine: it waits for the gateway process to end
(a pidfd where the kernel has them, else polling its parent every `POLL_S`) and then stops the processes it
was given and their descendants: SIGTERM (vLLM shuts down its workers), SIGKILL whatever is left after
`grace` seconds. A process is signalled only if it is still the one registered (same start time), never a
later process that reused its id. Stopping the reaper (`stop`, the engine's normal shutdown) kills nothing.

The watcher is started once the engine core exists: a gateway killed during the engine's start-up (20-40 s
on CPU) can still leave it behind.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil

# How often the watcher looks at its parent where it cannot wait on a pidfd.
POLL_S = 0.5
# Seconds a process has to exit after SIGTERM before it is killed.
GRACE_S = 5.0


class Reaper:
    """The watcher of one engine's processes (started by `start`, from any thread)."""

    def __init__(self, process: subprocess.Popen[bytes], pids: Sequence[int]) -> None:
        self._process = process
        # The processes watched (their descendants are found when the watcher acts).
        self.pids = tuple(pids)

    @property
    def pid(self) -> int:
        """The watcher's own process id."""
        return self._process.pid

    @classmethod
    def start(cls, pids: Sequence[int], grace: float = GRACE_S) -> Reaper:
        """Watch `pids` (with their descendants) for this process: they are stopped when it dies."""
        watched = [f"{pid}:{psutil.Process(pid).create_time()!r}" for pid in pids]
        process = subprocess.Popen(
            [sys.executable, "-m", "engines.reaper", str(os.getpid()), repr(grace), *watched],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        return cls(process, pids)

    def stop(self, timeout: float = 10.0) -> None:
        """End the watcher without touching what it watched (blocking: up to `timeout` seconds)."""
        self._process.terminate()
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def wait_for_exit(parent: int) -> None:
    """Return once process `parent`, this process's parent when called, has ended."""
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfds here (an old kernel, a seccomp filter): poll
        while os.getppid() == parent:
            time.sleep(POLL_S)
        return
    try:
        if os.getppid() != parent:  # it died before the pidfd was open
            return
        select.select([fd], [], [])  # readable once the process has exited
    finally:
        os.close(fd)


def reap(watched: Sequence[tuple[int, float]], grace: float) -> list[int]:
    """Stop each `(pid, create time)` that is still that process, with its descendants: SIGTERM, then
    SIGKILL after `grace` seconds. The ids signalled."""
    roots: list[psutil.Process] = []
    for pid, created in watched:
        try:
            process = psutil.Process(pid)
            if process.create_time() == created:
                roots.append(process)
        except psutil.NoSuchProcess:
            pass
    tree: list[psutil.Process] = []
    for root in roots:
        tree.append(root)
        with contextlib.suppress(psutil.NoSuchProcess):
            tree.extend(root.children(recursive=True))
    for process in roots:
        _signal(process, terminate=True)
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for process in alive:
        _signal(process, terminate=False)
    psutil.wait_procs(alive, timeout=grace)
    return [process.pid for process in tree]


def _signal(process: psutil.Process, *, terminate: bool) -> None:
    # psutil refuses to signal a process whose id was reused since it was looked up.
    with contextlib.suppress(psutil.NoSuchProcess):
        process.terminate() if terminate else process.kill()


def _parse(arg: str) -> tuple[int, float]:
    pid, created = arg.split(":", 1)
    return int(pid), float(created)


def main(argv: Sequence[str]) -> int:
    """`<parent pid> <grace seconds> <pid>:<create time>...`: wait for the parent to end, then reap."""
    # Ctrl-C in a terminal reaches the whole foreground group: the gateway then stops its engines itself
    # (and this watcher with them).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent, grace, watched = int(argv[0]), float(argv[1]), [_parse(arg) for arg in argv[2:]]
    wait_for_exit(parent)
    stopped = reap(watched, grace)
    if stopped:
        print(f"lockgate: process {parent} ended; stopped its engine processes {stopped}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
