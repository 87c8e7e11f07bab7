"""Preemption in replay: a checkpointed job keeps its work; a requeued one loses it within a budget."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.model import JobState
from gpusched.replay.policies import load_config
from gpusched.replay.runner import run_replay


def _story(arrivals: list[float], train_s: float) -> str:
    rows = [f"0,{train_s},trainer,1,,,batch,1,train-{k}" for k in range(3)]
    rows += [f"{t},120,u{k % 2},,0.1,1024,interactive,0,infer-{k}" for k, t in enumerate(sorted(arrivals))]
    return "submit_time,duration,user,gpus,share,gpu_mem,class,requeue,name\n" + "\n".join(rows) + "\n"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrivals=st.lists(st.floats(10, 20_000), min_size=1, max_size=8), train_s=st.floats(30_000, 60_000))
def test_checkpointed_jobs_keep_their_work(write_csv: Callable[[str], str], arrivals: list[float],
                                           train_s: float) -> None:
    report = run_replay(write_csv(_story(arrivals, train_s)), gpus="H100-80GB:2", policies=["gpusched"])
    result = report.results[0]
    restore = load_config(None).interference.checkpoint_restore_s
    checkpointed = 0
    for job in result.jobs:
        if job.user != "trainer":
            continue
        assert job.state is JobState.COMPLETED
        held = sum(t1 - t0 for t0, t1, _ in result.segments[job.id])
        restores = sum(1 for tr in job.history if tr.state is JobState.PREEMPTED)
        checkpointed += restores
        assert all("checkpointed" in tr.reason for tr in job.history if tr.state is JobState.PREEMPTED)
        # All its work was done once: time held = its duration + at most one restore per checkpoint
        # (a checkpoint during a restore cuts that restore short; nothing is ever redone).
        assert train_s - 1e-3 <= held <= train_s + restores * restore + 1e-3, (held, train_s, restores)
    # The first interactive job always finds both GPUs taken by the trainer: something was checkpointed.
    assert checkpointed >= 1


def test_requeue_preemption_loses_work_within_the_daily_budget(write_csv: Callable[[str], str],
                                                             tmp_path: Path) -> None:
    cfg = tmp_path / "replay.toml"
    cfg.write_text("[replay]\ncheckpoint = false\n[scheduler]\npreempt_budget_gpu_s = 1000.0\n"
                   "preempt_min_run_s = 600.0\n")
    trace = write_csv(_story([700.0, 5000.0, 9000.0], 30_000.0))
    result = run_replay(trace, gpus="H100-80GB:2", policies=["gpusched"], config_path=str(cfg)).results[0]
    lost = 0.0
    for job in result.jobs:
        started = 0.0
        for tr in job.history:
            if tr.state is JobState.STARTING:
                started = tr.at
            elif tr.state is JobState.PREEMPTED:
                assert "requeued" in tr.reason
                lost += tr.at - started
    # One requeue (about 700 s of one GPU's work); any later one would exceed the 1000 GPU-s budget.
    assert 600 <= lost <= 1000.0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrivals=st.lists(st.floats(10, 20_000), min_size=1, max_size=6), train_s=st.floats(30_000, 60_000))
def test_shares_suspended_in_place_keep_their_work(write_csv: Callable[[str], str], arrivals: list[float],
                                                   train_s: float) -> None:
    """Batch shares fill an MPS GPU; an interactive share suspends one in place: it is never ended or
    started again (its work is kept), and it continues once the interactive share is gone."""
    rows = [f"0,{train_s},trainer,,0.5,10240,batch,0,train-{k}" for k in range(2)]
    rows += [f"{t},120,u{k % 2},,0.5,10240,interactive,0,infer-{k}" for k, t in enumerate(sorted(arrivals))]
    trace = write_csv("submit_time,duration,user,gpus,share,gpu_mem,class,requeue,name\n" + "\n".join(rows) + "\n")
    result = run_replay(trace, gpus="H100-80GB:1", policies=["gpusched"]).results[0]
    suspended = 0
    for job in result.jobs:
        assert job.state is JobState.COMPLETED, (job.id, job.state, job.reason)
        states = [tr.state for tr in job.history]
        if job.user == "trainer":
            assert states.count(JobState.STARTING) == 1 and JobState.PREEMPTED not in states  # never redone
            stops = [tr for tr in job.history if tr.state is JobState.SUSPENDED]
            assert all("suspended in place" in tr.reason for tr in stops)
            assert states.count(JobState.RUNNING) == 1 + len(stops)  # each stop was continued
            suspended += len(stops)
    first = min((j for j in result.jobs if j.user != "trainer"), key=lambda j: (j.submitted_at, j.id))
    start = next(tr.at for tr in first.history if tr.state is JobState.STARTING)
    assert start == first.submitted_at  # the first interactive share got a trainer share's compute at once
    assert suspended >= 1
