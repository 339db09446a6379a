"""`python -m ops.bench.guard_windows`: the output guard's CPU per generated token under bounded windows and
under whole-output re-reads, printed (never asserted); what is asserted is the work each scheme does."""

from __future__ import annotations

import re

import pytest

from ops.bench.guard_windows import main


def test_a_short_run_prints_both_schemes_and_the_windows_score_a_bounded_share(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--tokens", "64", "512", "--answers", "1"]) == 0
    printed = capsys.readouterr().out
    with capsys.disabled():
        print(printed)
    line = re.compile(
        r"^ *(\d+) tokens, (re-read|windows) *: *([\d.]+) us guard CPU per generated token, (\d+) checks, "
        r"*([\d.]+) tokens scored per generated token$",
        re.MULTILINE,
    )
    rows = {(int(m[1]), m[2]): (float(m[3]), int(m[4]), float(m[5])) for m in line.finditer(printed)}
    assert set(rows) == {(n, s) for n in (64, 512) for s in ("re-read", "windows")}
    for tokens in (64, 512):
        # The same checks (every 16 tokens and the final one) under both schemes...
        assert rows[(tokens, "windows")][1] == rows[(tokens, "re-read")][1] == tokens // 16
        # ...but windows score at most (16 + 8) / 16 tokens per generated token, whatever the length,
        # where re-reads score a share that grows with it (about tokens / 32).
        assert rows[(tokens, "windows")][2] <= 1.5
    assert rows[(512, "re-read")][2] > 15
