"""`GET /metrics`: the app's registry in the Prometheus text format. Scraped without a key, like the health
probes (keep it on a network only the scraper reaches), or with an operator key where `[metrics] require_key`
is set. With several workers, every worker's series merged."""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, Response, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.observe.multiproc import aggregate
from gateway.openapi import BEARER, errors
from gateway.security import allow_operator, provide_principal
from gateway.service import Services


@get(
    "/metrics",
    media_type=CONTENT_TYPE_LATEST,
    tags=["health"],
    # No key, or a bearer key where [metrics] require_key is set (the 401, 403 and 503 are that case's).
    security=[{}, *BEARER],
    responses=errors(),
)
async def metrics(request: Request[Any, Any, Any], services: NamedDependency[Services]) -> Response[bytes]:
    """Prometheus text exposition of the gateway's metrics (collected in the event loop, where the state
    they read is changed; in multiprocess mode merged from the workers' files, in a thread). With `[metrics]
    require_key`, only for a key with the `operator` role of the operating organisation."""
    if services.config.metrics.require_key:
        allow_operator(await provide_principal(request, services), "operator")
    observer = services.observer
    if observer.multiprocess_dir is None:
        body = generate_latest(observer.registry)
    else:
        observer.metrics.flush()  # this worker's counts now; the others' as of their last flush
        body = await asyncio.to_thread(aggregate, observer.multiprocess_dir)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)


OBSERVE_ROUTES = [metrics]
