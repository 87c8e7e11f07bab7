"""The event loop on traces small enough to work out by hand, and fairness against a baseline."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpusched.core.accounting import service_in_window
from gpusched.model import JobState
from gpusched.replay.policies import Interference, ReplayConfig, parse_gpus, setup
from gpusched.replay.runner import run_replay
from gpusched.replay.sim import run_policy
from gpusched.replay.trace import parse_csv

HAND = """
submit_time,duration,user,gpus,share,gpu_mem
0,100,a,1,,
0,50,b,2,,
10,30,a,1,,
20,40,b,,0.25,1000
"""


def test_fifo_whole_by_hand(write_csv: Callable[[str], str]) -> None:
    # 2 GPUs. Job 1 runs 0-100. Job 2 (2 GPUs) waits for it: 100-150. Strict FCFS holds job 3
    # behind job 2: 150-180. Job 4's share becomes a whole GPU: 150-190.
    report = run_replay(write_csv(HAND), gpus="H100-80GB:2", policies=["fifo-whole"])
    s = report.summaries[0]
    assert s["jobs"] == 4 and s["skipped"] == 0
    assert s["makespan_s"] == 190.0
    assert s["wait_mean_s"] == (0 + 100 + 140 + 130) / 4
    assert s["wait_p50_s"] == 115.0  # between 100 and 130
    assert s["jct_mean_s"] == (100 + 150 + 170 + 170) / 4
    assert s["utilization"] == pytest.approx(round((100 + 2 * 50 + 30 + 40) / (2 * 190), 6))
    assert s["mig_reconfigurations"] == 0
    result = report.results[0]
    starts = {j.id: j.started_at for j in result.jobs}
    assert starts == {1: 0.0, 2: 100.0, 3: 150.0, 4: 150.0}
    for job in result.jobs:  # the simulator's service equals core.accounting's
        _, service = service_in_window(job, 0.0, 190.0)
        assert sum((t1 - t0) * f for t0, t1, f in result.segments[job.id]) == pytest.approx(service)
        assert [t.state for t in job.history][-1] is JobState.COMPLETED


def test_timeslice_slows_co_resident_jobs(write_csv: Callable[[str], str]) -> None:
    # One GPU, two jobs of 100 s at once: each at (1 - overhead) / 2 until the first ends.
    path = write_csv("submit_time,duration,user,gpus\n0,100,a,1\n0,100,b,1\n")
    report = run_replay(path, gpus="H100-80GB:1", policies=["fifo-timeslice"])
    ends = sorted(j.ended_at or 0 for j in report.results[0].jobs)
    speed = (1 - Interference().timeslice_overhead) / 2
    assert ends == pytest.approx([100 / speed, 100 / speed])
    assert report.summaries[0]["utilization"] == pytest.approx(1.0)


def test_dynamic_mig_pays_reconfiguration_delay(write_csv: Callable[[str], str]) -> None:
    path = write_csv("submit_time,duration,user,mig\n0,100,a,3g.40gb\n0,100,b,3g.40gb\n")
    trace = parse_csv(path)
    cfg = ReplayConfig(interference=Interference(mig_create_s=5.0))
    pol = setup("gpusched", parse_gpus("H100-80GB:1"), trace.jobs, cfg)
    assert pol.node.dynamic == frozenset({0})
    result = run_policy(pol, trace.jobs, cfg.interference)
    assert result.mig_reconfigurations == 2 and not result.mig_errors
    # Creations on one GPU are serial: the first instance exists at 5 s, the second at 10 s.
    assert sorted(j.ended_at or 0 for j in result.jobs) == [105.0, 110.0]
    for job in result.jobs:
        states = [t.state for t in job.history]
        assert states == [JobState.PENDING, JobState.STARTING, JobState.RUNNING, JobState.COMPLETED]


def test_static_mig_sizes_layouts_from_demand(write_csv: Callable[[str], str]) -> None:
    rows = "".join(f"0,100,u{i},,0.1,8000\n" for i in range(14)) + "0,100,w,1,,\n"
    trace = parse_csv(write_csv("submit_time,duration,user,gpus,share,gpu_mem\n" + rows))
    pol = setup("static-mig", parse_gpus("H100-80GB:2"), trace.jobs, ReplayConfig())
    assert pol.node.static_layouts == {1: ("1g.10gb",) * 7}  # GPU 0 stays whole
    result = run_policy(pol, trace.jobs, ReplayConfig().interference)
    assert sorted({j.ended_at or 0.0 for j in result.jobs}) == [100.0, 200.0]  # 7 of 14 fit at once


def test_weighted_fairness_gpusched_vs_fifo(write_csv: Callable[[str], str]) -> None:
    # Both users keep 60 one-GPU jobs queued; a has weight 200, b 100. On 3 GPUs a fair scheduler
    # gives a 2 GPUs and b 1 while both wait; FIFO on interleaved submissions gives them 1.5 each.
    rows = []
    for i in range(60):
        rows.append(f"{i * 0.001},100,a,1,200")
        rows.append(f"{i * 0.001 + 0.0005},100,b,1,100")
    path = write_csv("submit_time,duration,user,gpus,weight\n" + "\n".join(rows) + "\n")
    report = run_replay(path, gpus="H100-80GB:3", policies=["gpusched", "fifo-whole"])
    fair, fifo = report.summaries
    assert fair["share_error_max"] < 0.05
    assert fifo["share_error_max"] > 0.2
    assert fair["jain_index"] > fifo["jain_index"]


def test_unsatisfiable_jobs_are_counted_as_skipped(write_csv: Callable[[str], str]) -> None:
    path = write_csv("submit_time,duration,user,gpus\n0,10,a,4\n0,10,a,1\n")
    report = run_replay(path, gpus="H100-80GB:2")
    for s in report.summaries:
        assert s["jobs"] == 1 and s["skipped"] == 1, s


@pytest.mark.parametrize("duration", [1.0, 600.0, 36_000.0])
def test_weights_hold_in_the_first_starts_at_every_job_length(write_csv: Callable[[str], str],
                                                             duration: float) -> None:
    """Issue 11: weights 300:100, both backlogged -> 3:1 (+-10 %) of the first 20 starts, for jobs of
    1 s, 10 min or 10 h alike (a charge that only grows while jobs run gave 1:1 below an hour)."""
    rows = [f"0,{duration},heavy,1,300" for _ in range(40)] + [f"0,{duration},light,1,100" for _ in range(40)]
    path = write_csv("submit_time,duration,user,gpus,weight\n" + "\n".join(rows) + "\n")
    result = run_replay(path, gpus="H100-80GB:2", policies=["gpusched"]).results[0]
    first = sorted((j for j in result.jobs if j.started_at is not None), key=lambda j: (j.started_at, j.id))[:20]
    heavy = sum(1 for j in first if j.user == "heavy")
    assert 14 <= heavy <= 16, [j.user for j in first]
