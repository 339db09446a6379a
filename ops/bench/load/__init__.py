"""`lockgate bench`: an open-loop load generator for any OpenAI-compatible server.

Modules, one job each: `workload` (what to send, from TOML), `arrivals` (Poisson and bursty arrival times),
`plan` (every request of a run, seeded), `client` (one timed streaming request), `run` (the open-loop
driver and progress), `report` (percentiles, goodput, SLO attainment, counts), `plots` (PNG, matplotlib),
`cli` (the options).
"""

from ops.bench.load.arrivals import arrival_times
from ops.bench.load.client import Sample, send
from ops.bench.load.plan import Planned, make_plan
from ops.bench.load.report import Percentiles, Report, Summary, build_report, percentile, summarize
from ops.bench.load.run import run, write_outputs
from ops.bench.load.workload import (
    Arrival,
    Fixed,
    LogNormal,
    Slo,
    Tenant,
    Uniform,
    Workload,
    WorkloadError,
    decode_workload,
    load_workload,
)

__all__ = [
    "Arrival",
    "Fixed",
    "LogNormal",
    "Percentiles",
    "Planned",
    "Report",
    "Sample",
    "Slo",
    "Summary",
    "Tenant",
    "Uniform",
    "Workload",
    "WorkloadError",
    "arrival_times",
    "build_report",
    "decode_workload",
    "load_workload",
    "make_plan",
    "percentile",
    "run",
    "send",
    "summarize",
    "write_outputs",
]
