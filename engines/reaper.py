"""Engine processes that end with the gateway, even when it is killed.

vLLM runs its engine core in a child process (and that core its workers). When the gateway exits normally it
stops them; when it is killed (SIGKILL, the OOM killer) the core is re-parented and runs on with its model
and KV cache in memory, holding the accelerator, until someone finds it. A `Reaper` is a small watcher
process (`python -m engines.reaper`) started beside the engine, before it: it waits for the gateway process to
end (on a pidfd where the kernel has them, else polling its parent every `POLL_S`) and then stops the
engine's processes and their descendants: SIGTERM (vLLM shuts down its workers), SIGKILL whatever is left
after `grace` seconds. While the engine starts (20-40 s on CPU, its processes' ids not known yet) the watcher
adopts each child the gateway starts; once told the engine's processes (`watch`), it watches exactly those.
A process is signalled only if it is still the one recorded (same start time), never a later process that
reused its id. Stopping the reaper (`stop`, the engine's normal shutdown) kills nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any, TextIO

import psutil

# How often the watcher looks at its parent where it cannot wait on a pidfd, and for new children of its
# parent while it adopts them (a few milliseconds of reading /proc each time).
POLL_S = 0.5
ADOPT_POLL_S = 0.2
# Seconds a process has to exit after SIGTERM before it is killed.
GRACE_S = 5.0


class Reaper:
    """The watcher of one engine's processes: `start` it before the engine starts, `watch` the engine's
    processes once they exist, `stop` it after the engine has stopped. Blocking calls (run them in a thread
    from the event loop)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process
        # The processes watched (their descendants are found when the watcher acts); () while adopting.
        self.pids: tuple[int, ...] = ()

    @property
    def pid(self) -> int:
        """The watcher's own process id."""
        return self._process.pid

    @classmethod
    def start(cls, grace: float = GRACE_S, report: int | IO[Any] = subprocess.DEVNULL) -> Reaper:
        """A watcher for this process. Until `watch`, it adopts every child this process starts from now on
        (an engine still starting up has no process ids to give yet), writing `adopted <pid>` to `report`."""
        before = [str(child.pid) for child in psutil.Process().children()]  # what it must not adopt
        process = subprocess.Popen(
            [sys.executable, "-m", "engines.reaper", str(os.getpid()), repr(grace), *before],
            stdin=subprocess.PIPE,
            stdout=report,
        )
        return cls(process)

    def watch(self, pids: Sequence[int]) -> None:
        """Watch exactly `pids` (with their descendants) from now on, and adopt no more children. Once."""
        stdin = self._process.stdin
        assert stdin is not None
        line = " ".join(f"{pid}:{psutil.Process(pid).create_time()!r}" for pid in pids)
        stdin.write(f"{line}\n".encode())
        stdin.flush()
        self.pids = tuple(pids)

    def stop(self, timeout: float = 10.0) -> None:
        """End the watcher without touching what it watched (up to `timeout` seconds)."""
        self._process.terminate()
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdin is not None:
            self._process.stdin.close()


def watch_parent(
    parent: int, before: set[int], commands: TextIO, adopted: Callable[[int], None]
) -> dict[int, float]:
    """Wait for process `parent` (this process's parent when called) to end; the processes to reap then, by
    id with their start times: its children but `before` until `commands` gave a line of `pid:start-time`
    entries (each adopted child told to `adopted`), then those."""
    try:
        death: int | None = os.pidfd_open(parent)  # readable once the process has exited
    except (AttributeError, OSError):  # no pidfds here (an old kernel, a seccomp filter): poll
        death = None
    watched: dict[int, float] = {}
    adopting = True
    inputs: list[TextIO | int] = [commands] + ([death] if death is not None else [])
    try:
        while True:
            timeout = ADOPT_POLL_S if adopting else (POLL_S if death is None else None)
            ready, _, _ = select.select(inputs, [], [], timeout)
            ended = (death is not None and death in ready) or os.getppid() != parent
            if ended and commands in inputs and select.select([commands], [], [], 0)[0]:
                ready = [*ready, commands]  # a line the parent wrote just before it died
            if commands in ready:
                line = commands.readline()
                inputs.remove(commands)  # one line; end of file: closed (or its writer died)
                if line:
                    watched, adopting = dict(_parse(entry) for entry in line.split()), False
            if ended:
                break
            if adopting:
                for pid, created in _new_children(parent, before | watched.keys()).items():
                    watched[pid] = created
                    adopted(pid)
    except psutil.NoSuchProcess:  # the parent ended while its children were read
        pass
    finally:
        if death is not None:
            os.close(death)
    return watched


def _new_children(parent: int, known: set[int]) -> dict[int, float]:
    me = os.getpid()
    children = psutil.Process(parent).children()
    return {c.pid: c.create_time() for c in children if c.pid not in known and c.pid != me}


def reap(watched: Sequence[tuple[int, float]], grace: float) -> list[int]:
    """Stop each `(pid, create time)` that is still that process, with its descendants: SIGTERM, then
    SIGKILL (to any of them) still running after `grace` seconds. The ids of the processes stopped, the
    descendants included."""
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
    """`<parent pid> <grace seconds> <pid of a child not to adopt>...`, commands on stdin: wait for the parent
    to end, then reap."""
    # Ctrl-C in a terminal reaches the whole foreground group: the gateway then stops its engines itself
    # (and this watcher with them).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent, grace, before = int(argv[0]), float(argv[1]), {int(pid) for pid in argv[2:]}
    watched = watch_parent(parent, before, sys.stdin, lambda pid: print(f"adopted {pid}", flush=True))
    stopped = reap(list(watched.items()), grace)
    if stopped:
        print(f"lockgate: process {parent} ended; stopped its engine processes {stopped}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
