"""How jobs end, from an audit (each test failed on the code before): a cancel during a requeue
preemption requeued the job; `wait` exited 0 for a job the daemon FAILED; time limits followed steps
of the wall clock; a long limit's reason read 1.2096e+06s."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from gpusched.config import GpuConfig
from gpusched.model import JobSpec, JobState, ShareRequest, WholeRequest
from gpusched.protocol import CancelRequest, CancelResult, ShowRequest, ShowResult
from tests.conftest import DaemonHandle, wait_until
from tests.integration.test_daemon import spec, state_of, submit, wait_done
from tests.integration.test_identity import as_user

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")

# A job that does what the user guide recommends: trap SIGTERM and save a checkpoint (1.5 s here,
# inside the 2 s grace period of the test daemons) before exiting.
CHECKPOINTING = ["sh", "-c", "trap 'sleep 1.5; exit 0' TERM; while :; do sleep 0.1; done"]


def _msg(argv: list[str], request: Any, **fields: Any) -> dict[str, Any]:
    s = JobSpec(argv=argv, cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=request, **fields)
    return {"op": "submit", "spec": s.model_dump(mode="json")}


@needs_root
def test_cancel_during_a_requeue_preemption_cancels_the_job(daemon_factory: Any) -> None:
    """A --requeue job being preempted (SIGTERM sent, in its grace period) is cancelled by its owner:
    `cancel` answers "Cancelled", so the job must end CANCELLED, not go back to the queue and run again."""
    daemon = daemon_factory(sim="H100-80GB:2", gpus={"0": GpuConfig(share="mps"), "1": GpuConfig(share="mps")},
                            checkpoint=False)
    trainer = [r["result"]["job_id"] for r in as_user(20010, daemon.socket, *[
        _msg(CHECKPOINTING, WholeRequest(gpus=1), requeue=True, name="train") for _ in range(2)])]
    with daemon.client() as c:
        wait_until(lambda: all(state_of(c, j) is JobState.RUNNING for j in trainer), what="trainer on both GPUs")
        as_user(20011, daemon.socket, _msg(["sleep", "60"], ShareRequest(fraction=0.1, gpu_mem_mib=4096),
                                           job_class="interactive"))

        def being_preempted() -> int | None:
            stops = daemon.call_in_loop(lambda: dict(daemon.daemon.engine._stops))  # type: ignore[union-attr]
            return next((j for j in trainer if j in stops and stops[j].final is JobState.PREEMPTED), None)

        victim = wait_until(being_preempted, timeout=20, what="a trainer job being preempted")
        # The owner cancels it while it saves its checkpoint.
        as_user(20010, daemon.socket, {"op": "cancel", "job_ids": [victim]})
        try:  # (requeued, it would go PENDING and run again, and never end)
            job = wait_done(c, victim, timeout=15).job
        finally:
            c.call(CancelRequest(job_ids=trainer), CancelResult)
        assert job.state is JobState.CANCELLED, [(t.state.value, t.reason) for t in job.history]


def test_a_backward_clock_step_does_not_extend_a_time_limit(daemon: DaemonHandle) -> None:
    """The system clock is stepped back an hour (NTP, an admin's `date -s`) while a `--time 2s` job runs.
    Simulated by handing the engine a wall clock that is an hour behind (the engine's `clock` is
    time.time). The limit is 2 s of running time; the job must still end TIMEOUT within seconds."""
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "60", time_limit_s=2.0))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="running")
        engine = daemon.daemon.engine  # type: ignore[union-attr]
        daemon.call_in_loop(lambda: setattr(engine, "clock", lambda: time.time() - 3600))  # date -s '-1 hour'
        try:
            res = wait_done(c, job_id, timeout=15)
        except AssertionError as exc:
            c.call(CancelRequest(job_ids=[job_id]), CancelResult)
            raise AssertionError(f"--time 2s job still running 15 s after a backward clock step: {exc}") from None
        assert res.job.state is JobState.TIMEOUT


def test_a_forward_clock_step_does_not_time_out_running_jobs(daemon: DaemonHandle) -> None:
    """The clock is stepped forward an hour (a host whose RTC was behind gets its first NTP sync)
    while a `--time 2h` job has run for a second: it has not run 2 h and must keep running."""
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "60", time_limit_s=7200.0))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="running")
        engine = daemon.daemon.engine  # type: ignore[union-attr]
        daemon.call_in_loop(lambda: setattr(engine, "clock", lambda: time.time() + 3 * 3600))  # date -s '+3 hours'
        passes = engine.passes
        wait_until(lambda: engine.passes >= passes + 5, what="five passes (ticks) with the clock stepped")
        job = c.call(ShowRequest(job_id=job_id), ShowResult).job
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)
        assert job.state is JobState.RUNNING, (job.state, job.reason)


def test_wait_never_exits_0_for_a_failed_job(daemon: DaemonHandle) -> None:
    """A job that traps SIGTERM and exits 0 (as the user guide recommends: "Trap SIGTERM to save a
    checkpoint") ends FAILED `gpu_fault: XID 79` when its GPU fails. `gpusched wait` must not exit 0
    for a FAILED job (scripts do `gpusched submit --wait ... && next`); the docs promise 143 here."""
    import subprocess
    import sys

    from gpusched.protocol import SimInjectXidRequest, SimResult

    with daemon.client() as c:
        job_id = submit(c, spec("sh", "-c", CHECKPOINTING[2].replace("1.5", "0.2")))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="running")
        gpu = c.call(ShowRequest(job_id=job_id), ShowResult).job.allocation.devices[0].gpu_index  # type: ignore[union-attr]
        c.call(SimInjectXidRequest(gpu=gpu, xid=79), SimResult)
        gpusched = os.path.join(os.path.dirname(sys.executable), "gpusched")
        out = subprocess.run([gpusched, "--socket", daemon.socket, "wait", str(job_id)],
                             capture_output=True, text=True, timeout=30)
        job = c.call(ShowRequest(job_id=job_id), ShowResult).job
    assert job.state is JobState.FAILED and job.reason == "gpu_fault: XID 79", (job.state, job.reason)
    assert out.returncode == 143, f"wait exited {out.returncode} for a FAILED job; stderr: {out.stderr.strip()!r}"
    assert "gpu_fault: XID 79" in out.stderr, out.stderr


def test_the_timeout_reason_of_a_long_limit_is_readable(daemon: DaemonHandle) -> None:
    """`--time 14-0` (14 days) reached: the reason must not read `time limit of 1.2096e+06s reached`.
    (Fifteen days are made to pass as for a job re-adopted after a restart: the engine's clock 15 days
    ahead, and no measurement of its own yet, so its history decides.)"""
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "60", time_limit_s=14 * 86400.0))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="running")
        engine = daemon.daemon.engine  # type: ignore[union-attr]
        def ahead() -> None:
            engine.clock = lambda: time.time() + 15 * 86400
            engine._run_anchors.clear()
        daemon.call_in_loop(ahead)
        res = wait_done(c, job_id, timeout=15)
    assert res.job.state is JobState.TIMEOUT
    assert "e+" not in (res.job.reason or ""), res.job.reason
