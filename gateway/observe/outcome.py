"""`Outcome`: how one generation request ended and the usage it had by then, as its tracker
(`gateway.generation.tracking`) reports it to the request's timeline, the metrics, the request log and the
quota settlement."""

from __future__ import annotations

from typing import Literal

import msgspec

from engines.base import FinishReason, Usage

# `blocked`: the output guard stopped it (its usage so far is charged). `refused`: admission refused it before
# any engine saw it (refunded whole).
Status = Literal["completed", "cancelled", "stalled", "error", "shutdown", "blocked", "refused", "escalated"]


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """The end of one request: how it ended and the usage it had by then."""

    request_id: str
    # name@version of the model, tokenizer and chat template versions that served the request.
    model: str
    status: Status
    finish_reason: FinishReason | None
    usage: Usage
    stream: bool
    tokenizer: str = ""
    chat_template: str = ""
    # The client's `metadata` (chat completions), kept with the outcome.
    metadata: dict[str, str] | None = None
