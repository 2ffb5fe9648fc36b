"""More threads than usable CPUs: both command lines warn on stderr, in the same words, and
still run; the usable CPUs count a container's cgroup CPU quota."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aotgen.cli import common
from aotgen.cli.common import usable_cpus

ARGS = ("--prompt", "hi", "--max-new-tokens", "2")


@pytest.mark.parametrize(
    ("cpu_max", "cap"), [("150000 100000\n", 2), ("50000 100000\n", 1), ("max 100000\n", None)]
)
def test_usable_cpus_reads_the_cgroup_quota(monkeypatch, tmp_path, cpu_max, cap):
    affinity = len(os.sched_getaffinity(0))
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    monkeypatch.setattr(common, "CGROUP_CPU_MAX", path)
    assert usable_cpus() == (affinity if cap is None else min(affinity, cap))
    monkeypatch.setattr(common, "CGROUP_CPU_MAX", tmp_path / "absent")
    assert usable_cpus() == affinity


def warnings(cmd: list[str]) -> list[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("warning:")]


def test_threads_beyond_the_cpus_warn(tiny_package: Path, run_bin: Path) -> None:
    cpus = usable_cpus()
    python = [sys.executable, "-m", "aotgen", "run", str(tiny_package), *ARGS]
    cpp = [str(run_bin), str(tiny_package), *ARGS]
    expected = (
        f"warning: --threads {cpus + 1} on {cpus} usable CPU{'s' * (cpus > 1)}: the threads "
        f"wait on each other and decode slows severalfold; use --threads {cpus} or fewer"
    )
    for cmd in (python, cpp):
        assert warnings([*cmd, "--threads", str(cpus + 1)]) == [expected], cmd[:3]
        assert warnings([*cmd, "--threads", str(cpus)]) == [], cmd[:3]
