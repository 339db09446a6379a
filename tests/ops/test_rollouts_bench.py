"""`python -m ops.bench.rollouts` on a small workload: five gateways in one run, and counts that follow from
the workload (token figures are printed, and only compared between gateways of the same run)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from ops.bench.rollouts import RolloutsReport, main


def test_a_small_run_counts_what_keys_and_the_cache_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--rollouts", "2", "--steps", "5", "--runs", "2", "--retry-share", "0.4", "--out", str(tmp_path)]
    assert main(args) == 0
    with capsys.disabled():
        print(capsys.readouterr().out)
    report = msgspec.json.decode((tmp_path / "rollouts.json").read_bytes(), type=RolloutsReport)
    no_affinity, stateless, idempotent, cached, session = report.gateways
    steps = 2 * 5 * 2
    retries = 2 * 2 * 2  # 40% of 5 steps, spread evenly: 2 per rollout and run
    for gateway in report.gateways:
        assert gateway.requests == steps + retries
    # Without keys every request reaches the engine; with them a retry is a replay; with the cache too,
    # the second run of every rollout is answered from it.
    assert (stateless.engine_calls, stateless.replayed, stateless.cache_hits) == (steps + retries, 0, 0)
    assert (idempotent.engine_calls, idempotent.replayed, idempotent.cache_hits) == (steps, retries, 0)
    assert (cached.engine_calls, cached.replayed, cached.cache_hits) == (steps // 2, retries, steps // 2)
    # A session's retried step is answered from its record, and the second run's steps from the cache.
    assert (session.engine_calls, session.replayed, session.cache_hits) == (steps // 2, retries, steps // 2)
    assert (no_affinity.engine_calls, no_affinity.engine_tokens) == (
        stateless.engine_calls,
        stateless.engine_tokens,
    )
    for gateway in report.gateways:
        assert 0 <= gateway.cached_tokens < gateway.engine_tokens
        assert gateway.computed_tokens == gateway.engine_tokens - gateway.cached_tokens
    # The same prompts and answers through a session as through the chat route.
    assert session.engine_tokens == cached.engine_tokens
    assert stateless.engine_tokens > idempotent.engine_tokens > cached.engine_tokens > 0
    assert cached.saved_vs_stateless > idempotent.saved_vs_stateless > 0 == stateless.saved_vs_stateless
