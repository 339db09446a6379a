"""Evidence by consent: the content a consumer shares with the appeal it files (`POST /v1/appeals`).

`share_content: true` copies the content the decision's record retained (409 `content_not_retained` where the
tenant's retention kept none); `content` attaches the text itself, which must be exactly the text checked
(its sha256 is the record's `content_hash`, else 400 `content_mismatch`: nothing else can be substituted for
it). For a conversation of plain text messages the text checked is the messages' contents in order joined by
a blank line; for an answer, the answer's text. An appeal of an answer may carry the request's input too
(`request_content`, checked against the input decision's hash the same way; `share_content` copies it where
it was retained), so the answer is read in context. The content is kept with the appeal for `[appeals]
evidence_retention_days`, whatever the audit retention.
"""

from __future__ import annotations

from typing import Protocol

from gateway.api.admin import ConflictAPIError
from gateway.errors import InvalidRequestError
from gateway.services import Services
from policy.appeals.base import EvidenceSource, SharedContent
from policy.audit.records import AuditRecord, content_sha256
from policy.audit.retention import DAY_S

# The longest content a consumer may attach to an appeal, in characters (a request's checked text can be
# long; the body limit bounds it too).
MAX_SHARED_CONTENT = 1_000_000


class ShareRequest(Protocol):
    """What an appeal's body says about sharing content."""

    @property
    def share_content(self) -> bool: ...

    @property
    def content(self) -> str | None: ...

    @property
    def request_content(self) -> str | None: ...


def shared_content(
    body: ShareRequest, record: AuditRecord, records: list[AuditRecord], services: Services
) -> SharedContent | None:
    """The content the consumer shares with its appeal of `record` (module docstring), or None; `records`
    are the request's, so that an appeal of an answer can carry the request's input too."""
    source: EvidenceSource
    if body.content is not None:
        _check_text(body.content, record, "content")
        content, source = body.content, "consumer"
    elif body.share_content:
        if record.content is None:
            raise ConflictAPIError(
                "the content of this decision was not retained: attach the text checked as `content`",
                param="share_content",
                code="content_not_retained",
            )
        content, source = record.content, "retained"
    elif body.request_content is not None:
        message = "request_content goes with content or share_content"
        raise InvalidRequestError(message, param="request_content", code="invalid_value")
    else:
        return None
    inputs = [r for r in records if r.stage == "input" and r.seq < record.seq]
    request_content = None
    if body.request_content is not None:
        if record.stage != "output" or not inputs:
            raise InvalidRequestError(
                "request_content goes with an appeal of an answer (the appealed decision checked the input)",
                param="request_content",
                code="invalid_value",
            )
        _check_text(body.request_content, inputs[-1], "request_content")
        request_content = body.request_content
    elif body.share_content and record.stage == "output" and inputs:
        request_content = inputs[-1].content  # where retained
    days = services.config.appeals.evidence_retention_days
    return SharedContent(
        content=content,
        content_hash=record.content_hash,
        source=source,
        expires_at=services.clock() + days * DAY_S,
        request_content=request_content,
    )


def _check_text(text: str, record: AuditRecord, param: str) -> None:
    """400 `content_mismatch` unless `text` is what `record` checked (its sha256 is the content_hash)."""
    if content_sha256(text) != record.content_hash:
        raise InvalidRequestError(
            f"{param} is not the text this decision checked (its sha256 is not the recorded content_hash)",
            param=param,
            code="content_mismatch",
        )
