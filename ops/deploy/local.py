"""`python -m ops.deploy.local`: the fleet of the Kubernetes manifests on one machine, on loopback: two
gateway processes and two `vllm serve` replicas (`ops.deploy.vllm_server`'s flags), Redis (a server of its
own on a free port) and PostgreSQL (a schema of its own on the server `--postgres-dsn` names: these machines
run one on loopback), with the config the manifests use (`ops/deploy/kubernetes/base/lockgate.toml`, its
addresses rewritten to the ports started here) and fresh secrets (`ops.deploy.secrets`). It prints the
endpoints and stops everything it started on Ctrl-C or SIGTERM.

    python -m ops.deploy.local [--gateways 2] [--postgres-dsn DSN] [--dir DIR]

`LocalFleet` is the same as a library: the end-to-end test (`tests/ops/test_local_fleet.py`) starts it,
restarts a gateway and an engine under traffic, and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import httpx

from engines.host import detect_dtype
from engines.vllm_local import offline_environment
from gateway.config import load_config
from ops.deploy import secrets
from ops.deploy.vllm_server import SHUTDOWN_TIMEOUT, server_flags

BASE = Path(__file__).resolve().parent / "kubernetes" / "base" / "lockgate.toml"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
# Seconds a vLLM server may take to answer /health (a CPU server loads in 30-40 s; two at once, longer).
ENGINE_START = 420.0
GATEWAY_START = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A process of the fleet, in its own process group, logging to a file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, list(argv), env, log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, env=self.env, stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True
            )

    async def stop(self, grace: float = 60.0, *, group: bool = True) -> None:
        """SIGTERM (a gateway drains), then SIGKILL after `grace` seconds; its whole group either way.
        `group=False` sends the SIGTERM to the leader alone, as a kubelet does to a container's first process
        (a vLLM server then drains; its engine process, signalled directly, would abort what it runs)."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                if group:
                    os.killpg(proc.pid, signal.SIGTERM)
                else:
                    proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(grace):
                    await proc.wait()
            except TimeoutError:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


class LocalFleet:
    """The manifests' fleet on loopback (module docstring)."""

    def __init__(
        self,
        directory: Path,
        *,
        gateways: int = 2,
        postgres_dsn: str = DEFAULT_DSN,
        data_dir: str | None = None,
        extra_env: dict[str, str] | None = None,
        engine_command: Callable[[int, int], list[str]] | None = None,
    ) -> None:
        """`extra_env`: more LOCKGATE_* overrides for every gateway (a test's); `engine_command`: the argv of
        engine `index` on `port` in place of a vLLM server (a test's stand-in, which must answer /health)."""
        self.dir = directory
        self.extra_env = dict(extra_env or {})
        self.engine_command = engine_command
        self.postgres_dsn = postgres_dsn
        self.schema = f"lockgate_local_{uuid.uuid4().hex[:12]}"
        self.data_dir = data_dir or load_config(env={}).model.data_dir
        self.redis_port = free_port()
        # The manifests' engines: one local server for each [[engines]] of their TOML.
        self.engine_ports = [free_port() for _ in BASE.read_text(encoding="utf-8").split("[[engines]]")[1:]]
        self.gateway_ports = [free_port() for _ in range(gateways)]
        self.redis: Child | None = None
        self.engines: list[Child] = []
        self.gateways: list[Child] = []
        self.secret_env: dict[str, str] = {}

    # -- addresses ---------------------------------------------------------------------------------

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.engine_ports]

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.gateway_ports]

    @property
    def config_path(self) -> Path:
        return self.dir / "lockgate.toml"

    def gateway_env(self, index: int) -> dict[str, str]:
        """The environment gateway `index` runs with: the secrets, the schema, its port and own files."""
        own = self.dir / f"gateway-{index}"
        return {
            **os.environ,
            **self.secret_env,
            **self.extra_env,
            "LOCKGATE_STORAGE__POSTGRES_SCHEMA": self.schema,
            "LOCKGATE_SERVER__PORT": str(self.gateway_ports[index]),
            "LOCKGATE_AUDIT__SPOOL_DIR": str(own / "audit-spool"),
            "LOCKGATE_AUDIT__CHECKPOINT_FILE": str(own / "audit-checkpoints.jsonl"),
        }

    # -- start and stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_secrets()
        self._write_config()
        self.redis = Child(
            "redis",
            [
                "redis-server",
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
            ],
            dict(os.environ),
            self.dir / "redis.log",
        )
        await self.redis.start()
        self.engines = [self._engine(i) for i in range(len(self.engine_ports))]
        for engine in self.engines:
            await engine.start()
        await asyncio.gather(*(self.wait_engine(i) for i in range(len(self.engines))))
        self.gateways = [self._gateway(i) for i in range(len(self.gateway_ports))]
        # The first alone: its start migrates the fresh schema; then the others at once.
        await self.gateways[0].start()
        await self.wait_gateway(0)
        for gateway in self.gateways[1:]:
            await gateway.start()
        await asyncio.gather(*(self.wait_gateway(i) for i in range(1, len(self.gateways))))

    async def stop(self) -> None:
        """Stop the gateways (draining), the engines, Redis; drop the schema."""
        for child in [*self.gateways, *self.engines]:
            await child.stop()
        if self.redis is not None:
            await self.redis.stop(grace=10.0)
        with contextlib.suppress(OSError, asyncpg.PostgresError):
            conn = await asyncpg.connect(self.postgres_dsn, timeout=10)
            try:
                await conn.execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")
            finally:
                await conn.close()

    async def restart_gateway(self, index: int) -> None:
        """A rolling restart of one gateway: SIGTERM (in-flight requests drain), then a new process."""
        await self.gateways[index].stop()
        self.gateways[index] = self._gateway(index)
        await self.gateways[index].start()
        await self.wait_gateway(index)

    async def stop_engine(self, index: int) -> None:
        """Stop engine `index` as a rollout does: it finishes what it runs (`SHUTDOWN_TIMEOUT`), refusing
        new requests meanwhile (the gateways fail those over), then exits."""
        await self.engines[index].stop(grace=SHUTDOWN_TIMEOUT + 15.0, group=False)

    async def start_engine(self, index: int) -> None:
        await self.engines[index].start()
        await self.wait_engine(index)

    async def wait_engine(self, index: int) -> None:
        await _until_ok(f"{self.engine_urls[index]}/health", self.engines[index], ENGINE_START)

    async def wait_gateway(self, index: int) -> None:
        await _until_ok(f"{self.gateway_urls[index]}/readyz", self.gateways[index], GATEWAY_START)

    # -- pieces ------------------------------------------------------------------------------------

    def _write_secrets(self) -> None:
        keys = self.dir / "keys"
        keys.mkdir(exist_ok=True)
        secrets.write(keys, postgres_host="127.0.0.1", force=True)
        values = dict(
            line.split("=", 1) for line in (keys / secrets.ENV_FILE).read_text().splitlines() if line
        )
        self.secret_env = {
            "LOCKGATE_STORAGE__POSTGRES_DSN": self.postgres_dsn,
            "LOCKGATE_AUDIT__MAC_KEY": values["audit-mac-key"],
            "LOCKGATE_REGISTRY__SECRET": values["registry-secret"],
        }

    def _write_config(self) -> None:
        """The manifests' TOML, its cluster addresses and paths rewritten to this machine's."""
        text = BASE.read_text(encoding="utf-8")
        replacements = {
            "redis://redis:6379/0": f"redis://127.0.0.1:{self.redis_port}/0",
            '"0.0.0.0"': '"127.0.0.1"',
            "/opt/lockgate/models": str(Path(self.data_dir).expanduser()),
            "/var/lib/lockgate": str(self.dir / "state"),
            "/etc/lockgate/keys": str(self.dir / "keys"),
        }
        for i, url in enumerate(self.engine_urls):
            replacements[f"http://vllm-{i}.vllm:8000"] = url
        for old, new in replacements.items():
            if old not in text:
                raise ValueError(f"{BASE} no longer holds {old!r}: update ops.deploy.local")
            text = text.replace(old, new)
        self.config_path.write_text(text, encoding="utf-8")

    def _engine(self, index: int) -> Child:
        log = self.dir / f"engine-{index}.log"
        if self.engine_command is not None:
            return Child(
                f"engine-{index}", self.engine_command(index, self.engine_ports[index]), {**os.environ}, log
            )
        config = load_config(self.config_path, env=self.gateway_env(0))
        spec = config.engines[index]
        remote = spec.remote
        assert remote is not None
        model_dir = Path(self.data_dir).expanduser() / remote.served_model
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            f"--model={model_dir}",
            "--host=127.0.0.1",
            f"--port={self.engine_ports[index]}",
            f"--dtype={detect_dtype('auto')}",
            *server_flags(
                served_model=remote.served_model,
                max_model_len=remote.max_model_len,
                max_num_seqs=remote.max_num_seqs,
                kv_cache_bytes=spec.kv_cache_bytes,
            ),
        ]
        env = {**os.environ, **offline_environment(Path(self.data_dir))}
        return Child(f"engine-{index}", argv, env, log)

    def _gateway(self, index: int) -> Child:
        argv = [sys.executable, "-m", "gateway.cli", "--config", str(self.config_path), "serve"]
        return Child(f"gateway-{index}", argv, self.gateway_env(index), self.dir / f"gateway-{index}.log")


async def _until_ok(url: str, child: Child, within: float) -> None:
    """Poll `url` until it answers 200; RuntimeError with the child's log if it exits or time runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            if child.proc is not None and child.proc.returncode is not None:
                raise RuntimeError(f"{child.name} exited ({child.proc.returncode}):\n{child.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(url)).status_code == 200:
                    return
            if loop.time() > deadline:
                raise RuntimeError(f"{child.name} not ready at {url} within {within:g} s:\n{child.tail()}")
            await asyncio.sleep(0.5)


async def _serve(args: argparse.Namespace) -> int:
    directory = args.dir or Path(tempfile.mkdtemp(prefix="lockgate-fleet-"))
    fleet = LocalFleet(directory, gateways=args.gateways, postgres_dsn=args.postgres_dsn)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"starting the fleet in {directory} (engines take a minute or two on CPU)", flush=True)
        await fleet.start()
        for url in fleet.gateway_urls:
            print(f"gateway  {url}  (OpenAI API at {url}/v1)")
        for url in fleet.engine_urls:
            print(f"engine   {url}")
        print(f"redis    redis://127.0.0.1:{fleet.redis_port}/0")
        print(f"postgres {args.postgres_dsn} schema {fleet.schema}")
        print(
            f"a key: LOCKGATE_STORAGE__POSTGRES_DSN={args.postgres_dsn} LOCKGATE_STORAGE__POSTGRES_SCHEMA="
            f"{fleet.schema} .venv/bin/lockgate --config {fleet.config_path} admin create-key --tenant demo "
            "--role consumer"
        )
        print("Ctrl-C stops everything", flush=True)
        await stop.wait()
    finally:
        await fleet.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.deploy.local", description=__doc__.splitlines()[0])
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument(
        "--postgres-dsn", default=DEFAULT_DSN, help="a PostgreSQL server to hold a fresh schema"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where logs, config and secrets go")
    return asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
