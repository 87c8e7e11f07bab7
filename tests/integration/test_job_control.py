"""Suspend/resume, hold/release, dependencies, process groups and the job environment, end to end."""

from __future__ import annotations

import os

from gpusched.model import Dependency, JobSpec, JobState, WholeRequest
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    HoldRequest,
    JobsChanged,
    LogsRequest,
    LogsResult,
    ReleaseRequest,
    ResumeRequest,
    ShowRequest,
    ShowResult,
    SubmitRequest,
    SubmitResult,
    SuspendRequest,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, wait_until
from tests.integration.test_daemon import spec, state_of, submit, wait_done


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def log_text(c: Client, job_id: int) -> str:
    return c.call(LogsRequest(job_id=job_id), LogsResult).data


def test_suspend_stops_the_whole_job_and_resume_continues_it(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sh", "-c", "sleep 30 & echo $!; wait"))
        wait_until(lambda: log_text(c, job_id).strip().isdigit(), what="child pid in log")
        child = int(log_text(c, job_id))
        # The job can write before the daemon has recorded it RUNNING (the shim reports its pid after
        # the exec, and the launch's pid is recorded while it is still STARTING): wait for RUNNING, or
        # a suspend in the window is rightly refused as STARTING.
        job = wait_until(lambda: ((j := c.call(ShowRequest(job_id=job_id), ShowResult).job).state is JobState.RUNNING
                                  and j.pid is not None and j),
                         what="the job recorded RUNNING with its pid")
        assert job.pid is not None
        assert c.call(SuspendRequest(job_ids=[job_id]), JobsChanged).changed == [job_id]
        shown = c.call(ShowRequest(job_id=job_id), ShowResult).job
        assert shown.state is JobState.SUSPENDED
        assert "GPU memory" in shown.reason
        wait_until(lambda: proc_state(child) == "T" and proc_state(job.pid or 0) == "T", what="stopped")
        again = c.call(SuspendRequest(job_ids=[job_id]), JobsChanged)
        assert again.unchanged == {job_id: "job is SUSPENDED, not RUNNING"}
        assert c.call(ResumeRequest(job_ids=[job_id]), JobsChanged).changed == [job_id]
        wait_until(lambda: proc_state(child) in ("S", "R"), what="child resumed")
        assert state_of(c, job_id) is JobState.RUNNING
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)
        assert wait_done(c, job_id).job.state is JobState.CANCELLED
        wait_until(lambda: not os.path.exists(f"/proc/{child}") or proc_state(child) == "Z",
                   what="forked child ended with the job")


def test_cancel_of_a_suspended_job_still_ends_it(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "30"))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="running")
        c.call(SuspendRequest(job_ids=[job_id]), JobsChanged)
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)
        res = wait_done(c, job_id)
        assert res.job.state is JobState.CANCELLED and res.job.signal == 15


def test_hold_and_release(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        held = c.call(SubmitRequest(spec=spec("true"), hold=True), SubmitResult).job_id
        assert state_of(c, held) is JobState.HELD
        assert "release" in (c.call(ShowRequest(job_id=held), ShowResult).waiting_reason or "")
        blocker = submit(c, spec("sleep", "30", gpus=2))
        pending = submit(c, spec("true"))
        assert c.call(HoldRequest(job_ids=[pending]), JobsChanged).changed == [pending]
        assert c.call(HoldRequest(job_ids=[blocker]), JobsChanged).unchanged[blocker].startswith("job is")
        c.call(CancelRequest(job_ids=[blocker]), CancelResult)
        wait_done(c, blocker)
        assert state_of(c, pending) is JobState.HELD  # a held job does not start on free GPUs
        c.call(ReleaseRequest(job_ids=[held, pending]), JobsChanged)
        assert wait_done(c, held).job.state is JobState.COMPLETED
        assert wait_done(c, pending).job.state is JobState.COMPLETED
        history = [t.state for t in c.call(ShowRequest(job_id=pending), ShowResult).job.history]
        assert history[:3] == [JobState.PENDING, JobState.HELD, JobState.PENDING]


def test_dependencies_wait_then_run_or_fail_when_they_can_never_be_met(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        first = submit(c, spec("sh", "-c", "sleep 0.5; exit 1"))
        on_ok = submit(c, spec("true", after=[Dependency(job_id=first, condition="ok")]))
        on_any = submit(c, spec("true", after=[Dependency(job_id=first, condition="any")]))
        assert "waiting for job" in (c.call(ShowRequest(job_id=on_any), ShowResult).waiting_reason or "")
        assert wait_done(c, first).job.state is JobState.FAILED
        never = wait_done(c, on_ok).job
        assert never.state is JobState.FAILED
        assert never.reason == f"dependency can never be met: job {first} ended FAILED, needed COMPLETED"
        assert wait_done(c, on_any).job.state is JobState.COMPLETED


def test_environment_is_the_submitters_plus_allocation_and_login_defaults(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_spec = JobSpec(argv=["sh", "-c", "echo $MY_VAR:$HOME:$USER; echo $GPUSCHED_ALLOCATION"], cwd="/",
                           env={"MY_VAR": "kept", "PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1),
                           precision="fp32")
        job_id = submit(c, job_spec)
        wait_done(c, job_id)
        first, allocation = log_text(c, job_id).splitlines()
        assert first == "kept:/root:root"
        assert '"compute_fraction":1.0' in allocation
        bare = JobSpec(argv=["sh", "-c", "echo $PATH"], cwd="/", env={}, request=WholeRequest(gpus=1))
        job_id = submit(c, bare)
        wait_done(c, job_id)
        assert log_text(c, job_id).strip() == "/usr/local/bin:/usr/bin:/bin"
