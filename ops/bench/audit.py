"""Audit trail benchmark: how many gate decisions per second the trail records, on one core.

    python -m ops.bench.audit [--stores sqlite postgres] [--records 20000] [--tenants 4] [--core 0]
                              [--batch-size 256] [--dsn postgresql://postgres@127.0.0.1:5432/test] [--json]

For each store, in this process pinned to `--core` (the store's worker thread and, for PostgreSQL, the
client side with it; the PostgreSQL server itself is not pinned), three figures on the same drafts (shaped
like the gateway's record of an input check by the rules stage, keyed with a MAC, spread over `--tenants`):

- `insert`: the baseline, the drafts' rows written with plain batched INSERTs into a copy of the records
  table with its keys and indexes (no chain, no head, no lookup): what the database costs;
- `append`: `AuditStore.append` in batches of `--batch-size` (chained, MACed, heads moved, draft ids checked);
- `writer`: the drafts submitted to an `AuditWriter` (its buffer, its task, the store) as the gateway does,
  waiting until the last one is durable.

Each prints records per second and CPU per record (this process's user + system time: the loop and the
store's threads), and its ratio to the baseline of the same store in the same run. SQLite works in a
temporary directory; PostgreSQL in a fresh schema of `--dsn`, dropped afterwards. The machine is shared:
compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from ops.bench._servers import POSTGRES_DSN
from policy.audit.base import AuditStore
from policy.audit.keys import MacKey
from policy.audit.migrations import RECORD_COLUMNS, RECORD_FIELDS, record_row
from policy.audit.postgres import PostgresAuditStore
from policy.audit.records import AuditDraft, AuditedStage, chain
from policy.audit.sqlite import SqliteAuditStore
from policy.audit.writer import AuditWriter

STORES = ("sqlite", "postgres")


class Figure(msgspec.Struct, frozen=True, kw_only=True):
    """One way of recording the drafts on one store."""

    store: str
    way: str  # insert (the baseline) | append | writer
    records: int
    seconds: float
    cpu_seconds: float

    @property
    def per_second(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us(self) -> float:
        return 1e6 * self.cpu_seconds / self.records if self.records else 0.0


def drafts(count: int, tenants: int, run: str) -> list[AuditDraft]:
    """`count` drafts like the gateway's record of an allowed input checked by the rules stage."""
    stage = AuditedStage(stage="rules", kind="rules", score=0.5, allow_below=0.25, block_above=0.75)
    return [
        AuditDraft(
            tenant=f"bench-{run}-{i % tenants}",
            key_id=f"key-{i % tenants}",
            request_id=f"req-{run}-{i}",
            at=1_700_000_000.0 + i * 1e-3,
            stage="input",
            decision="allow",
            source="rules",
            policy="default@rules-1",
            policy_hash="f" * 64,
            stages=(stage,),
            content_hash=f"{i:064x}",
            draft_id=f"{run}-{i}",
        )
        for i in range(count)
    ]


async def measure(store: str, way: str, work: Callable[[], Awaitable[int]]) -> Figure:
    """Run `work` (it returns the records it wrote), timed in wall clock and this process's CPU."""
    cpu, wall = time.process_time(), time.perf_counter()
    records = await work()
    return Figure(
        store=store,
        way=way,
        records=records,
        seconds=time.perf_counter() - wall,
        cpu_seconds=time.process_time() - cpu,
    )


def batches(items: Sequence[AuditDraft], size: int) -> list[Sequence[AuditDraft]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def bench_store(
    name: str,
    store: AuditStore,
    baseline: Callable[[list[tuple[Any, ...]]], Awaitable[None]],
    args: argparse.Namespace,
    key: MacKey,
    spool: Path,
) -> list[Figure]:
    """The three figures of one store (module docstring)."""
    run = secrets.token_hex(4)
    baseline_drafts = drafts(args.records, args.tenants, f"{run}b")
    rows = [record_row(chain(d, i + 1, "", key)) for i, d in enumerate(baseline_drafts)]

    async def insert() -> int:
        for i in range(0, len(rows), args.batch_size):
            await baseline(rows[i : i + args.batch_size])
        return len(rows)

    appended = drafts(args.records, args.tenants, f"{run}a")

    async def append() -> int:
        for batch in batches(appended, args.batch_size):
            await store.append(batch)
        return len(appended)

    submitted = drafts(args.records, args.tenants, f"{run}w")

    async def write() -> int:
        writer = AuditWriter(store, spool, clock=time.time, batch_size=args.batch_size, mac_key=key)
        await writer.start()
        try:
            waits: list[asyncio.Task[None]] = []
            for batch in batches(submitted, args.batch_size):
                for draft in batch[:-1]:
                    writer.submit(draft)
                waits.append(asyncio.ensure_future(writer.record(batch[-1])))
                if len(waits) >= 2:  # the writer works on one batch while the next fills
                    await waits.pop(0)
                await asyncio.sleep(0)
            await asyncio.gather(*waits)
        finally:
            await writer.close()
        return len(submitted)

    return [
        await measure(name, "insert", insert),
        await measure(name, "append", append),
        await measure(name, "writer", write),
    ]


async def sqlite_figures(args: argparse.Namespace, key: MacKey, workdir: Path) -> list[Figure]:
    path = workdir / "audit.sqlite3"
    store = await SqliteAuditStore.open(path, mac_key=key)
    # The baseline's own connection, used from one thread at a time.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    # The records table again, with its keys and indexes (not its triggers).
    for (ddl,) in conn.execute(
        "SELECT sql FROM sqlite_master WHERE tbl_name = 'audit_records' AND type IN ('table', 'index')"
        " AND sql IS NOT NULL ORDER BY type DESC"
    ).fetchall():
        conn.execute(ddl.replace("audit_records", "bench_records"))
    sql = f"INSERT INTO bench_records ({RECORD_COLUMNS}) VALUES ({', '.join('?' for _ in RECORD_FIELDS)})"

    def insert(rows: list[tuple[Any, ...]]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(sql, rows)
        conn.execute("COMMIT")

    async def baseline(rows: list[tuple[Any, ...]]) -> None:
        await asyncio.to_thread(insert, rows)

    try:
        return await bench_store("sqlite", store, baseline, args, key, workdir / "spool-sqlite")
    finally:
        conn.close()
        await store.close()


async def postgres_figures(args: argparse.Namespace, key: MacKey, workdir: Path) -> list[Figure]:
    import asyncpg  # type: ignore[import-untyped]

    schema = f"bench_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(args.dsn, timeout=10)
    try:
        store = await PostgresAuditStore.open(args.dsn, mac_key=key, schema=schema)
        await admin.execute(
            f"CREATE TABLE {schema}.bench_records (LIKE {schema}.audit_records INCLUDING ALL)"
        )
        marks = ", ".join(f"${i}" for i in range(1, len(RECORD_FIELDS) + 1))
        sql = f"INSERT INTO {schema}.bench_records ({RECORD_COLUMNS}) VALUES ({marks})"

        async def baseline(rows: list[tuple[Any, ...]]) -> None:
            async with admin.transaction():
                await admin.executemany(sql, rows)

        try:
            return await bench_store("postgres", store, baseline, args, key, workdir / "spool-postgres")
        finally:
            await store.close()
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await admin.close()


def table(figures: Sequence[Figure]) -> str:
    lines = [
        "| store | way | records | records/s | CPU per record | vs insert (CPU) |",
        "|---|---|---|---|---|---|",
    ]
    base = {f.store: f for f in figures if f.way == "insert"}
    for f in figures:
        ratio = f.cpu_us / base[f.store].cpu_us if base[f.store].cpu_us else 0.0
        lines.append(
            f"| {f.store} | {f.way} | {f.records} | {f.per_second:,.0f} | {f.cpu_us:.1f} us | {ratio:.2f}x |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> list[Figure]:
    key = MacKey(secrets.token_bytes(32))
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="lockgate-audit-bench-") as tmp:
        if "sqlite" in args.stores:
            figures += await sqlite_figures(args, key, Path(tmp))
        if "postgres" in args.stores:
            figures += await postgres_figures(args, key, Path(tmp))
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.bench.audit", description=__doc__.splitlines()[0])
    parser.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--core", type=int, default=0, help="the core this process is pinned to")
    parser.add_argument("--dsn", default=POSTGRES_DSN, help="PostgreSQL (a fresh schema is made and dropped)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.records < 1 or args.batch_size < 1 or args.tenants < 1:
        parser.error("--records, --batch-size and --tenants must be at least 1")
    os.sched_setaffinity(0, {args.core})
    figures = asyncio.run(run(args))
    if args.json:
        sys.stdout.write(msgspec.json.encode(figures).decode() + "\n")
    else:
        print(table(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
