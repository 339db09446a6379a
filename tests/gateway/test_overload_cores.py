"""The CPU signal's share of the machine: the cores the process may use, capped by its cgroup's CPU limit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.overload import CpuShedder, OverloadConfig, cgroup_cpu_limit, usable_cores


def tree(root: Path, membership: str, files: dict[str, str]) -> Path:
    """A fake `/sys/fs/cgroup` under `root` holding `files`; the path of a fake `/proc/self/cgroup`."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "self-cgroup").write_text(membership)
    return root / "self-cgroup"


@pytest.mark.parametrize(
    ("membership", "files", "cores"),
    [
        # v2 in a container: the namespace's root is the container's cgroup.
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
        # v2 on a host: the smallest limit on the way up counts.
        ("0::/a/b\n", {"a/cpu.max": "200000 100000\n", "a/b/cpu.max": "max 100000\n"}, 2.0),
        ("0::/a/b\n", {"a/cpu.max": "400000 100000\n", "a/b/cpu.max": "50000 100000\n"}, 0.5),
        # v1: the cpu controller's own hierarchy; -1 is no quota.
        (
            "4:cpu,cpuacct:/docker/x\n1:name=systemd:/docker/x\n",
            {
                "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "50000\n",
                "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
            },
            0.5,
        ),
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ("1:cpu:/\n0::/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        # No limit anywhere, or nothing readable.
        ("0::/a\n", {"a/cpu.max": "max 100000\n"}, None),
        ("0::/a\n", {"a/cpu.max": "garbage\n"}, None),
        ("0::/a\n", {}, None),
    ],
)
def test_the_cgroup_cpu_limit_is_the_smallest_quota_over_period_on_the_way_up(
    tmp_path: Path, membership: str, files: dict[str, str], cores: float | None
) -> None:
    assert cgroup_cpu_limit(tmp_path, tree(tmp_path, membership, files)) == cores


def test_usable_cores_are_the_affinity_capped_by_the_cgroup_limit(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path, tmp_path / "missing") == affinity
    limited = tree(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n"})
    assert usable_cores(tmp_path, limited) == 0.5
    (tmp_path / "cpu.max").write_text(f"{(affinity + 1) * 100000} 100000\n")
    assert (
        usable_cores(tmp_path, limited) == affinity
    )  # a limit above the cores it may run on changes nothing


def test_a_process_at_its_cpu_limit_is_saturated() -> None:
    clock = iter([0.0, 0.1])
    process = iter([0.0, 0.05])  # half a core over 0.1 s
    shed = CpuShedder(
        OverloadConfig(cpu_shedding=True), lambda: next(clock), lambda: 0.0, lambda: next(process), 0.5
    )
    shed.sample()
    shed.sample()
    assert shed.utilisation == pytest.approx(1.0)
