"""Guard evaluation CLI.

    python -m ops.eval score  --data ops/eval/data/dev.jsonl [--split test] --out scores.jsonl
                              [--policy-file POLICY.json | --policy default [--config lockgate.toml]]
                              [--early-exit]
    python -m ops.eval replay --scores scores.jsonl --data ops/eval/data/dev.jsonl
                              --thresholds '0.2,0.8;0.3,0.7/0.1,0.95' [--band escalate|block] [--split test]
                              [--json]
    python -m ops.eval report --scores scores.jsonl --data ops/eval/data/dev.jsonl
                              [--band escalate|block] [--split test] [--json]
    python -m ops.eval replies --key KEY [--url http://127.0.0.1:8080] [--count 200] [--split test]
    python -m ops.eval overturned --key REVIEWER_KEY [--url http://127.0.0.1:8080] --out overturned.jsonl
    python -m ops.eval calibrate --scores scores.jsonl --data ops/eval/data/guard --split calibration
                              [--lookalike-fpr 0.05] [--band-share 0.10] [--safe-output-fpr 0]
                              [--everyday-fpr 0.03]
                              [--step 0.05] [--keep INDEX] [--json]
    python -m ops.eval combine --scores C.jsonl --split calibration --measure-scores T.jsonl
                              [--measure-split test] --data ops/eval/data/guard --stages 1 2
                              [--lookalike-fpr 0.05] [--everyday-fpr 0.03] [--json]

`score` runs every stage on every item (unless `--early-exit`), so `replay` is exact for any thresholds. With
`--policy` it scores a registry policy with the guards and engines the service builds from its configuration;
with `--policy-file` a policy of rules stages; with neither, the starter rules (`guard.rules.default_rules`)
as one stage. `report` decides items at the thresholds stored with their scores; `replay` at the given ones
(`allow_below,block_above` per stage, stages separated by `;`; a stage judges items of shape `output` at its
output pair when one follows a `/`, as in `0.3,0.7/0.1,0.95`, else at the same pair). `calibrate` chooses the
model stages' thresholds on the calibration split under a declared budget (`ops/eval/calibrate.py`), a pair
for prompts and one for outputs, and prints them (in `--thresholds` syntax) with the budget met; replay them
on `--split test` for the figures to report. `report` and `replay` evaluate the items of the data file (of
`--split`, when given) that have scores, and print markdown (or the report's JSON with `--json`).
`combine` fits one score over the named stages on the first scores' split and sets it, and each stage
alone, against the same false-positive rule on the second's (`ops/eval/combine.py`), then prints the
combination as a policy's `combine` stage, ready to publish. `overturned` exports
the blocks reviewers overturned as labelled false positives (`ops/eval/feedback.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec

from guard.labelled import LabelledItem, load_items
from ops.eval import combine, feedback, reply_check
from ops.eval.calibrate import Budget, calibrate
from ops.eval.cascades import UnsupportedStageError, default_rules_cascade, load_policy, policy_cascade
from ops.eval.evaluation import (
    ItemScores,
    Thresholds,
    dataset_sha256,
    evaluate,
    load_scores,
    parse_thresholds,
    save_scores,
    score_with_cascade,
    show_thresholds,
)
from ops.eval.feedback import ExportCounts, FalsePositive
from ops.eval.reply_check import ReplyCheck
from ops.eval.report import render
from registry.errors import InvalidError


def _evaluated(
    items: Sequence[LabelledItem], split: str | None, scores: Sequence[ItemScores]
) -> list[LabelledItem]:
    """The items of `split` (all when None) that have scores; exits when a score names an unknown item."""
    known = {i.id for i in items}
    scored = {s.id for s in scores}
    if strangers := sorted(scored - known):
        raise SystemExit(f"scores for {len(strangers)} item(s) not in the data file, e.g. {strangers[:3]}")
    selected = [i for i in items if split is None or i.split == split]
    chosen = [i for i in selected if i.id in scored]
    if len(chosen) < len(selected):
        print(
            f"note: {len(selected) - len(chosen)} of {len(selected)} selected items have no scores",
            file=sys.stderr,
        )
    if not chosen:
        raise SystemExit("no scored items to evaluate")
    return chosen


def _print_report(
    args: argparse.Namespace,
    thresholds: tuple[list[Thresholds], list[Thresholds]] | None,
    title: str,
) -> int:
    items = load_items(args.data)
    scores = load_scores(args.scores)
    chosen = _evaluated(items, args.split, scores)
    inputs, outputs = thresholds if thresholds is not None else (None, None)
    try:
        report = evaluate(
            chosen,
            scores,
            inputs,
            args.band,
            output_thresholds=outputs,
            dataset_sha256=dataset_sha256(args.data),
        )
    except ValueError as exc:  # e.g. a number of thresholds that does not match the stages
        raise SystemExit(str(exc)) from exc
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report)).decode() + "\n")
    else:
        split = f", split {args.split}" if args.split else ""
        sys.stdout.write(render(report, title=f"{title}{split}"))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    return _print_report(args, None, "Guard evaluation at the stored thresholds")


def _cmd_replay(args: argparse.Namespace) -> int:
    try:
        thresholds = parse_thresholds(args.thresholds)
    except ValueError as exc:
        raise SystemExit(f"--thresholds: {exc}") from exc
    return _print_report(args, thresholds, f"Guard evaluation replayed at {show_thresholds(*thresholds)}")


async def _score_service_policy(args: argparse.Namespace, items: list[LabelledItem]) -> list[ItemScores]:
    from gateway.config import load_config
    from ops.eval.served_guards import service_cascade

    async with service_cascade(load_config(args.config), args.policy) as (ref, cascade):
        print(f"scoring {len(items)} items with policy {ref} ({len(cascade.stages)} stages)", file=sys.stderr)
        return await score_with_cascade(cascade, items, all_stages=not args.early_exit)


def _cmd_score(args: argparse.Namespace) -> int:
    items = [i for i in load_items(args.data) if args.split is None or i.split == args.split]
    if args.policy:
        scores = asyncio.run(_score_service_policy(args, items))
    else:
        try:
            cascade = (
                policy_cascade(load_policy(args.policy_file)) if args.policy_file else default_rules_cascade()
            )
        except (UnsupportedStageError, InvalidError) as exc:
            raise SystemExit(str(exc)) from exc
        scores = asyncio.run(score_with_cascade(cascade, items, all_stages=not args.early_exit))
    save_scores(args.out, scores)
    stages = max((s.stages for s in scores), default=0)
    print(
        f"scored {len(scores)} items with {stages} stage(s); dataset sha256 {dataset_sha256(args.data)}; "
        f"wrote {args.out}",
        file=sys.stderr,
    )
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.split != "calibration":
        print("note: thresholds are meant to be chosen on --split calibration", file=sys.stderr)
    items = load_items(args.data)
    chosen = _evaluated(items, args.split, load_scores(args.scores))
    budget = Budget(
        lookalike_fpr=args.lookalike_fpr,
        band=args.band_share,
        safe_outputs=args.safe_output_fpr,
        everyday_prompts=args.everyday_fpr,
    )
    try:
        result = calibrate(
            chosen,
            load_scores(args.scores),
            budget,
            step=args.step,
            keep=args.keep,
            dataset_sha256=dataset_sha256(args.data),
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result)).decode() + "\n")
        return 0
    shown = show_thresholds(result.thresholds, result.output_thresholds)
    verdict = "met" if result.met else "NOT met (the least over it)"
    sys.stdout.write(
        f"thresholds {shown} (--thresholds '{shown}'), on {len(chosen)} items of split {args.split}\n"
        f"budget: look-alikes blocked <= {budget.lookalike_fpr:.0%}, "
        f"escalated <= {budget.band:.0%}, safe outputs blocked <= {budget.safe_outputs:.0%}, "
        f"everyday prompts blocked <= {budget.everyday_prompts:.0%}: {verdict}\n"
        f"unsafe blocked {result.blocked_recall:.1%}, look-alikes blocked {result.lookalike_fpr:.1%}, "
        f"escalated {result.band_share:.1%}, safe outputs blocked {result.safe_output_fpr:.1%}, "
        f"everyday prompts blocked {result.everyday_fpr:.1%}\n"
    )
    return 0


def _cmd_combine(args: argparse.Namespace) -> int:
    items = load_items(args.data)
    fit_scores, measure_scores = load_scores(args.scores), load_scores(args.measure_scores)
    budget = Budget(lookalike_fpr=args.lookalike_fpr, everyday_prompts=args.everyday_fpr)
    try:
        comparison = combine.compare(
            _evaluated(items, args.split, fit_scores),
            fit_scores,
            _evaluated(items, args.measure_split, measure_scores),
            measure_scores,
            args.stages,
            budget,
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(comparison)).decode() + "\n")
    else:
        sys.stdout.write(combine.render(comparison))
    return 0


def _cmd_replies(args: argparse.Namespace) -> int:

    prompts = reply_check.everyday_prompts(load_items(args.data), args.split, args.count)
    if not prompts:
        raise SystemExit(f"no everyday prompts in split {args.split} of {args.data}")

    async def run() -> ReplyCheck:
        headers = {"authorization": f"Bearer {args.key}"}
        async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout) as http:
            return await reply_check.check(
                http, prompts, args.model, concurrency=args.concurrency, max_tokens=args.max_tokens
            )

    result = asyncio.run(run())
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(result)).decode() + "\n")
    else:
        sys.stdout.write(reply_check.render(result))
    return 0 if result.verdicts["cut"] == 0 else 1


def _cmd_overturned(args: argparse.Namespace) -> int:
    async def run() -> tuple[list[FalsePositive], ExportCounts]:
        headers = {"authorization": f"Bearer {args.key}"}
        async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout) as http:
            return await feedback.export(http)

    items, counts = asyncio.run(run())
    args.out.write_bytes(b"".join(msgspec.json.encode(item) + b"\n" for item in items))
    print(
        f"{counts.read} overturned appeals: {counts.exported} false positives written to {args.out}, "
        f"{counts.not_a_block} not of a block, {counts.no_content} without content (neither retained nor "
        "shared with the appeal)",
        file=sys.stderr,
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ops.eval", description="Evaluate guard cascades.")
    commands = parser.add_subparsers(dest="command", required=True)

    score = commands.add_parser("score", help="score labelled items with a cascade and store the stage runs")
    score.add_argument("--policy-file", type=Path, help="a policy spec (JSON); default: the starter rules")
    score.add_argument(
        "--policy",
        help="a registry policy (alias or name@version) scored with the service's own guards and engines, "
        "as `lockgate serve` builds them from --config (e.g. `default`)",
    )
    score.add_argument("--config", type=Path, help="the gateway's configuration file (for --policy)")
    score.add_argument("--out", type=Path, required=True, help="where to write the scores (JSONL)")
    score.add_argument(
        "--early-exit", action="store_true", help="record the cascade as it runs in service (replay inexact)"
    )
    score.set_defaults(run=_cmd_score)

    replay = commands.add_parser("replay", help="decide stored scores again at new thresholds, and report")
    replay.add_argument(
        "--thresholds",
        required=True,
        help="allow_below,block_above per stage, ';' between stages; a stage's pair for outputs (items of "
        "shape output) after a '/', e.g. '0.25,0.75;0.3,0.7/0.1,0.95' (none: outputs at the same pair)",
    )
    replay.set_defaults(run=_cmd_replay)

    report = commands.add_parser("report", help="report stored scores at their stored thresholds")
    report.set_defaults(run=_cmd_report)

    calibration = commands.add_parser(
        "calibrate", help="choose the model stages' thresholds on a calibration split under a budget"
    )
    calibration.add_argument("--lookalike-fpr", type=float, default=0.05, help="look-alikes blocked, at most")
    calibration.add_argument("--band-share", type=float, default=0.10, help="items escalated, at most")
    calibration.add_argument(
        "--safe-output-fpr", type=float, default=0.0, help="safe outputs (replies, refusals) blocked, at most"
    )
    calibration.add_argument(
        "--everyday-fpr", type=float, default=0.03, help="everyday prompts (kind everyday) blocked, at most"
    )
    calibration.add_argument("--step", type=float, default=0.05, help="threshold grid step")
    calibration.add_argument(
        "--keep",
        type=int,
        action="append",
        default=[],
        help="index of a stage that keeps its stored thresholds (repeatable)",
    )
    calibration.set_defaults(run=_cmd_calibrate)

    combination = commands.add_parser(
        "combine",
        help="fit one score over some stages' scores on one split and measure it against each stage alone "
        "on another (ops/eval/combine.py)",
    )
    combination.add_argument(
        "--stages", type=int, nargs="+", required=True, help="indices of the stages to combine, e.g. 1 2"
    )
    combination.add_argument(
        "--measure-scores", type=Path, required=True, help="scores of the split to measure on (JSONL)"
    )
    combination.add_argument(
        "--measure-split", choices=("train", "calibration", "test"), default="test", help="(default: test)"
    )
    combination.add_argument("--lookalike-fpr", type=float, default=0.05, help="look-alikes blocked, at most")
    combination.add_argument(
        "--everyday-fpr", type=float, default=0.03, help="everyday prompts blocked, at most"
    )
    combination.add_argument("--scores", type=Path, required=True, help="scores of the split to fit on")
    combination.add_argument("--json", action="store_true", help="print the comparison as JSON")
    combination.set_defaults(run=_cmd_combine)

    replies = commands.add_parser(
        "replies", help="send everyday prompts to a running gateway; count the answers the output guard cuts"
    )
    replies.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway's base URL")
    replies.add_argument("--key", required=True, help="a consumer key")
    replies.add_argument("--model", default="SmolLM2-135M-Instruct", help="the model to ask")
    replies.add_argument("--count", type=int, default=200, help="prompts to send (whole scenarios first)")
    replies.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    replies.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    replies.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    replies.add_argument("--json", action="store_true", help="print every answer as JSON")
    replies.add_argument(
        "--data", type=Path, default=Path("ops/eval/data/guard"), help="a guard data directory"
    )
    replies.add_argument(
        "--split", choices=("train", "calibration", "test"), default="test", help="the prompts' split"
    )
    replies.set_defaults(run=_cmd_replies)

    overturned = commands.add_parser(
        "overturned", help="export the blocks reviewers overturned as labelled false positives (JSONL)"
    )
    overturned.add_argument("--key", required=True, help="a reviewer key (the appeals it may see)")
    overturned.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway")
    overturned.add_argument("--out", type=Path, required=True, help="where to write the items (JSONL)")
    overturned.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    overturned.set_defaults(run=_cmd_overturned)

    for sub in (replay, report, calibration):
        sub.add_argument("--scores", type=Path, required=True, help="scores written by `score` (JSONL)")
        sub.add_argument(
            "--band", choices=("escalate", "block"), default="escalate", help="past the last stage"
        )
        sub.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    for sub in (score, replay, report, calibration, combination):
        sub.add_argument(
            "--data", type=Path, required=True, help="labelled items (a JSONL file or a guard data directory)"
        )
        sub.add_argument(
            "--split", choices=("train", "calibration", "test"), help="only this split (default: every item)"
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status."""
    args = _parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
