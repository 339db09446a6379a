"""Reviewers' overturns as labelled data: `python -m ops.eval overturned`.

An overturned appeal of a block (or refusal) is a false positive of the policy version that made it, as a
person judged it. This export reads the overturned appeals a reviewer key may see through the reviewer API
(`GET /audit/appeals?state=overturned`, each appeal with its evidence, and the decision it overturned) and
writes one `FalsePositive` per line: the text checked, labelled `safe`, with the category the gate gave it,
the policy version, and the reviewer's reason code. The text is the decision's retained content, or else the
content the consumer shared with its appeal (evidence by consent); an overturn with neither is counted, not
exported (nothing to label). Appeals of flags (an allowed answer flagged for review) are not false positives
of a block and are left out.

These items come from production traffic: they are for reporting a policy's false positives and for review
of the data (`ops/eval/data` provenance rules apply before any of it is used for training).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import msgspec

from policy.appeals.statement import StatementOfReasons
from policy.audit.records import AuditRecord

# The decisions whose overturn is a false positive of the gate.
_BLOCKS = frozenset({"block", "refuse"})
_PAGE = 100


class FalsePositive(msgspec.Struct, frozen=True, kw_only=True):
    """One overturned block: the text checked, as a labelled safe item."""

    id: str  # "appeal-" + the appeal id
    text: str
    label: Literal["safe"] = "safe"
    category: str  # what the gate decided it was ("" if none)
    shape: Literal["prompt", "output"]  # the input checked, or an answer
    policy: str  # name@version that blocked it
    reason_code: str  # the reviewer's reason to overturn
    content_from: Literal["record", "appeal"]  # retained with the decision, or shared with the appeal
    tenant: str
    decision_seq: int
    decided_at: float


class AppealView(msgspec.Struct, frozen=True, kw_only=True):
    """What the export reads of `GET /audit/appeals/{id}`."""

    appeal_id: str
    tenant: str
    decision_seq: int
    evidence: dict[str, Any] | None = None
    statement: StatementOfReasons | None = None


class ExportCounts(msgspec.Struct, kw_only=True):
    """How many overturned appeals were read, exported, and left out (and why)."""

    read: int = 0
    exported: int = 0
    not_a_block: int = 0
    no_content: int = 0


async def overturned_appeals(http: httpx.AsyncClient) -> AsyncIterator[AppealView]:
    """Every overturned appeal the client's reviewer key may see, a page at a time."""
    after: str | None = None
    while True:
        params: dict[str, Any] = {"state": "overturned", "limit": _PAGE}
        if after is not None:
            params["after"] = after
        page = (await http.get("/audit/appeals", params=params)).raise_for_status().json()
        for appeal in page["data"]:
            detail = await http.get(f"/audit/appeals/{appeal['appeal_id']}")
            yield msgspec.convert(detail.raise_for_status().json(), AppealView)
        if not page["has_more"]:
            return
        after = page["last_id"]


def false_positive(appeal: AppealView, record: AuditRecord, counts: ExportCounts) -> FalsePositive | None:
    """The labelled item of an overturned appeal of `record`, or None (counted in `counts`)."""
    if record.decision not in _BLOCKS or appeal.statement is None:
        counts.not_a_block += 1
        return None
    if record.content is not None:
        text, source = record.content, "record"
    elif appeal.evidence is not None:
        text, source = str(appeal.evidence["content"]), "appeal"
    else:
        counts.no_content += 1
        return None
    counts.exported += 1
    return FalsePositive(
        id=f"appeal-{appeal.appeal_id}",
        text=text,
        category=record.category or "",
        shape="output" if record.stage == "output" else "prompt",
        policy=record.policy,
        reason_code=appeal.statement.reason_code,
        content_from="record" if source == "record" else "appeal",
        tenant=appeal.tenant,
        decision_seq=appeal.decision_seq,
        decided_at=appeal.statement.decided_at,
    )


async def export(http: httpx.AsyncClient) -> tuple[list[FalsePositive], ExportCounts]:
    """The false positives reviewers overturned, oldest appeal first, and the counts."""
    counts = ExportCounts()
    items: list[FalsePositive] = []
    async for appeal in overturned_appeals(http):
        counts.read += 1
        response = await http.get(f"/audit/decisions/{appeal.tenant}/{appeal.decision_seq}")
        record = msgspec.convert(response.raise_for_status().json(), AuditRecord)
        item = false_positive(appeal, record, counts)
        if item is not None:
            items.append(item)
    return items, counts
