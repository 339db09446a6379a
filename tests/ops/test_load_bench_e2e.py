"""`lockgate bench` against the gateway served in-process on the simulated engine: two tenants in two
classes, planned cancellations, every request accounted for, and the report and plots written. Figures are
printed, never asserted."""

from __future__ import annotations

import io
import uuid
from pathlib import Path

import msgspec
import pytest

from engines.simulated import SimulatorConfig
from gateway.app import create_app
from gateway.cli import main
from gateway.config import EngineConfig, StorageConfig
from gateway.generation.prompts import PromptRenderer
from ops.bench.load import Report, decode_workload, run, write_outputs
from ops.bench.load.report import render
from policy.tenants.models import Tenant
from tests.conftest import MODEL, SESSION_DIR, OutcomeLog, Tenancy, add_key, make_config, serving


async def test_a_short_open_loop_run_against_the_gateway(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy, tmp_path: Path
) -> None:
    await tenancy.store.create_tenant(
        Tenant(tenant_id="bulk", display_name="Bulk", max_priority="batch"), actor="test", now=0.0
    )
    bulk = await add_key(tenancy.store, "bulk", ("consumer",))
    base = make_config()
    cfg = msgspec.structs.replace(
        base,
        storage=StorageConfig(sqlite_path=str(SESSION_DIR / f"bench-{uuid.uuid4().hex}.sqlite3")),
        engine=EngineConfig(
            kind="simulated", simulator=SimulatorConfig(decode_step_s=0.002, decode_step_s_per_seq=0.0)
        ),
    )
    workload = decode_workload(
        {
            "model": MODEL,
            "requests": 12,
            "arrival": {"rate": 200.0},
            "prompt_tokens": {"kind": "uniform", "low": 20, "high": 60},
            "output_tokens": {"kind": "fixed", "value": 24},
            "cancel_fraction": 0.5,
            # The output guard releases text in windows: a few chunks per answer, so close after the first.
            "cancel_after": {"kind": "fixed", "value": 1},
            "seed": 3,
            "timeout": 60,
            "tenants": [
                {"name": "acme", "api_key": tenancy.consumer, "weight": 2},
                {"name": "bulk", "api_key": bulk, "priority": "batch"},
            ],
        }
    )
    progress = io.StringIO()
    app = create_app(cfg, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with serving(app) as url:
        report = await run(workload, url, progress_to=progress)
        written = await write_outputs(report, tmp_path, lambda _line: None)
    print(render(report))

    overall = report.overall
    assert overall.sent == 12
    assert overall.completed + overall.cancelled + overall.rejected + overall.errors == overall.sent
    assert overall.errors == 0, report.errors
    assert overall.cancelled >= 1
    assert overall.completed >= 1
    assert set(report.tenants) == {"acme", "bulk"}
    assert set(report.classes) == {"interactive", "batch"}
    assert sum(c.sent for c in report.classes.values()) == 12
    completed = [s for s in report.samples if s.status == "completed"]
    assert all(s.ttft is not None and s.e2e is not None for s in completed)
    assert all(s.completion_tokens == 24 for s in completed)
    assert overall.ttft.count >= overall.completed
    assert "sent 12/12" in progress.getvalue()

    assert {p.name for p in written} == {"report.json", "latency_cdf.png", "timeline.png"}
    decoded = msgspec.json.decode((tmp_path / "report.json").read_bytes(), type=Report)
    assert decoded.overall == overall
    assert tenancy.consumer not in (tmp_path / "report.json").read_text()
    for name in ("latency_cdf.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_refuses_a_bad_workload_and_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert "give --api-key" in capsys.readouterr().err
    path = tmp_path / "w.toml"
    path.write_text('[arrival]\nrate = "fast"\n')
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--api-key", "k", "--workload", str(path)]) == 2
    assert "$.arrival.rate" in capsys.readouterr().err
