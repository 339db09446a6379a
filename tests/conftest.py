"""Shared fixtures: the prepared default model, one real vLLM engine per test session, in-process servers."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import socket
import tempfile
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import uvicorn
from litestar import Litestar

from engines.base import EngineDelta, EngineRequest, Usage
from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.vllm_local import VllmLocalEngine, offline_environment
from gateway.app import create_app, running
from gateway.config import (
    AuditConfig,
    AuthConfig,
    Config,
    ConsoleConfig,
    GuardConfig,
    ModelConfig,
    ServerConfig,
    StorageConfig,
)
from gateway.generation.prompts import PromptRenderer
from gateway.observe.outcome import Outcome
from gateway.overload import OverloadConfig
from ops.models.prepare import DEFAULT_MODEL_NAME, prepare_default_model
from policy.auth import SYSTEM_TENANT
from policy.tenants import keys
from policy.tenants.base import TenantStore
from policy.tenants.models import ApiKey, Role, Tenant
from policy.tenants.sqlite import SqliteTenantStore

DATA_DIR = Path(os.environ.get("LOCKGATE_MODEL__DATA_DIR", "~/.cache/lockgate/models")).expanduser()
MODEL = DEFAULT_MODEL_NAME
SESSION_DIR = Path(tempfile.mkdtemp(prefix="lockgate-tests-"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (vLLM, torch, transformers: about half a million objects) out of the
    garbage collector's walk, as `lockgate serve` freezes what its start-up built: a full collection over
    them took 350 ms on an idle core, and more on a loaded machine stalled whichever test was running (a
    healthy store's round trips reached their timeout in CI). Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The prepared default model (built once if missing; offline)."""
    path, _ = prepare_default_model(DATA_DIR, say=lambda _line: None)
    return path


@pytest.fixture(scope="session")
async def vllm_engine(model_dir: Path) -> AsyncIterator[VllmLocalEngine]:
    """One real vLLM engine (AsyncLLM, engine core in a child process) for the whole test session."""
    os.environ.update(offline_environment(model_dir.parent))
    engine = VllmLocalEngine(model_dir, model_name=MODEL, max_model_len=2048, kv_cache_bytes=256 << 20)
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.fixture
async def real_client(
    vllm_engine: VllmLocalEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai SDK against a gateway on the real default model (the session's vLLM engine)."""
    app = create_app(
        make_config(), engine=vllm_engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
    )
    async with (
        serving(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=tenancy.consumer, max_retries=0) as sdk,
    ):
        yield sdk


@pytest.fixture(scope="session")
async def renderer(model_dir: Path) -> AsyncIterator[PromptRenderer]:
    """The default model's tokenizer and chat template."""
    executor = ThreadPoolExecutor(max_workers=1)
    yield await PromptRenderer.load(model_dir, executor)
    executor.shutdown()


@pytest.fixture(scope="session")
async def vllm_server(model_dir: Path) -> AsyncIterator[str]:
    """A real `vllm serve` replica (vLLM's OpenAI server in a subprocess) for the session; its base URL."""
    from tests.vllm_server import running_server

    async with running_server(model_dir) as url:
        yield url


@pytest.fixture
async def sim_engine() -> AsyncIterator[SimulatedEngine]:
    """A fresh simulated engine (fast steps) named like the default model."""
    engine = SimulatedEngine(
        SimulatorConfig(decode_step_s=0.002, decode_step_s_per_seq=0.0), model_name=MODEL
    )
    await engine.start()
    yield engine
    await engine.shutdown()


class CountingEngine(SimulatedEngine):
    """The simulator (fast steps), keeping the requests that reach it."""

    def __init__(self) -> None:
        super().__init__(SimulatorConfig(decode_step_s=0.002, decode_step_s_per_seq=0.0), model_name=MODEL)
        self.requests: list[EngineRequest] = []

    def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        self.requests.append(req)
        return super().generate(req)


class Tenancy:
    """A tenant store with one consumer tenant and the operator tenant, and a key of each."""

    def __init__(self, store: SqliteTenantStore, consumer: str, admin: str) -> None:
        self.store = store
        self.consumer = consumer
        self.admin = admin

    @property
    def consumer_headers(self) -> dict[str, str]:
        """Authorization of the consumer key."""
        return {"authorization": f"Bearer {self.consumer}"}

    @property
    def admin_headers(self) -> dict[str, str]:
        """Authorization of the operator's policy administrator key."""
        return {"authorization": f"Bearer {self.admin}"}


async def add_key(store: TenantStore, tenant_id: str, roles: tuple[Role, ...], now: float = 0.0) -> str:
    """Create a key in the store; return its plaintext."""
    plaintext, key_id, secret_hash = keys.new_key()
    key = ApiKey(key_id=key_id, tenant_id=tenant_id, roles=roles, created_at=now)
    await store.add_key(key, secret_hash, actor="test", now=now)
    return plaintext


async def operator_headers(store: TenantStore) -> dict[str, str]:
    """Authorization of a new `operator` key of the operating organisation (its tenant added if absent): what
    `/readyz` answers in detail, and `/metrics` answers."""
    if SYSTEM_TENANT not in {t.tenant_id for t in await store.list_tenants()}:
        await store.create_tenant(
            Tenant(tenant_id=SYSTEM_TENANT, display_name="Operator"), actor="test", now=0.0
        )
    return {"authorization": f"Bearer {await add_key(store, SYSTEM_TENANT, ('operator',))}"}


def keyless_metrics(config: Config) -> Config:
    """`config` with `GET /metrics` served without a key (`[metrics] require_key` off): for tests about what
    the series count, not about who may read them (tests/gateway/test_metrics.py tests that)."""
    return msgspec.structs.replace(config, metrics=msgspec.structs.replace(config.metrics, require_key=False))


@pytest.fixture
async def tenancy(tmp_path: Path) -> AsyncIterator[Tenancy]:
    """Tenant `acme` (no quotas) with a consumer key, and the operator tenant with a policy_admin key."""
    store = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    await store.create_tenant(Tenant(tenant_id="acme", display_name="Acme"), actor="test", now=0.0)
    await store.create_tenant(Tenant(tenant_id=SYSTEM_TENANT, display_name="Operator"), actor="test", now=0.0)
    consumer = await add_key(store, "acme", ("consumer",))
    admin = await add_key(store, SYSTEM_TENANT, ("policy_admin",))
    yield Tenancy(store, consumer, admin)
    await store.close()


class OutcomeLog:
    """Collects request outcomes reported by the app."""

    def __init__(self) -> None:
        self.items: list[Outcome] = []
        self._changed = asyncio.Event()

    def __call__(self, outcome: Outcome) -> None:
        self.items.append(outcome)
        self._changed.set()

    async def wait_count(self, count: int, within: float = 10.0) -> list[Outcome]:
        """Wait until at least `count` outcomes were reported."""
        async with asyncio.timeout(within):
            while len(self.items) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.items

    async def wait_for(self, request_id: str, within: float = 10.0) -> Outcome:
        """The outcome of `request_id`, waiting for it to be reported."""
        async with asyncio.timeout(within):
            while True:
                for item in self.items:
                    if item.request_id == request_id:
                        return item
                self._changed.clear()
                await self._changed.wait()


@pytest.fixture
def outcomes() -> OutcomeLog:
    """A sink that records every request outcome."""
    return OutcomeLog()


def make_config(**server: float | int) -> Config:
    """A config for in-process servers (server fields overridable). Stores that a test does not pass in
    (e.g. the registry) live in a temporary directory of the test session, never in the user's home."""
    app_id = uuid.uuid4().hex
    return Config(
        server=ServerConfig(**server),  # type: ignore[arg-type]
        model=ModelConfig(data_dir=str(DATA_DIR)),
        storage=StorageConfig(sqlite_path=str(SESSION_DIR / "lockgate.sqlite3")),
        # The rules stage alone: every request passes a real cascade without a guard engine per test.
        guard=GuardConfig(default_policy="rules"),
        # A key lookup bounded generously: on a loaded test machine a SQLite lookup took over the default
        # second, and the request got 503 store_unavailable in a test about something else (the outage
        # tests set their own bound).
        auth=AuthConfig(store_timeout=30.0),
        # One audit spool and checkpoint file per app: apps of one test session run side by side.
        audit=AuditConfig(
            spool_dir=str(SESSION_DIR / f"audit-spool-{app_id}"),
            checkpoint_file=str(SESSION_DIR / f"audit-checkpoints-{app_id}.jsonl"),
        ),
        # No shedding for event-loop lag or CPU: a test machine's loop runs late whenever another process
        # takes the core, the test client shares the loop with the app, and a shed request would fail a test
        # about something else (tests/gateway/test_overload.py sheds on purpose).
        overload=OverloadConfig(max_loop_lag=0.0, cpu_shedding=False),
        # In-process servers speak plain HTTP, over which a client keeps no `Secure` cookie
        # (tests/gateway/test_console_login.py checks the secure default).
        console=ConsoleConfig(insecure_cookie=True),
    )


def billed(usage: Mapping[str, Any] | Usage) -> int:
    """The tokens a request is charged for at the default price: its prompt and completion tokens and the
    guard tokens its output checks scored (`usage.guard_tokens`, absent when the output was not guarded)."""
    if isinstance(usage, Usage):
        return usage.prompt_tokens + usage.completion_tokens + usage.guard_tokens
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"]) + int(usage.get("guard_tokens") or 0)


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@asynccontextmanager
async def serving(app: Litestar, startup_timeout: float = 30.0) -> AsyncIterator[str]:
    """Run `app` under uvicorn in this event loop on a free loopback port; yield its base URL.

    `startup_timeout` bounds the app's start (raise it for apps that start engines of their own)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(startup_timeout):
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def lifespan(app: Litestar) -> AsyncIterator[None]:
    """Run the app's ASGI lifespan in this event loop (Litestar's test clients use a thread of their own)."""
    async with running(app):
        yield


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    """Poll `check` until it holds. For state owned by another process (vLLM's engine core), which has no
    event to wait on; fails after `within` seconds."""
    async with asyncio.timeout(within):
        while not await check():  # noqa: ASYNC110 - polling another process's state
            await asyncio.sleep(0.01)


def within_steps(engine: VllmLocalEngine, steps: int) -> float:
    """A hang guard for a wait of about `steps` engine steps: generous, and derived from the step time the
    engine measured on this host rather than guessed for a fast machine."""
    return 5.0 + 4 * steps * (engine.step_seconds or 1.0)


async def assert_vllm_idle(engine: VllmLocalEngine, *, steps: int | None = None) -> None:
    """vLLM itself holds no request: none unfinished in AsyncLLM, no KV blocks held in the engine core.
    With `steps`, it got there within that many engine steps from the call."""
    start = engine.steps.count

    async def front_end_empty() -> bool:
        return bool(engine.llm.get_num_unfinished_requests() == 0)

    await eventually(front_end_empty, within=within_steps(engine, steps or 4))
    # The engine core refuses to reset the prefix cache while a running request still holds KV blocks.
    await eventually(engine.llm.reset_prefix_cache, within=within_steps(engine, 2))
    load = await engine.load()
    assert (load.running, load.waiting, load.kv_tokens_used) == (0, 0, 0)
    if steps is not None:
        # An idle engine runs no step, so this counts every step from the call until the KV blocks were free.
        assert engine.steps.count - start <= steps, f"{engine.steps.count - start} steps to free the KV cache"


class RequestLines(logging.Handler):
    """The `lockgate.requests` lines, decoded (a handler on that logger: Litestar's logging setup replaces
    the root handlers, caplog's among them, when an app is built)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


@pytest.fixture
def request_log() -> Iterator[RequestLines]:
    logger = logging.getLogger("lockgate.requests")
    handler, level = RequestLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)
