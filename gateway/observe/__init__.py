"""Observability: each request's `RequestTimeline` (timeline), Prometheus metrics (metrics, collectors; the
`/metrics` route is `gateway.api.metrics`), the request log (requestlog), SLO accounting (slo), W3C trace
ids (trace), and the middleware and observer that tie them to the app (observer).

Nothing is re-exported here: `gateway.errors` and `gateway.edge.security` import `timeline`, which must not
pull in the rest (the metrics import the config, which imports modules that import `gateway.errors`).
"""
