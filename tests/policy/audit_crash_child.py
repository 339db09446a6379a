"""The process `tests/policy/test_audit_crash.py` kills: an audit writer whose store never answers records an
allow (without waiting) and a block (waiting until it is durable, as the gateway does before answering a
block), says "answered", and waits to be killed."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence

from policy.audit.records import AuditDraft, AuditRecord
from policy.audit.sqlite import SqliteAuditStore
from policy.audit.writer import AuditWriter


class Hung(SqliteAuditStore):
    """The real store, whose appends never return (a database that stopped answering)."""

    async def append(self, drafts: Sequence[AuditDraft]) -> list[AuditRecord]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def draft(request_id: str, decision: str) -> AuditDraft:
    return AuditDraft(
        tenant="acme",
        key_id="k1",
        request_id=request_id,
        at=time.time(),
        stage="input",
        decision=decision,  # type: ignore[arg-type]
        source="rules",
        content_hash="0" * 64,
    )


async def main(db: str, spool: str) -> None:
    store = await Hung.open(db)
    writer = AuditWriter(store, spool, clock=time.time, append_timeout=0.2, flush_interval=0.05)
    await writer.start()
    writer.submit(draft("allowed-1", "allow"))
    await writer.record(draft("blocked-1", "block"))
    print("answered", flush=True)
    await asyncio.Event().wait()  # killed here, between the answer and any flush to the database


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
