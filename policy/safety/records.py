"""Where gate decisions go until the audit trail stores them: one log line each, never the content."""

from __future__ import annotations

import logging

from policy.safety.decision import GuardRecord

log = logging.getLogger("lockgate.guard")


def log_record(record: GuardRecord) -> None:
    """Default record sink: the decision, its source and each stage's score (no text, only its hash)."""
    stages = " ".join(
        f"{run.guard}={'error' if run.p_unsafe is None else f'{run.p_unsafe:.3f}'}:{run.verdict}"
        for run in record.runs
    )
    log.info(
        "guard %s %s tenant=%s policy=%s action=%s source=%s category=%s flagged=%s content=%s stages=[%s]",
        record.request_id,
        record.direction,
        record.tenant,
        record.policy,
        record.action,
        record.source,
        record.category or "-",
        record.flagged,
        record.content_sha256[:16],
        stages,
    )
