"""The HTTP API: one module per route group, each exporting its handlers as `ROUTES`.

    completions     POST /v1/chat/completions, /v1/completions (answered by the fast path, gateway.edge)
    responses       POST /v1/responses: the Responses API over the chat pipeline (gateway.responses_api)
    sessions        /v1/sessions/...: server-side sessions bound to the versions they started on
    moderations     POST /v1/moderations
    embeddings      POST /v1/embeddings: vectors by the registry's embedding models
    checked_inputs  what moderations and embeddings share: inputs reserved, then checked one by one
    models          GET  /v1/models
    health          GET  /healthz, /readyz
    admin           /admin/tenants/..., /admin/keys/..., /admin/changes: tenants, quotas, API keys
    registry        /admin/registry/...: versions, aliases, rollbacks (registry_scope: what an admin reads)
    audit           /audit/...: the audit trail of gate decisions
    appeals         /v1/appeals/..., /audit/queue, /audit/appeals/...: appeals and their review
    metrics         GET  /metrics

`openapi` declares what every handler declares alike (security, errors, request bodies) and serves the
document at `/schema/openapi.json`; `docs` renders it as the page at `/schema`.
"""

from gateway.api import (
    admin,
    appeals,
    audit,
    completions,
    embeddings,
    health,
    metrics,
    models,
    moderations,
    registry,
    responses,
    sessions,
)

# In this order in the OpenAPI document.
ROUTES = [
    *completions.ROUTES,
    *responses.ROUTES,
    *sessions.ROUTES,
    *moderations.ROUTES,
    *embeddings.ROUTES,
    *models.ROUTES,
    *health.ROUTES,
    *admin.ROUTES,
    *registry.ROUTES,
    *audit.ROUTES,
    *appeals.ROUTES,
    *metrics.ROUTES,
]

__all__ = ["ROUTES"]
