"""A block answered is never lost: a gateway process killed (SIGKILL) right after it answered a block, while
its audit database did not answer, leaves the block's record durable in the spool, and the next start records
it (`policy/audit/writer.py`: `record` returns once the draft is stored or fsync'd)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from policy.audit.sqlite import SqliteAuditStore
from policy.audit.writer import AuditWriter
from tests.conftest import eventually

ROOT = Path(__file__).resolve().parents[2]


async def test_a_block_answered_survives_kill_9_before_any_flush(tmp_path: Path) -> None:
    db, spool = tmp_path / "audit.sqlite3", tmp_path / "spool"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.policy.audit_crash_child",
        str(db),
        str(spool),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None
    try:
        # A hang guard only: the child answers once its append timed out (0.2 s) and the spool is fsync'd.
        line = await asyncio.wait_for(child.stdout.readline(), timeout=120)
    finally:
        child.kill()  # SIGKILL: no shutdown flush, no close
        await child.wait()
    assert line == b"answered\n"
    store = await SqliteAuditStore.open(db)
    try:
        assert await store.find("acme", "blocked-1") == []  # nothing reached the database before the kill
        writer = AuditWriter(store, spool, clock=time.time)
        await writer.start()  # replays what the killed process left in the spool

        async def replayed() -> bool:
            return writer.state().spooled_bytes == 0

        await eventually(replayed, within=60)
        await writer.close()
        [block] = await store.find("acme", "blocked-1")
        assert block.decision == "block"
    finally:
        await store.close()
