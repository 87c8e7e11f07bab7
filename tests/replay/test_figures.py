"""`gpusched replay`'s figures against docs/replay.md's definitions, on hand-made traces whose
answers are computed by hand (an audit: each test failed on the code before): a share continued
after a suspend in place held 0 GPU from then on; gpusched dropped the MIG jobs of a one-GPU node;
a job a FIFO planner could never run made it look unfair until it reached the head."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusched.replay.runner import run_replay


def _trace(tmp_path: Path, text: str) -> str:
    p = tmp_path / "t.csv"
    p.write_text(text)
    return str(p)


def test_share_resumed_after_suspend_keeps_its_allocation(tmp_path: Path) -> None:
    # alice's batch 0.9 share is suspended in place at t=3000 for bob's interactive 0.5 share and
    # continues at 3100 until 10100. It holds 0.9 of the GPU over [0,3000) and [3100,10100):
    # utilization = (0.9*3000 + 0.5*100 + 0.9*7000) / 10100 = 0.896.
    path = _trace(tmp_path, "submit_time,duration,user,share,gpu_mem,class\n"
                            "0,10000,alice,0.9,10000,batch\n3000,100,bob,0.5,10000,interactive\n")
    r = run_replay(path, gpus="H100-80GB:1", policies=["gpusched"])
    res, s = r.results[0], r.summaries[0]
    alice = res.jobs[0]
    assert [t.state.value for t in alice.history].count("SUSPENDED") == 1  # the scenario happened
    assert s["makespan_s"] == pytest.approx(10100.0)
    assert res.segments[alice.id][-1][2] == pytest.approx(0.9)  # is 0.0 after the resume
    assert s["utilization"] == pytest.approx((0.9 * 3000 + 0.5 * 100 + 0.9 * 7000) / 10100, abs=1e-4)
    assert s["useful_utilization"] <= s["utilization"] + 1e-9


def test_gpusched_on_one_gpu_runs_mig_jobs_the_baselines_run(tmp_path: Path) -> None:
    # One H100, a 1g.10gb job and a 1-GPU job. Every baseline runs both; gpusched sizes
    # mig_gpus = min(max(m, 1), N - 1) = 0 and fails the MIG job as unsatisfiable (skipped = 1).
    path = _trace(tmp_path, "submit_time,duration,user,gpus,mig\n0,100,alice,,1g.10gb\n0,100,bob,1,\n")
    r = run_replay(path, gpus="H100-80GB:1")
    by = {s["policy"]: s for s in r.summaries}
    assert all(by[p]["jobs"] == 2 for p in ("fifo-whole", "fifo-timeslice", "static-mig"))
    assert by["gpusched"]["skipped"] == 0 and by["gpusched"]["jobs"] == 2, by["gpusched"]


def test_unsatisfiable_job_does_not_make_fifo_unfair(tmp_path: Path) -> None:
    # bob's 2-GPU job can never run on one GPU (counted in `skipped`); fifo-whole fails it only
    # when it reaches the head (t=100), and meanwhile bob is "entitled" to half the GPU he can
    # never use: jain 0.5, share_error_max 1.0. fifo-timeslice fails it at once: jain 1.0.
    path = _trace(tmp_path, "submit_time,duration,user,gpus\n0,100,alice,1\n0,100,alice,1\n5,100,bob,2\n")
    r = run_replay(path, gpus="H100-80GB:1", policies=["fifo-whole", "fifo-timeslice"])
    by = {s["policy"]: s for s in r.summaries}
    assert by["fifo-whole"]["skipped"] == 1
    assert by["fifo-whole"]["jain_index"] == pytest.approx(by["fifo-timeslice"]["jain_index"])
    assert by["fifo-whole"]["share_error_max"] == pytest.approx(0.0)
