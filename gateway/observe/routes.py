"""`GET /metrics`: the app's registry in the Prometheus text format (scraped without a key, like the health
probes: keep it on a network only the scraper reaches). With several workers, every worker's series merged."""

from __future__ import annotations

import asyncio

from litestar import Response, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.observe.multiproc import aggregate
from gateway.service import Services


@get("/metrics", media_type=CONTENT_TYPE_LATEST, tags=["health"])
async def metrics(services: NamedDependency[Services]) -> Response[bytes]:
    """Prometheus text exposition of the gateway's metrics (collected in the event loop, where the state
    they read is changed; in multiprocess mode merged from the workers' files, in a thread)."""
    observer = services.observer
    if observer.multiprocess_dir is None:
        body = generate_latest(observer.registry)
    else:
        body = await asyncio.to_thread(aggregate, observer.multiprocess_dir)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)


OBSERVE_ROUTES = [metrics]
