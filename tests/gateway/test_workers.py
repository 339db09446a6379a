"""`lockgate serve --workers N`: what a multi-process configuration must share is checked before anything
starts, and a real two-worker server shares quotas, metrics and console sessions, replaces a worker that
dies and stops cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from gateway.cli import main
from gateway.config import Config, ConfigError, ReplicaSpec, check_workers, load_config, with_workers
from gateway.console.plumbing import COOKIE
from policy.tenants import TENANT_STORE, keys
from policy.tenants.models import ApiKey, Limits, Quotas, Tenant
from registry.db.stores import open_store
from tests.backends import PG_DSN, postgres_schema
from tests.conftest import MODEL, eventually, free_port
from tests.gateway.test_console import form_token

SHARED = {
    "LOCKGATE_QUOTA__BACKEND": "redis",
    "LOCKGATE_STORAGE__BACKEND": "postgres",
    "LOCKGATE_STORAGE__POSTGRES_DSN": PG_DSN,
    "LOCKGATE_ENGINE__KIND": "simulated",
    # As `make_config`: a loaded test machine must not read as these servers' overload.
    "LOCKGATE_OVERLOAD__CPU_SHEDDING": "false",
    "LOCKGATE_CONSOLE__SESSION_STORE": "redis",
    "LOCKGATE_IDEMPOTENCY__BACKEND": "redis",
    "LOCKGATE_SESSIONS__BACKEND": "redis",
    # Plain HTTP: a client keeps no `Secure` cookie.
    "LOCKGATE_CONSOLE__INSECURE_COOKIE": "true",
}
REQUEST_LOG = re.compile(r"lockgate\.requests \[(\d+)\]: (\{.*\})$")


def test_one_worker_needs_nothing_shared() -> None:
    assert load_config(env={}).server.workers == 1


def test_many_workers_refuse_state_kept_in_one_process() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(env={"LOCKGATE_SERVER__WORKERS": "2"})
    message = str(refused.value)
    assert "`quota.backend` must be redis" in message
    assert "`storage.backend` must be postgres" in message
    assert "the embedded engine (`engine.kind` vllm_local)" in message
    assert "`idempotency.backend` must be redis" in message
    assert "`sessions.backend` must be redis" in message
    with pytest.raises(ConfigError, match="must be >= 1"):
        with_workers(load_config(env={}), 0)


def test_many_workers_accept_shared_state_and_remote_or_simulated_engines() -> None:
    config = with_workers(load_config(env=SHARED), 4)
    assert config.server.workers == 4
    remote = load_config(env={**SHARED, "LOCKGATE_ENGINE__KIND": "vllm_local"})
    local_replica = ReplicaSpec(kind="vllm_local")
    with pytest.raises(ConfigError, match=r"\[\[engines\]\] #1 would start a vLLM engine in every worker"):
        check_workers(_with(remote, engines=[local_replica], workers=2))


def _with(config: Config, *, engines: list[ReplicaSpec], workers: int) -> Config:
    import msgspec

    server = msgspec.structs.replace(config.server, workers=workers)
    return msgspec.structs.replace(config, engines=engines, server=server)


def test_the_command_line_refuses_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--workers", "2"]) == 2
    assert "`quota.backend` must be redis" in capsys.readouterr().err


@dataclass
class Served:
    proc: asyncio.subprocess.Process
    url: str
    log: Path
    env: dict[str, str]

    def workers(self) -> list[psutil.Process]:
        """The worker processes (the parent's spawned children; not multiprocessing's resource tracker)."""
        workers = []
        for p in psutil.Process(self.proc.pid).children():
            try:
                if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                    workers.append(p)
            except psutil.NoSuchProcess:
                pass
        return workers

    def served_by(self, route: str = "/v1/chat/completions") -> Counter[int]:
        """Requests to `route` logged per worker pid."""
        counts: Counter[int] = Counter()
        for line in self.log.read_text(errors="replace").splitlines():
            found = REQUEST_LOG.search(line)
            if found and json.loads(found.group(2)).get("route") == route:
                counts[int(found.group(1))] += 1
        return counts


async def _tenant(env: dict[str, str], tenant_id: str, limits: Limits) -> tuple[str, str]:
    """A tenant with `limits`: its consumer key and its reviewer key."""
    store = await open_store(TENANT_STORE, load_config(env=env).storage)
    try:
        now = time.time()
        await store.create_tenant(
            Tenant(tenant_id=tenant_id, display_name=tenant_id, quotas=Quotas(tenant=limits)),
            actor="test",
            now=now,
        )
        made = []
        for role in ("consumer", "reviewer"):
            plaintext, key_id, secret_hash = keys.new_key()
            key = ApiKey(key_id=key_id, tenant_id=tenant_id, roles=(role,), created_at=now)
            await store.add_key(key, secret_hash, actor="test", now=now)
            made.append(plaintext)
        return made[0], made[1]
    finally:
        await store.close()


@asynccontextmanager
async def two_workers(model_dir: Path, tmp_path: Path) -> AsyncIterator[Served]:
    """`lockgate serve --workers 2` on the simulated engine, Redis and a fresh PostgreSQL schema."""
    async with postgres_schema() as (schema, _admin):
        port = free_port()
        env = {
            **os.environ,
            **SHARED,
            "LOCKGATE_STORAGE__POSTGRES_SCHEMA": schema,
            "LOCKGATE_MODEL__DATA_DIR": str(model_dir.parent),
            "LOCKGATE_AUDIT__SPOOL_DIR": str(tmp_path / "spool"),
            "LOCKGATE_SERVER__PORT": str(port),
            "LOCKGATE_SERVER__LOG_LEVEL": "info",
            "LOCKGATE_GUARD__DEFAULT_POLICY": "rules",
            # The scrape counts the workers' series; who may read them is tests/gateway/test_metrics.py's.
            "LOCKGATE_METRICS__REQUIRE_KEY": "false",
        }
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--workers",
                "2",
                env=env,
                stderr=out,
                stdout=out,
            )
        served = Served(proc, f"http://127.0.0.1:{port}", log, env)
        try:
            async with httpx.AsyncClient(base_url=served.url) as http:

                async def ready() -> bool:
                    assert proc.returncode is None, log.read_text(errors="replace")[-3000:]
                    try:
                        return (await http.get("/readyz")).status_code == 200 and len(served.workers()) == 2
                    except httpx.TransportError:
                        return False

                await eventually(ready, within=300)
            yield served
        finally:
            if proc.returncode is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                await proc.wait()


async def _chat(url: str, key: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    # A connection per request: the kernel hands each to whichever worker accepts it first.
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"}) as http:
        return (await http.post("/v1/chat/completions", json=body, timeout=60)).status_code


async def _page(url: str, cookie: str) -> int:
    async with httpx.AsyncClient(base_url=url, cookies={COOKIE: cookie}) as http:
        return (await http.get("/console/policies")).status_code


async def _requests_total(url: str, tenant: str) -> float:
    async with httpx.AsyncClient(base_url=url) as http:
        text = (await http.get("/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("lockgate:requests_total{") and f'tenant="{tenant}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_two_workers_share_quotas_and_metrics_and_survive_a_worker_death(
    model_dir: Path, tmp_path: Path
) -> None:
    async with two_workers(model_dir, tmp_path) as served:
        huge = Limits(requests_per_second=1e6, request_burst=1e6, tokens_per_second=1e9, token_burst=1e9)
        # Tenant ids of their own: Redis keeps quota buckets between runs.
        spread, tight_id = f"spread-{secrets.token_hex(4)}", f"tight-{secrets.token_hex(4)}"
        free, reviewer = await _tenant(served.env, spread, huge)
        # Both workers take requests (bounded: connections go to whichever worker accepts first).
        sent = 0
        while len(served.served_by()) < 2:
            assert sent < 400, f"one worker served all {sent} requests: {served.served_by()}"
            statuses = await asyncio.gather(*(_chat(served.url, free) for _ in range(20)))
            assert set(statuses) == {200}
            sent += 20

        # Whichever worker answers the scrape, it counts every worker's requests.
        async def counted() -> bool:
            return await _requests_total(served.url, spread) == sent

        await eventually(counted, within=10)
        for _ in range(4):
            assert await _requests_total(served.url, spread) == sent

        # One quota across the workers: a burst of 12 admits exactly 12 of 40 concurrent requests.
        tight = Limits(requests_per_second=1e-6, request_burst=12, tokens_per_second=1e9, token_burst=1e9)
        limited, _ = await _tenant(served.env, tight_id, tight)
        statuses = await asyncio.gather(*(_chat(served.url, limited) for _ in range(40)))
        assert Counter(statuses) == {200: 12, 429: 28}

        # A reviewer signed in on one worker is signed in on every worker.
        async with httpx.AsyncClient(base_url=served.url) as http:
            token = await form_token(http)
            signed = await http.post("/console/login", data={"key": reviewer, "csrf": token})
            assert signed.status_code == 303
            cookie = signed.cookies[COOKIE]
        pages = 0
        while len(served.served_by("/console/policies")) < 2:
            assert pages < 400, f"one worker served all {pages} pages"
            answers = await asyncio.gather(*(_page(served.url, cookie) for _ in range(20)))
            assert answers == [200] * 20  # signed out would be 303 to the sign-in form
            pages += 20

        # A worker killed outright is replaced; its requests stay counted.
        victim = served.workers()[0]
        victim.send_signal(signal.SIGKILL)

        async def replaced() -> bool:
            pids = {p.pid for p in served.workers()}
            return len(pids) == 2 and victim.pid not in pids

        await eventually(replaced, within=300)
        await eventually(counted, within=10)
        assert await _chat(served.url, free) == 200

        # Each worker had an audit spool directory of its own.
        assert (tmp_path / "spool" / ".lock").exists()
        assert (tmp_path / "spool" / "worker-1" / ".lock").exists()

        served.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(served.proc.wait(), timeout=120) == 0
        assert not [p for p in psutil.process_iter() if p.ppid() == served.proc.pid]
