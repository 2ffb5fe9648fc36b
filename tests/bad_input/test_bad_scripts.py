"""The measurement scripts (`scripts/*.py`) refuse a path that is not a package as the
commands do: one `error:` line naming it, exit 1, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "step_times": ["{missing}"],
    "batch_step_times": ["{missing}"],
    "ab_spec": ["{missing}", "{missing}", "1"],
    "make_calibration_text": ["{missing}"],
    "batch_speculative": ["{missing}"],
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_script_refuses_a_missing_package(script, tmp_path):
    missing = tmp_path / "no-such-package"
    args = [a.format(missing=missing) for a in SCRIPTS[script]]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and f"error: {missing} is not an aotgen package" in lines[0], lines
    assert not missing.exists()
