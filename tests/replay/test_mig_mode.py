"""Dynamic MIG GPUs switch MIG mode from demand in replay: a 4-GPU pod is not dropped (issue 11)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpusched.model import JobState
from gpusched.replay.runner import run_replay

TRACE = """submit_time,duration,user,gpus,mig,class,name
0,1000,a,,1g.10gb,batch,small-0
0,1000,a,,3g.40gb,batch,small-1
5000,2000,b,4,,batch,pod
9000,500,c,,2g.20gb,batch,small-2
"""


def _run(write_csv: Callable[[str], str], tmp_path: Path, toggle: bool) -> dict[str, tuple[JobState, float | None]]:
    cfg = tmp_path / "replay.toml"
    cfg.write_text(f"[replay]\nmig_gpus = 2\n[mig]\ntoggle_mode = {'true' if toggle else 'false'}\n"
                   "min_idle_s = 300.0\nmin_reconfig_interval_s = 600.0\n")
    result = run_replay(write_csv(TRACE), gpus="H100-80GB:4", policies=["gpusched"], config_path=str(cfg)).results[0]
    return {j.spec.argv[-1]: (j.state, j.started_at) for j in result.jobs}


def test_idle_dynamic_gpus_leave_mig_mode_for_a_pod_and_come_back(write_csv: Callable[[str], str],
                                                                   tmp_path: Path) -> None:
    jobs = _run(write_csv, tmp_path, toggle=True)
    assert all(state is JobState.COMPLETED for state, _ in jobs.values()), jobs
    pod_start = jobs["pod"][1]
    assert pod_start is not None and 5000 <= pod_start <= 5000 + 300 + 10 + 1  # idle long enough: at once
    small = jobs["small-2"][1]
    assert small is not None and small >= pod_start + 2000  # its GPU came back into MIG mode after the pod


def test_without_mode_switching_the_pod_can_never_run(write_csv: Callable[[str], str], tmp_path: Path) -> None:
    jobs = _run(write_csv, tmp_path, toggle=False)
    assert jobs["pod"][0] is JobState.FAILED  # 4 whole GPUs asked, 2 with MIG off
    assert jobs["small-2"][0] is JobState.COMPLETED
