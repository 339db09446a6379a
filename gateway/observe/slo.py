"""Whether a finished request counts toward its class's SLO attainment, and whether it met the targets.

Counted (`lockgate:requests_finished_total{class}`): generation requests that got a priority class and an
outcome the gateway answers for: completed, refused by admission, failed, or cut by shutdown. Not counted:
what the client or the policy ended (cancelled, stalled readers, output blocked by the guard), and requests
refused before admission (quota, input guard), which never waited on capacity.
Attained (`lockgate:slo_attained_requests_total{class}`): completed requests within every target set (> 0);
a completed request without tokens counts its end-to-end latency as its time to first token.
"""

from __future__ import annotations

from gateway.config import SloConfig, SloTargets
from gateway.observe.timeline import RequestTimeline

COUNTED = frozenset({"completed", "refused", "error", "shutdown"})


def targets_for(config: SloConfig, klass: str) -> SloTargets | None:
    """The targets of priority class `klass` (None for a request without one)."""
    if klass == "interactive":
        return config.interactive
    if klass == "batch":
        return config.batch
    return None


def counts(timeline: RequestTimeline) -> bool:
    """Whether the request counts toward its class's attainment."""
    outcome = timeline.outcome
    return bool(timeline.klass) and outcome is not None and outcome.status in COUNTED


def attained(timeline: RequestTimeline, targets: SloTargets) -> bool:
    """Whether a counted request met `targets`."""
    outcome = timeline.outcome
    e2e = timeline.e2e
    if outcome is None or outcome.status != "completed" or e2e is None:
        return False
    ttft = timeline.ttft
    if targets.ttft > 0 and (e2e if ttft is None else ttft) > targets.ttft:
        return False
    itl = timeline.mean_itl
    if targets.itl > 0 and itl is not None and itl > targets.itl:
        return False
    return not (targets.e2e > 0 and e2e > targets.e2e)
