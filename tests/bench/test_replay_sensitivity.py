"""Smoke run of bench/replay_sensitivity.py on tiny traces: it runs, prints its tables, and its settings
reach the simulator (MPS sharing slows gpusched's shares when mps_slowdown > 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "replay_sensitivity.py"
FIXTURES = ROOT / "tests" / "fixtures"


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=110,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def rows(out: str, setting: str) -> list[list[str]]:
    """Cells of the table rows of one setting (useful_utilization table first, then jct_mean_s)."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith(f"| {setting}")]


@pytest.mark.timeout(120)
def test_quick_run_on_shares(tmp_path: Path) -> None:
    trace = tmp_path / "shares.csv"  # one user's two half-GPU shares co-reside under MPS on one GPU
    trace.write_text("submit_time,duration,user,share,gpu_mem\n0,100,a,0.5,20000\n0,100,a,0.5,20000\n")
    out = run(str(trace), "--gpus", "H100-80GB:1", "--quick")
    assert "| setting | gpusched | fifo-whole | fifo-timeslice | static-mig | ranking by useful_utilization |" in out
    assert "ranking by jct_mean_s:" in out and "ranking by useful_utilization:" in out
    none = rows(out, "mps 0.00 (none)")
    default = rows(out, "mps 0.15 (default)")
    assert float(none[0][1]) == pytest.approx(1.0, abs=1e-3)  # both shares done in 100 s on one GPU
    assert float(default[0][1]) == pytest.approx(0.85, abs=1e-3)  # 100 s of work at speed 1 - 0.15
    assert float(none[0][2]) == float(default[0][2])  # fifo-whole has no sharing: unaffected


@pytest.mark.timeout(120)
def test_full_grid_with_times_from() -> None:
    out = run(str(FIXTURES / "alibaba_timeless_pods.csv"), "--times-from",
              str(FIXTURES / "alibaba_timeless_times.csv"))
    assert "6 jobs on H100-80GB:8" in out
    settings = [line for line in out.splitlines() if line.startswith("| mps ")]
    assert len(settings) == 2 * 9  # 3 x 3 settings in each of the two tables
