"""Agent rollouts with retries: engine tokens the result cache and `Idempotency-Key` save against the
stateless path, in one run.

    python -m ops.bench.rollouts [--rollouts 4] [--steps 20] [--runs 2] [--retry-share 0.2]
                                 [--max-tokens 16] [--out DIR]

Three gateways on the zero-delay simulated engine, the default rules policy: `stateless` (the key
ignored: `[idempotency] enabled = false`, no result cache), `idempotent` (the default: keys honoured, no
result cache) and `cached` (keys honoured, `[result_cache] enabled`, memory store). Each gets the same
workload, one request at a time: `--rollouts` agent rollouts of `--steps` chat steps each (temperature 0;
each step sends the whole conversation so far, the model's earlier answers and a new observation), every
step with an `Idempotency-Key`, `--retry-share` of the steps (spread evenly) sent twice (a client whose
answer was lost), and the whole set run `--runs` times (an evaluation run again). Engine tokens are the
prompt and completion tokens of the answers that reached an engine: neither replayed by key
(`idempotent-replayed`) nor served from the cache (`x-lockgate-cache: hit`). Figures per gateway:
requests, engine calls, engine tokens, replays, hits, and the engine tokens saved against the stateless
gateway's. Written as `rollouts.json` under `--out`.

Not measured yet: sessions and their KV-cache affinity (issue 45's sessions API), which this workload would
then also run through.
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
    replayed: int  # answered from the idempotency store
    cache_hits: int
    saved_vs_stateless: float  # share of the stateless gateway's engine tokens not computed here


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
    replayed: int = 0
    cache_hits: int = 0


async def _step(
    http: httpx.AsyncClient, messages: list[dict[str, str]], key: str, max_tokens: int, tally: Tally
) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = await http.post("/v1/chat/completions", json=body, headers={"idempotency-key": key})
    if response.status_code != 200:
        raise RuntimeError(f"step {key}: {response.status_code} {response.text}")
    tally.requests += 1
    answer = response.json()
    if response.headers.get(REPLAYED_HEADER) == "true":
        tally.replayed += 1
    elif response.headers.get(CACHE_HEADER) == "hit":
        tally.cache_hits += 1
    else:
        tally.engine_calls += 1
        tally.engine_tokens += answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    return str(answer["choices"][0]["message"]["content"] or "")


async def run_workload(url: str, api_key: str, args: argparse.Namespace) -> Tally:
    """The workload against one gateway (the same requests, in the same order, for every gateway)."""
    # Spread evenly: step i is sent twice when it takes the retried share past a whole number.
    retried = [
        math.floor((i + 1) * args.retry_share) > math.floor(i * args.retry_share) for i in range(args.steps)
    ]
    tally = Tally()
    headers = {"authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        for run in range(args.runs):
            for rollout in range(args.rollouts):
                messages = [
                    {"role": "user", "content": f"Task {rollout}: look around the project and report."}
                ]
                for step in range(args.steps):
                    key = f"run{run}-rollout{rollout}-step{step}"
                    content = await _step(http, messages, key, args.max_tokens, tally)
                    if retried[step]:
                        await _step(http, messages, key, args.max_tokens, tally)
                    observation = OBSERVATIONS[(rollout + step) % len(OBSERVATIONS)]
                    messages += [
                        {"role": "assistant", "content": content},
                        {"role": "user", "content": f"Observation {step}: {observation}"},
                    ]
    return tally


async def measure(args: argparse.Namespace, workdir: Path) -> RolloutsReport:
    """Both gateways in turn, then the figures."""
    tallies: dict[str, Tally] = {}
    # One request at a time on the zero-delay engine keeps the gateway's core busy: that is no overload.
    common = {"LOCKGATE_OVERLOAD__CPU_SHEDDING": "false"}
    for name, env in (
        ("stateless", {**common, "LOCKGATE_IDEMPOTENCY__ENABLED": "false"}),
        ("idempotent", common),
        ("cached", {**common, "LOCKGATE_RESULT_CACHE__ENABLED": "true"}),
    ):
        directory = workdir / name
        directory.mkdir()
        cores = set(os.sched_getaffinity(0))
        server: Server = await start_gateway("memory", cores, directory, "rules", env=env, target=name)
        try:
            tallies[name] = await run_workload(f"http://127.0.0.1:{server.port}", server.api_key, args)
        finally:
            server.stop()
    baseline = tallies["stateless"].engine_tokens
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
                replayed=t.replayed,
                cache_hits=t.cache_hits,
                saved_vs_stateless=round(1 - t.engine_tokens / baseline, 4) if baseline else 0.0,
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
        f"{'gateway':<10} {'requests':>8} {'engine calls':>12} {'engine tokens':>13} {'replayed':>8} "
        f"{'hits':>6} {'saved':>7}"
    )
    for g in report.gateways:
        print(
            f"{g.gateway:<10} {g.requests:>8} {g.engine_calls:>12} {g.engine_tokens:>13} {g.replayed:>8} "
            f"{g.cache_hits:>6} {g.saved_vs_stateless:>7.1%}"
        )
    out = args.out or Path(tempfile.mkdtemp(prefix="lockgate-rollouts-out-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollouts.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    print(f"wrote {out / 'rollouts.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
