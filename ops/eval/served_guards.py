"""Scoring a registry policy with the service's own guards: the app's lifespan runs in this process (engines,
registry, trained guards, exactly as `lockgate serve` builds them), without serving HTTP.

So an evaluation of `default` measures the cascade a request meets: the same guard versions, prompts, label
tokens, engine pools and timeouts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.app import create_app, running
from gateway.config import Config
from guard.cascade import Cascade


@asynccontextmanager
async def service_cascade(config: Config, policy: str) -> AsyncIterator[tuple[str, Cascade]]:
    """The cascade of `policy` (an alias or name@version) as the service built it, with its guards loaded;
    yields the policy's name@version and the cascade."""
    async with running(create_app(config)) as services:
        resolved = services.registry.view.resolve_policy(policy, key="")
        if services.guards is not None:
            await services.guards.ready(resolved.guards)
        yield resolved.ref, services.gate.cascade(resolved)
