"""Where gate decisions go: one log line each (never the content), and the audit trail's record of them."""

from __future__ import annotations

import logging

from policy.audit.records import AuditDraft, AuditedStage
from policy.safety.decision import GuardRecord

log = logging.getLogger("lockgate.guard")


def log_record(record: GuardRecord) -> None:
    """Default record sink: the decision, its source and each stage's score (no text, only its hash)."""
    if not log.isEnabledFor(logging.INFO):  # the line is not built for nobody (every decision comes here)
        return
    stages = " ".join(
        f"{run.guard}={'error' if run.p_unsafe is None else f'{run.p_unsafe:.3f}'}:{run.verdict}"
        for run in record.runs
    )
    log.info(
        "guard %s %s tenant=%s policy=%s action=%s source=%s category=%s flagged=%s content=%s checks=%d "
        "stages=[%s]",
        record.request_id,
        record.direction,
        record.tenant,
        record.policy,
        record.action,
        record.source,
        record.category or "-",
        record.flagged,
        record.content_sha256[:16],
        record.checks,
        stages,
    )


def audit_draft(record: GuardRecord) -> AuditDraft:
    """The audit trail's record of one gate decision (the content only where the record carries it)."""
    return AuditDraft(
        tenant=record.tenant,
        key_id=record.key_id,
        request_id=record.request_id,
        at=record.at,
        stage=record.direction,
        decision=record.action,
        source=record.source,
        policy=record.policy,
        policy_hash=record.policy_hash,
        stages=tuple(
            AuditedStage(
                stage=run.guard,
                kind="rules" if run.guard == "rules" else "combine" if run.guard == "combine" else "model",
                model=run.model or None,
                template_hash=run.template_sha256 or None,
                score=run.p_unsafe,
                allow_below=run.allow_below,
                block_above=run.block_above,
                latency_s=run.latency_s,
                error=run.error or None,
            )
            for run in record.runs
        ),
        category=record.category or None,
        severity=record.severity,
        flagged=record.flagged,
        content_hash=record.content_sha256,
        content=record.content,
        detail=_detail(record),
    )


def _detail(record: GuardRecord) -> str:
    """One record stands for all of a response's output checks: how many, and what they scored. Either
    direction says `answer=cache` when the result cache held the request's answer (served, not generated,
    unless the input check blocked it), and a routed request's records say the route's decision (`route=`
    its version, then the rule, the model and any fallback). A moderation's or an embedding's input check
    says it was one (`purpose=moderation`, `purpose=embedding`): a reviewer tells it from a request's."""
    parts = []
    if record.direction == "output":
        parts.append(f"checks={record.checks} guard_tokens={record.guard_tokens}")
    elif record.purpose != "request":
        parts.append(f"purpose={record.purpose}")
    if record.answered_from == "cache":
        parts.append("answer=cache")
    if record.route:
        parts.append(f"route={record.route}")
    return " ".join(parts)
