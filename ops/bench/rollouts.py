"""Agent rollouts with retries: engine tokens that KV-cache affinity, sessions, the result cache and
`Idempotency-Key` save against the stateless path, in one run.

    python -m ops.bench.rollouts [--rollouts 4] [--steps 20] [--runs 2] [--retry-share 0.2]
                                 [--max-tokens 16] [--out DIR]

Gateways on two zero-delay simulated replicas with a simulated prefix cache (blocks of 16 tokens: a prompt's
leading blocks that an earlier request left on the same replica are not prefilled again and count as
`cached_tokens`), the default rules policy:

    no_affinity  stateless (keys ignored, no result cache) and the router's prefix and session affinity off
    stateless    keys ignored, no result cache: the stateless path as it is served
    idempotent   the default: keys honoured, no result cache
    cached       keys honoured, `[result_cache] enabled` (memory store)
    session      `/v1/sessions`: each rollout one session, each step only its new message (numbered: a
                 retry is the same step sent again), with the result cache on

Each gets the same workload: `--rollouts` agent rollouts run side by side (so that they compete for the
replicas), each of `--steps` chat steps (temperature 0; the conversation so far, the model's earlier answers
and a new observation), every step with an `Idempotency-Key` (or its step number), `--retry-share` of the
steps (spread evenly) sent twice (a client whose answer was lost), and the whole set run `--runs` times (an
evaluation run again). Engine tokens are the prompt and completion tokens of the answers that reached an
engine: neither replayed (`idempotent-replayed`) nor served from the cache (`x-lockgate-cache: hit`);
computed tokens are those less the prompt tokens the engine found in its prefix cache. Figures per gateway:
requests, engine calls, engine tokens, cached and computed tokens, replays, hits, and the engine and computed
tokens saved against the stateless gateway's. Engine calls, replays and hits follow from the workload;
cached tokens depend on where the router sent each step. Written as `rollouts.json` under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec

from gateway.config import DEFAULT_MODEL_NAME
from gateway.generation.caching import CACHE_HEADER
from gateway.idempotency.replay import REPLAYED_HEADER
from ops.bench._servers import Server, start_gateway

MODEL = DEFAULT_MODEL_NAME
OBSERVATIONS = (
    "The file lists three functions.",
    "The test suite reports two failures.",
    "The directory holds a README and a src folder.",
    "The command printed a version number.",
    "The search returned four results.",
)


class GatewayFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What one gateway did with the workload."""

    gateway: str
    requests: int
    engine_calls: int
    engine_tokens: int
    cached_tokens: int  # prompt tokens of engine calls found in the engine's prefix cache
    computed_tokens: int  # engine tokens less cached tokens
    replayed: int  # answered from the idempotency store, or a session's recorded step
    cache_hits: int
    saved_vs_stateless: float  # share of the stateless gateway's engine tokens not sent to an engine here
    computed_saved_vs_stateless: float  # share of the stateless gateway's computed tokens not computed here


class RolloutsReport(msgspec.Struct, frozen=True, kw_only=True):
    """The whole run."""

    rollouts: int
    steps: int
    runs: int
    retry_share: float
    max_tokens: int
    gateways: list[GatewayFigures]


class Tally(msgspec.Struct, kw_only=True):
    """Counts of one gateway's run."""

    requests: int = 0
    engine_calls: int = 0
    engine_tokens: int = 0
    cached_tokens: int = 0
    replayed: int = 0
    cache_hits: int = 0


def _counted(response: httpx.Response, what: str, tally: Tally) -> str:
    """The answer's text, with the response counted in `tally`."""
    if response.status_code != 200:
        raise RuntimeError(f"{what}: {response.status_code} {response.text}")
    tally.requests += 1
    answer = response.json()
    if response.headers.get(REPLAYED_HEADER) == "true":
        tally.replayed += 1
    elif response.headers.get(CACHE_HEADER) == "hit":
        tally.cache_hits += 1
    else:
        usage = answer["usage"]
        tally.engine_calls += 1
        tally.engine_tokens += usage["prompt_tokens"] + usage["completion_tokens"]
        tally.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return str(answer["choices"][0]["message"]["content"] or "")


def _retried(args: argparse.Namespace) -> list[bool]:
    """Whether each step is sent twice: spread evenly, step i when it takes the share past a whole number."""
    share = args.retry_share
    return [math.floor((i + 1) * share) > math.floor(i * share) for i in range(args.steps)]


def _task(rollout: int) -> dict[str, str]:
    return {"role": "user", "content": f"Task {rollout}: look around the project and report."}


def _observation(rollout: int, step: int) -> dict[str, str]:
    return {
        "role": "user",
        "content": f"Observation {step}: {OBSERVATIONS[(rollout + step) % len(OBSERVATIONS)]}",
    }


async def _stateless(
    http: httpx.AsyncClient, run: int, rollout: int, args: argparse.Namespace, tally: Tally
) -> None:
    """One rollout through the chat route: each step sends the whole conversation, with a key."""
    messages = [_task(rollout)]
    retried = _retried(args)
    for step in range(args.steps):
        key = f"run{run}-rollout{rollout}-step{step}"
        body = {"model": MODEL, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0}
        for _ in range(2 if retried[step] else 1):
            answer = await http.post("/v1/chat/completions", json=body, headers={"idempotency-key": key})
            content = _counted(answer, key, tally)
        messages = [*messages, {"role": "assistant", "content": content}, _observation(rollout, step)]


async def _session(
    http: httpx.AsyncClient, run: int, rollout: int, args: argparse.Namespace, tally: Tally
) -> None:
    """One rollout as a session: each step sends only its new message, numbered."""
    created = await http.post("/v1/sessions", json={"model": MODEL})
    if created.status_code != 200:
        raise RuntimeError(f"session: {created.status_code} {created.text}")
    session = created.json()["id"]
    retried = _retried(args)
    for step in range(args.steps):
        message = _task(rollout) if step == 0 else _observation(rollout, step - 1)
        body = {"step": step + 1, "messages": [message], "max_tokens": args.max_tokens, "temperature": 0}
        for _ in range(2 if retried[step] else 1):
            answer = await http.post(f"/v1/sessions/{session}/messages", json=body)
            _counted(answer, f"run{run}-rollout{rollout}-step{step}", tally)


async def run_workload(url: str, api_key: str, args: argparse.Namespace, *, sessions: bool = False) -> Tally:
    """The workload against one gateway (the same rollouts for every gateway; those of one run side by
    side)."""
    tally = Tally()
    rollout = _session if sessions else _stateless
    headers = {"authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        for run in range(args.runs):
            await asyncio.gather(*(rollout(http, run, r, args, tally) for r in range(args.rollouts)))
    return tally


# Two simulated replicas with a prefix cache, for every gateway.
REPLICAS = """
[engine.simulator]
prefix_cache_block = 16

[[engines]]
kind = "simulated"

[[engines]]
kind = "simulated"
"""
NO_AFFINITY = {
    "LOCKGATE_ROUTING__ROUTER__PREFIX_WEIGHT": "0",
    "LOCKGATE_ROUTING__ROUTER__SESSION_WEIGHT": "0",
}


async def measure(args: argparse.Namespace, workdir: Path) -> RolloutsReport:
    """The gateways in turn, then the figures."""
    tallies: dict[str, Tally] = {}
    # Requests on the zero-delay engine keep the gateway's core busy: that is no overload.
    common = {"LOCKGATE_OVERLOAD__CPU_SHEDDING": "false"}
    stateless = {**common, "LOCKGATE_IDEMPOTENCY__ENABLED": "false"}
    cached = {**common, "LOCKGATE_RESULT_CACHE__ENABLED": "true"}
    config = workdir / "replicas.toml"
    config.write_text(REPLICAS, encoding="utf-8")
    serve = ["-m", "gateway.cli", "serve", "--config", str(config)]
    for name, env in (
        ("no_affinity", {**stateless, **NO_AFFINITY}),
        ("stateless", stateless),
        ("idempotent", common),
        ("cached", cached),
        ("session", cached),
    ):
        directory = workdir / name
        directory.mkdir()
        cores = set(os.sched_getaffinity(0))
        server: Server = await start_gateway(
            "memory", cores, directory, "rules", env=env, target=name, command=serve
        )
        try:
            url = f"http://127.0.0.1:{server.port}"
            tallies[name] = await run_workload(url, server.api_key, args, sessions=name == "session")
        finally:
            server.stop()
    base = tallies["stateless"]

    def saved(value: int, baseline: int) -> float:
        return round(1 - value / baseline, 4) if baseline else 0.0

    return RolloutsReport(
        rollouts=args.rollouts,
        steps=args.steps,
        runs=args.runs,
        retry_share=args.retry_share,
        max_tokens=args.max_tokens,
        gateways=[
            GatewayFigures(
                gateway=name,
                requests=t.requests,
                engine_calls=t.engine_calls,
                engine_tokens=t.engine_tokens,
                cached_tokens=t.cached_tokens,
                computed_tokens=t.engine_tokens - t.cached_tokens,
                replayed=t.replayed,
                cache_hits=t.cache_hits,
                saved_vs_stateless=saved(t.engine_tokens, base.engine_tokens),
                computed_saved_vs_stateless=saved(
                    t.engine_tokens - t.cached_tokens, base.engine_tokens - base.cached_tokens
                ),
            )
            for name, t in tallies.items()
        ],
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ops.bench.rollouts", description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=2, help="times the whole set of rollouts is run")
    parser.add_argument("--retry-share", type=float, default=0.2, help="share of steps sent twice")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--out", type=Path, default=None, help="where rollouts.json goes (default: a temp dir)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lockgate-rollouts-") as tmp:
        report = asyncio.run(measure(args, Path(tmp)))
    print(
        f"{args.rollouts} rollouts x {args.steps} steps x {args.runs} runs, "
        f"{args.retry_share:.0%} of steps retried"
    )
    print(
        f"{'gateway':<12} {'requests':>8} {'engine calls':>12} {'engine tokens':>13} {'cached':>7} "
        f"{'computed':>8} {'replayed':>8} {'hits':>5} {'saved':>6} {'computed saved':>14}"
    )
    for g in report.gateways:
        print(
            f"{g.gateway:<12} {g.requests:>8} {g.engine_calls:>12} {g.engine_tokens:>13} "
            f"{g.cached_tokens:>7} {g.computed_tokens:>8} {g.replayed:>8} {g.cache_hits:>5} "
            f"{g.saved_vs_stateless:>6.1%} {g.computed_saved_vs_stateless:>14.1%}"
        )
    out = args.out or Path(tempfile.mkdtemp(prefix="lockgate-rollouts-out-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollouts.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    print(f"wrote {out / 'rollouts.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
