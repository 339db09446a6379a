"""Refusals before the safety gate, in the audit trail: quota denials and admission refusals (the gate records
its own decisions). They cost the client nothing, so they are tallied (`policy.audit.refusals`): the first of
a key's refusals for one reason in an interval is recorded at once, the rest as one counted record. A refusal
stands whether or not it can be recorded."""

from __future__ import annotations

from typing import Literal

from gateway.errors import APIError
from gateway.generation.context import Generation
from policy.audit.records import AuditDraft
from policy.auth import Principal


def record_refusal(
    gen: Generation,
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
        at=gen.clock(),
        stage=stage,
        decision="deny" if stage == "quota" else "refuse",
        source=error.code or stage,
        detail=error.message,
    )
    gen.refusals.add(draft)
