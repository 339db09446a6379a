"""The servers `ops.bench.overhead` compares, each a child process pinned to one core: the mock OpenAI
server on the simulated engine, and `lockgate serve` on the same engine with a quota store."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import psutil

from ops.bench._overhead_report import Target

# Buckets far above any rate the bench offers: the quota store is consulted on every request (reserve and
# settle) and never refuses.
_HUGE = 1e9


class Server:
    """One child process serving HTTP on `port`; `api_key` for the gateway."""

    def __init__(
        self, target: Target, proc: subprocess.Popen[bytes], port: int, api_key: str = "", schema: str = ""
    ) -> None:
        """Wrap a started process (`schema`: its PostgreSQL schema, for `drop_schema` once it stopped)."""
        self.target = target
        self.proc = proc
        self.port = port
        self.api_key = api_key
        self.schema = schema
        self.log: Path | None = None  # where its output goes
        self.ps = psutil.Process(proc.pid)

    def unrecorded(self) -> int:
        """Gate decisions its log says the audit trail could not take (`policy.safety.gate`)."""
        if self.log is None or not self.log.exists():
            return 0
        with self.log.open("rb") as lines:
            return sum(UNRECORDED in line for line in lines)

    def cpu_s(self) -> float:
        """User + system CPU seconds the process and its live children (workers) have used so far."""
        total = 0.0
        for proc in [self.ps, *self.ps.children(recursive=True)]:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def stop(self) -> None:
        """Terminate, then kill if it lingers."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    """A TCP port free on loopback now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _spawn(args: list[str], env: dict[str, str], cores: set[int], log: Path) -> subprocess.Popen[bytes]:
    # Output goes to a file: a pipe nobody reads would stall the server once full.
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )


async def _wait_ready(proc: subprocess.Popen[bytes], url: str, within: float, log: Path) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = await asyncio.to_thread(log.read_text, errors="replace")
                raise RuntimeError(f"server exited during start-up ({proc.returncode}): {err[-2000:]}")
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready within {within:g} s")


async def _ready(server: Server, path: str, within: float, log: Path) -> Server:
    """`server` once `path` answers 200 (within `within` seconds); stopped if it does not."""
    server.log = log
    try:
        await _wait_ready(server.proc, f"http://127.0.0.1:{server.port}{path}", within, log)
    except BaseException:
        server.stop()
        raise
    return server


async def start_mock(core: int, workdir: Path) -> Server:
    """The mock OpenAI server, ready; its output in `workdir`/server.log."""
    port = free_port()
    log = workdir / "server.log"
    proc = _spawn(["-m", "ops.bench._mock_openai", "--port", str(port)], dict(os.environ), {core}, log)
    return await _ready(Server("mock", proc, port), "/healthz", 60, log)


# What the gate logs for a decision the audit trail could not take.
UNRECORDED = b"not recorded"
# Quota stores the benches name: `redis-lease` is Redis granting from leases (`[quota.lease]`, defaults).
QUOTAS = ("memory", "redis", "redis-lease")


# Where the gateway keeps tenants, registry and audit trail: `postgres` in a schema of its own on this one.
STORAGES = ("sqlite", "postgres")
POSTGRES_DSN = "postgresql://postgres@127.0.0.1:5432/test"


def gateway_env(quota: str, port: int, workdir: Path, guard: str, storage: str = "sqlite") -> dict[str, str]:
    """The environment of a `lockgate serve` on the zero-delay simulated engine, with the quota store
    `quota` (one of QUOTAS), the default policy `guard` and its stores on `storage` (one of STORAGES: a
    PostgreSQL schema of its own, which `drop_schema` removes)."""
    lease = {"LOCKGATE_QUOTA__LEASE__SECONDS": "1.0"} if quota == "redis-lease" else {}
    stores = (
        {
            "LOCKGATE_STORAGE__BACKEND": "postgres",
            "LOCKGATE_STORAGE__POSTGRES_DSN": POSTGRES_DSN,
            "LOCKGATE_STORAGE__POSTGRES_SCHEMA": f"bench_{os.getpid()}_{port}",
        }
        if storage == "postgres"
        else {}
    )
    return {
        **os.environ,
        "LOCKGATE_ENGINE__KIND": "simulated",
        "LOCKGATE_ENGINE__SIMULATOR__DECODE_STEP_S": "0",
        "LOCKGATE_ENGINE__SIMULATOR__DECODE_STEP_S_PER_SEQ": "0",
        "LOCKGATE_ENGINE__SIMULATOR__PREFILL_S_PER_TOKEN": "0",
        "LOCKGATE_STORAGE__SQLITE_PATH": str(workdir / "lockgate.sqlite3"),
        "LOCKGATE_SERVER__PORT": str(port),
        "LOCKGATE_SERVER__LOG_LEVEL": "warning",
        "LOCKGATE_GUARD__DEFAULT_POLICY": guard,
        "LOCKGATE_QUOTA__BACKEND": quota.removesuffix("-lease"),
        # The bench reads the shed counts on loopback, without a key.
        "LOCKGATE_METRICS__REQUIRE_KEY": "false",
        **lease,
        **stores,
    }


async def provision(env: dict[str, str], tenant_id: str) -> str:
    """A tenant with (huge) quotas on both scopes and a consumer key; the key's plaintext."""
    from gateway.config import load_config
    from policy.tenants import TENANT_STORE, keys
    from policy.tenants.models import ApiKey, Limits, Quotas, Tenant
    from registry.db.stores import open_store

    limits = Limits(
        requests_per_second=_HUGE, request_burst=_HUGE, tokens_per_second=_HUGE, token_burst=_HUGE
    )
    store = await open_store(TENANT_STORE, load_config(env=env).storage)
    try:
        now = time.time()
        tenant = Tenant(
            tenant_id=tenant_id, display_name=tenant_id, quotas=Quotas(tenant=limits, per_key=limits)
        )
        await store.create_tenant(tenant, actor="bench", now=now)
        plaintext, key_id, secret_hash = keys.new_key()
        key = ApiKey(key_id=key_id, tenant_id=tenant_id, roles=("consumer",), created_at=now)
        await store.add_key(key, secret_hash, actor="bench", now=now)
        return plaintext
    finally:
        await store.close()


async def start_gateway(
    quota: str,
    cores: set[int],
    workdir: Path,
    guard: str,
    *,
    workers: int = 1,
    env: dict[str, str] | None = None,
    target: Target = "",
    storage: str = "sqlite",
    command: list[str] | None = None,
    prepare: Callable[[dict[str, str]], Awaitable[None]] | None = None,
) -> Server:
    """`lockgate serve [--workers N]` with `quota` as its quota store, its stores on `storage`, and a fresh
    tenant and key, ready; `env` is added to its environment, and `target` names it (default: the quota
    store). `command`: the Python arguments that serve instead (`ops.bench._soak_server`'s). `prepare`:
    run with the gateway's environment before it starts (e.g. to publish to its registry)."""
    port = free_port()
    environ = {**gateway_env(quota, port, workdir, guard, storage), **(env or {})}
    if prepare is not None:
        await prepare(environ)
    key = await provision(environ, f"bench-{secrets.token_hex(4)}")
    log = workdir / "server.log"
    args = command or ["-m", "gateway.cli", "serve", "--workers", str(workers)]
    proc = _spawn(args, environ, cores, log)
    schema = environ["LOCKGATE_STORAGE__POSTGRES_SCHEMA"] if storage == "postgres" else ""
    return await _ready(Server(target or quota, proc, port, key, schema), "/readyz", 300, log)


async def drop_schema(schema: str) -> None:
    """Remove a stopped gateway's PostgreSQL schema (`gateway_env`)."""
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(POSTGRES_DSN, timeout=10)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()
