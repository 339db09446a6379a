"""Refusals before the safety gate, in the audit trail: quota denials and admission refusals (the gate records
its own decisions). A refusal stands whether or not it can be recorded."""

from __future__ import annotations

import logging
from typing import Literal

from gateway.errors import APIError
from gateway.service import Services
from policy.audit.records import AuditDraft
from policy.audit.writer import AuditBackpressureError
from policy.auth import Principal

log = logging.getLogger("lockgate.audit")


def record_refusal(
    services: Services,
    principal: Principal,
    request_id: str,
    stage: Literal["quota", "admission"],
    error: APIError,
) -> None:
    """Append the refusal of `request_id` at `stage` (its code is the record's source)."""
    draft = AuditDraft(
        tenant=principal.tenant.tenant_id,
        key_id=principal.key.key_id,
        request_id=request_id,
        at=services.clock(),
        stage=stage,
        decision="deny" if stage == "quota" else "refuse",
        source=error.code or stage,
        detail=error.message,
    )
    try:
        services.audit_writer.submit(draft)
    except AuditBackpressureError:
        log.error("audit trail full: %s refusal of %s not recorded", stage, request_id)
