"""`GET /metrics`: the app's registry in the Prometheus text format, for a `metrics` or `operator` key of the
operating organisation (or, where `[metrics] require_key` is off, without a key: keep the port on a network
only the scraper reaches). With several workers, every worker's series merged."""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, Response, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.api.openapi import BEARER, errors
from gateway.edge.security import allow_operator, provide_principal
from gateway.observe.multiproc import aggregate
from gateway.services import Services


@get(
    "/metrics",
    media_type=CONTENT_TYPE_LATEST,
    tags=["health"],
    # A bearer key (the 401, 403 and 503 are for it), or none where [metrics] require_key is off.
    security=[{}, *BEARER],
    responses=errors(),
)
async def metrics(request: Request[Any, Any, Any], services: NamedDependency[Services]) -> Response[bytes]:
    """Prometheus text exposition of the gateway's metrics (collected in the event loop, where the state
    they read is changed; in multiprocess mode merged from the workers' files, in a thread). Only for a key
    with the `metrics` or `operator` role of the operating organisation, unless `[metrics] require_key` is
    off."""
    if services.config.metrics.require_key:
        principal = await provide_principal(request, services)
        allow_operator(principal, "metrics" if "metrics" in principal.key.roles else "operator")
    observer = services.observer
    if observer.multiprocess_dir is None:
        body = generate_latest(observer.registry)
    else:
        observer.metrics.flush()  # this worker's counts now; the others' as of their last flush
        body = await asyncio.to_thread(aggregate, observer.multiprocess_dir)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)


ROUTES = [metrics]
