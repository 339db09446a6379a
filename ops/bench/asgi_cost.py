"""The gateway's own cost per request, without sockets: chat requests driven straight into its ASGI app.

    python -m ops.bench.asgi_cost [--mode whole|stream] [--server gateway|mock] [--requests 3000]
                                  [--quota memory|redis|redis-lease] [--guard none|rules|embedding]
                                  [--max-tokens 16] [--profile FILE]
                                  [--log-level warning|info]
    valgrind --tool=callgrind --instr-atstart=no python -m ops.bench.asgi_cost --callgrind --requests 200

The app `lockgate serve` builds (zero-delay simulated engine, guard policy `none` unless `--guard`, a tenant
with quotas on both scopes, the CPU shedding off), each request sent one after the other in this process: no
HTTP parsing, no socket, no load generator sharing the core, so what is measured is the app's work per request
(auth, quota, template and tokenizer, admission, the engine's stream, metrics, the response). It prints the
CPU per request over the run and the fastest and median of its 100-request batches. On a shared machine those
move by 10-30% between runs; under callgrind (`--callgrind` turns its instrumentation on for the measured
requests only) the instruction count per request repeats within about 0.5%, which is what a change to the hot
path is compared by: `Collected` over `--requests`. `--server mock` drives the overhead bench's mock OpenAI
server (`ops.bench._mock_openai`: the same simulated engine with nothing in front) the same way, so the
gateway's figure can be set against the engine's own; `--max-tokens` sets the answers' length (per-token cost:
the difference between two lengths).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from ops.bench._mock_openai import MockOpenAI
from ops.bench._servers import QUOTAS, gateway_env, provision
from ops.bench.overhead import body

_BATCH = 100
_WARMUP = 200


class _Driver:
    """Requests sent into one app as ASGI calls, with a consumer key."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.headers = [
            (b"host", b"gateway"),
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", b"application/json"),
        ]

    async def send(self, payload: bytes) -> int:
        """One chat request; its status."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [*self.headers, (b"content-length", str(len(payload)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
            "state": {},
        }
        received = False
        never = asyncio.Event()
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal received
            if received:  # the client stays connected
                await never.wait()
            received = True
            return {"type": "http.request", "body": payload, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await self.app(scope, receive, send)
        return status


def _callgrind(state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)


@contextlib.asynccontextmanager
async def _served(args: argparse.Namespace, workdir: Path) -> AsyncIterator[tuple[Any, str]]:
    """The app `args.server` names, started, and the key to call it with."""
    if args.server == "mock":
        mock = MockOpenAI()
        await mock.engine.start()
        try:
            yield mock, ""
        finally:
            await mock.engine.shutdown()
        return
    from gateway.app import create_app, running
    from gateway.config import load_config

    # The port is never bound: requests go straight into the app.
    env = {**gateway_env(args.quota, 8000, workdir, args.guard), "LOCKGATE_OVERLOAD__CPU_SHEDDING": "false"}
    key = await provision(env, "bench-asgi")
    app = create_app(load_config(env=env))
    async with running(app):
        yield app, key


async def run(args: argparse.Namespace, workdir: Path) -> list[float]:
    """CPU seconds per request of each batch (in order), after a warm-up."""
    payloads = [
        body(i, args.mode, args.model, 20, args.max_tokens, 7) for i in range(_WARMUP + args.requests)
    ]
    async with _served(args, workdir) as (app, key):
        driver = _Driver(app, key)
        for payload in payloads[:_WARMUP]:
            if (status := await driver.send(payload)) != 200:
                raise RuntimeError(f"warm-up request answered {status}")
        gc.collect()
        gc.freeze()
        if args.callgrind:
            _callgrind("on")
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        batches = []
        failed = 0
        measured = payloads[_WARMUP:]
        for start in range(0, len(measured), _BATCH):
            batch = measured[start : start + _BATCH]
            cpu = time.process_time()
            for payload in batch:
                failed += await driver.send(payload) != 200
            batches.append((time.process_time() - cpu) / len(batch))
        if args.callgrind:
            _callgrind("off")
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
        gc.unfreeze()  # for the interpreter's exit (frozen objects outlive it: triton then reports leaks)
        if failed:  # the cost of failing requests is not the hot path's
            raise RuntimeError(f"{failed} of {len(measured)} requests were not answered 200")
        return batches


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, drive the requests, print the CPU per request."""
    import uvloop

    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.asgi_cost", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--mode", choices=["whole", "stream"], default="whole")
    parser.add_argument(
        "--server",
        choices=["gateway", "mock"],
        default="gateway",
        help="the gateway, or the overhead bench's mock OpenAI server (the same simulated engine alone)",
    )
    parser.add_argument("--requests", type=int, default=3000, help="measured requests (3000)")
    parser.add_argument("--quota", choices=QUOTAS, default="memory")
    parser.add_argument(
        "--guard",
        choices=["none", "rules", "embedding"],
        default="none",
        help="the default policy (guard.default_policy); the audit trail records its decisions",
    )
    parser.add_argument(
        "--profile", type=Path, help="write a cProfile of the measured requests (the event loop's thread)"
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name in requests")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (16)")
    parser.add_argument("--callgrind", action="store_true", help="count instructions of the measured part")
    parser.add_argument(
        "--log-level",
        choices=["warning", "info"],
        default="warning",
        help="the root logger's level, as `lockgate serve` sets it (warning, as the overhead bench; info, "
        "the default of server.log_level, adds the request log line, written to /dev/null)",
    )
    args = parser.parse_args(argv)
    if args.log_level == "info":
        from gateway.server import log_off_the_loop

        listener = log_off_the_loop("INFO")
        for handler in listener.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(open(os.devnull, "w"))  # noqa: SIM115 (open until the process ends)
    with tempfile.TemporaryDirectory(prefix="lockgate-asgi-") as tmp:
        batches = uvloop.run(run(args, Path(tmp)))
    ordered = [1e6 * b for b in sorted(batches)]
    mean = 1e6 * sum(batches) / len(batches)
    served = (
        "mock server"
        if args.server == "mock"
        else f"{args.quota} quotas, guard {args.guard}, log level {args.log_level}"
    )
    print(
        f"{args.mode}, {served}, {args.requests} requests: "
        f"{mean:.0f} us CPU per request "
        f"(100-request batches: fastest {ordered[0]:.0f} us, median {ordered[len(ordered) // 2]:.0f} us)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
