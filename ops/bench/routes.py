"""Routes benchmark: cost per request and answer quality of a confidence cascade against always-cheap and
always-strong, in one run through the gateway (the gate and the audit trail on).

    python -m ops.bench.routes [--requests 200] [--concurrency 8] [--max-tokens 16] [--threshold -0.9]
                               [--cheap-skill 0.6] [--strong-skill 0.95] [--strong-price 10] [--out DIR]

One `lockgate serve` with two simulated replicas that declare their answer quality (`SimulatorConfig.skill`:
a question's difficulty is a hash of its last tokens; an answer is right when the difficulty is under the
replica's skill, says so in its first word, and its tokens' log-probabilities are high when right and low
when wrong, with noise): the default model in pool `default` (`--cheap-skill`, fast steps) and `strong`, the
same weights in pool `strong` (`--strong-skill`, ten times slower steps). The route `auto` answers with the
default model and re-runs on `strong` when the answer's mean token log-probability is under `--threshold`.

The same `--requests` distinct questions go to each target: the default model, `strong`, and `auto`. Cost is
in declared units per token (prompt and completion): 1 for the default model, `--strong-price` for
`strong`. An escalated request costs both attempts: the first one generated `--max-tokens` tokens on the
same prompt (the simulator's free text runs to the limit, and a whole answer is measured in full). Quality
is the share of answers that say "right". Written as `routes.json` and `routes.png` (quality against cost)
under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec

from gateway.config import DEFAULT_MODEL_NAME
from ops.bench._servers import Server, start_gateway

MODEL = DEFAULT_MODEL_NAME
STRONG = "strong"
ROUTE = "auto"


class TargetFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What one target did with the questions."""

    target: str
    requests: int
    quality: float  # share of answers that say "right"
    cost_per_request: float  # declared units
    escalated: float  # share of requests the cascade re-ran on the strong model


class RoutesReport(msgspec.Struct, frozen=True, kw_only=True):
    """The whole run."""

    requests: int
    max_tokens: int
    threshold: float
    cheap_skill: float
    strong_skill: float
    strong_price: float
    targets: list[TargetFigures]


def config_text(args: argparse.Namespace) -> str:
    """The gateway's config: two simulated replicas of different skill and speed, the route's manifest."""
    return f"""
[registry]
manifest = "{args.manifest}"

[[engines]]
kind = "simulated"
[engines.simulator]
decode_step_s = 0.0005
decode_step_s_per_seq = 0
prefill_s_per_token = 0
skill = {args.cheap_skill}

[[engines]]
kind = "simulated"
pool = "{STRONG}"
[engines.simulator]
decode_step_s = 0.005
decode_step_s_per_seq = 0
prefill_s_per_token = 0
skill = {args.strong_skill}
"""


async def publish_strong(env: dict[str, str]) -> None:
    """Before the gateway starts: the served model registered as it will be, and `strong` (the same
    weights in pool `strong`) with its alias, in the registry the gateway opens."""
    from gateway.config import load_config
    from registry.db.stores import open_store
    from registry.default_model import register_default_model
    from registry.service import Registry
    from registry.store import REGISTRY_STORE

    config = load_config(env=env)
    store = await open_store(REGISTRY_STORE, config.storage)
    try:
        registry = await Registry.load(store, lambda: 0.0, 1.0)
        served = await register_default_model(
            registry, config.model.model_dir(), public_name=config.model.name, actor="bench"
        )
        strong = msgspec.structs.replace(served.spec, engine_pool=STRONG)
        await registry.publish("model", STRONG, "1", strong, actor="bench")
        await registry.set_alias("model", STRONG, "1", actor="bench")
    finally:
        await store.close()


MANIFEST = """
[[route]]
name = "{route}"
version = "1"
default = "{model}"
cascade = {{ strong = "{strong}", min_mean_logprob = {threshold} }}

[[alias]]
kind = "route"
name = "{route}"
version = "1"
"""


class Tally(msgspec.Struct, kw_only=True):
    requests: int = 0
    right: int = 0
    cost: float = 0.0
    escalated: int = 0


async def ask(
    http: httpx.AsyncClient, target: str, question: str, args: argparse.Namespace, tally: Tally
) -> None:
    body = {
        "model": target,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": args.max_tokens,
    }
    answer = await http.post("/v1/chat/completions", json=body)
    if answer.status_code != 200:
        raise RuntimeError(f"{target}: {answer.status_code} {answer.text}")
    whole = answer.json()
    usage = whole["usage"]
    tokens = usage["prompt_tokens"] + usage["completion_tokens"]
    price = args.strong_price if whole["model"] == STRONG else 1.0
    tally.requests += 1
    tally.cost += price * tokens
    if "escalated" in answer.headers.get("x-lockgate-route", ""):
        tally.escalated += 1
        tally.cost += usage["prompt_tokens"] + args.max_tokens  # the first attempt, on the cheap model
    text = whole["choices"][0]["message"]["content"] or ""
    tally.right += text.lstrip().startswith("right")


async def run_target(url: str, key: str, target: str, args: argparse.Namespace) -> TargetFigures:
    tally = Tally()
    questions = asyncio.Queue[str]()
    for i in range(args.requests):
        questions.put_nowait(f"Question {i}: what is the answer to puzzle number {i * 7919 % 10007}?")
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:

        async def worker() -> None:
            while not questions.empty():
                await ask(http, target, questions.get_nowait(), args, tally)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    n = max(tally.requests, 1)
    return TargetFigures(
        target=target,
        requests=tally.requests,
        quality=round(tally.right / n, 4),
        cost_per_request=round(tally.cost / n, 2),
        escalated=round(tally.escalated / n, 4),
    )


async def measure(args: argparse.Namespace, workdir: Path) -> RoutesReport:
    manifest = workdir / "routes.toml"
    manifest.write_text(
        MANIFEST.format(route=ROUTE, model=MODEL, strong=STRONG, threshold=args.threshold), encoding="utf-8"
    )
    args.manifest = manifest
    config = workdir / "gateway.toml"
    config.write_text(config_text(args), encoding="utf-8")
    serve = ["-m", "gateway.cli", "serve", "--config", str(config)]
    env = {"LOCKGATE_OVERLOAD__CPU_SHEDDING": "false"}
    cores = set(os.sched_getaffinity(0))
    server: Server = await start_gateway(
        "memory", cores, workdir, "rules", env=env, target="routes", command=serve, prepare=publish_strong
    )
    try:
        url = f"http://127.0.0.1:{server.port}"
        targets = [await run_target(url, server.api_key, t, args) for t in (MODEL, STRONG, ROUTE)]
    finally:
        server.stop()
    return RoutesReport(
        requests=args.requests,
        max_tokens=args.max_tokens,
        threshold=args.threshold,
        cheap_skill=args.cheap_skill,
        strong_skill=args.strong_skill,
        strong_price=args.strong_price,
        targets=targets,
    )


def plot(report: RoutesReport, path: Path) -> bool:
    """Quality against cost per request, one point per target; False without matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in report.targets:
        ax.scatter([t.cost_per_request], [t.quality], s=60)
        ax.annotate(t.target, (t.cost_per_request, t.quality), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("cost per request (declared units)")
    ax.set_ylabel("quality (share of right answers)")
    ax.set_title(f"cascade at {report.threshold} vs always-cheap and always-strong")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ops.bench.routes", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=-0.9, help="the cascade's min mean logprob")
    parser.add_argument("--cheap-skill", type=float, default=0.6)
    parser.add_argument("--strong-skill", type=float, default=0.95)
    parser.add_argument("--strong-price", type=float, default=10.0, help="per token; the cheap one's is 1")
    parser.add_argument("--out", type=Path, default=None, help="where routes.json and routes.png go")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lockgate-routes-") as tmp:
        report = asyncio.run(measure(args, Path(tmp)))
    print(
        f"{args.requests} questions per target; skills {args.cheap_skill} / {args.strong_skill}, "
        f"strong price x{args.strong_price}, cascade below {args.threshold}"
    )
    print(f"{'target':<24} {'quality':>8} {'cost/request':>13} {'escalated':>10}")
    for t in report.targets:
        print(f"{t.target:<24} {t.quality:>8.1%} {t.cost_per_request:>13.1f} {t.escalated:>10.1%}")
    out = args.out or Path(tempfile.mkdtemp(prefix="lockgate-routes-out-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "routes.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    plotted = plot(report, out / "routes.png")
    print(f"wrote {out / 'routes.json'}" + (f" and {out / 'routes.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
