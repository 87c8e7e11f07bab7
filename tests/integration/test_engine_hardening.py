"""Issue #12 (hardening round 2), the engine and process side: one reproduction per finding.

Each test is the finding's reproduction against the real daemon, real shims and real processes.
A launch "stuck between setuid and exec" is made deterministic by giving a job a FIFO for its log:
the shim's child blocks opening it as the job's user, exactly where a user's SIGSTOP would hold it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from gpusched.config import GpuConfig
from gpusched.daemon import shim
from gpusched.daemon.executor import Executor, Identity
from gpusched.model import JobSpec, JobState, ShareRequest, WholeRequest
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    JobsChanged,
    ShowRequest,
    ShowResult,
    SubmitRequest,
    SubmitResult,
    SuspendRequest,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, kill_job_processes, short_tmpdir, wait_until
from tests.daemon.test_cgroups import fake_cgroupfs
from tests.integration.test_daemon import spec, state_of, submit, wait_done


def _show(c: Client, job_id: int) -> Any:
    return c.call(ShowRequest(job_id=job_id), ShowResult).job


def _alive(pid: int) -> bool:
    return shim.process_start_time(pid) is not None  # a zombie counts as gone


def _forked(state_dir: str, job_id: int) -> int:
    """The job's pid once its shim has forked it."""
    pid = wait_until(lambda: _job_pid(state_dir, job_id), what="the shim to fork the job")
    assert pid is not None
    return pid


def _job_pid(state_dir: str, job_id: int) -> int | None:
    try:
        with open(os.path.join(state_dir, "jobs", str(job_id), shim.SHIM)) as f:
            return int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture
def stuck_launches(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Job ids in this set get a FIFO as their log: their launch blocks before exec until killed."""
    stuck: set[int] = set()
    real = Executor._create_log

    def create_log(self: Executor, job_id: int, who: Identity) -> str:
        if job_id not in stuck:
            return real(self, job_id, who)
        path = self.log_path(job_id)
        os.mkfifo(path, 0o600)
        return path

    monkeypatch.setattr(Executor, "_create_log", create_log)
    return stuck


# ---- item 1: a kill -9 never leaves a daemon that will not start ----------------------------------


def test_restart_after_a_starting_job_ended_while_the_daemon_was_down(
    daemon_factory: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`StoreError: job 39: illegal transition STARTING -> COMPLETED (exit code 0)` stopped gpuschedd:
    the daemon died after the shim launched `true` but before it recorded RUNNING."""
    d = daemon_factory()
    real_start = Executor.start

    async def start_then_die(self: Executor, *args: Any, **kwargs: Any) -> Any:
        await real_start(self, *args, **kwargs)
        await asyncio.Event().wait()  # as a kill -9 here would: RUNNING is never recorded

    monkeypatch.setattr(Executor, "start", start_then_die)
    with d.client() as c:
        job_id = submit(c, spec("true"))
        wait_until(lambda: os.path.exists(os.path.join(d.state_dir, "jobs", str(job_id), shim.STATUS)),
                   what="the job to end under its shim")
        assert state_of(c, job_id) is JobState.STARTING
    monkeypatch.undo()
    d.restart()
    with d.client() as c:
        job = _show(c, job_id)
        assert (job.state, job.exit_code) == (JobState.COMPLETED, 0)
        assert [t.state for t in job.history][-2:] == [JobState.RUNNING, JobState.COMPLETED]
        assert wait_done(c, submit(c, spec("true"))).job.state is JobState.COMPLETED  # and it serves


def test_unreadable_saved_records_do_not_stop_the_daemon(daemon_factory: Any) -> None:
    """Torn fair-share standing and stop requests cost a user their place, never the daemon."""
    d = daemon_factory()
    with d.client() as c:
        job_id = submit(c, spec("sleep", "30"))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="running")
    d.stop()
    from gpusched.daemon.store import Store

    store = Store(os.path.join(d.state_dir, "gpusched.db"))
    store.set_meta("standing", '{"users": [1, 2')
    store.set_meta("stop_requests", json.dumps({str(job_id): ["NOT-A-STATE", 3], "x": 1}))
    store.close()
    d.start()
    with d.client() as c:
        assert state_of(c, job_id) is JobState.RUNNING  # re-adopted
        assert wait_done(c, submit(c, spec("true"))).job.state is JobState.COMPLETED


# ---- item 2: nothing a user controls can block the loop ----------------------------------------


def test_a_stuck_launch_fails_only_that_job(daemon_factory: Any, stuck_launches: set[int]) -> None:
    """A job stopped (SIGSTOP, by its own user) between setuid and exec: other users' jobs start on
    the free GPU at once, and the stuck one fails at the launch deadline."""
    d = daemon_factory(launch_timeout_s=3.0)
    with d.client() as c:
        stuck_launches.add(1)
        stuck = submit(c, spec("true"))
        assert stuck == 1
        pid = _forked(d.state_dir, stuck)
        os.kill(pid, signal.SIGSTOP)  # what the job's user can do to their own process
        began = time.monotonic()
        other = submit(c, spec("sleep", "30"))
        wait_until(lambda: state_of(c, other) is JobState.RUNNING, timeout=5, what="the next job to start")
        assert state_of(c, stuck) is JobState.STARTING
        job = wait_done(c, stuck, timeout=15).job
        assert job.state is JobState.FAILED and "launch_timeout_s" in job.reason, job.reason
        assert time.monotonic() - began < 3.0 + 2.0 + 5.0  # deadline + kill grace + slack
        assert not _alive(pid)
        assert state_of(c, other) is JobState.RUNNING


def test_a_slow_exec_does_not_hold_up_other_jobs(daemon: DaemonHandle) -> None:
    """A 60,000-entry PATH makes the child's execvpe copy the environment once per entry (quadratic,
    seconds) as the job's user; the pass used to wait for it, so the next job waited too. (Empty
    entries: one variable may not exceed 128 KiB, or exec fails at once with E2BIG.)"""
    slow_path = ":" * 60_000 + "/usr/bin:/bin"
    with daemon.client() as c:
        slow = submit(c, JobSpec(argv=["true"], cwd="/", env={"PATH": slow_path}, request=WholeRequest(gpus=1)))
        wait_until(lambda: state_of(c, slow) is not JobState.PENDING, what="the slow job to begin its launch")
        other = submit(c, spec("sleep", "30"))
        wait_until(lambda: state_of(c, other) is JobState.RUNNING, timeout=15, what="the other job to run")
        assert wait_done(c, slow, timeout=60).job.state is JobState.COMPLETED
        started = {j: next(t.at for t in _show(c, j).history if t.state is JobState.RUNNING) for j in (slow, other)}
        assert started[other] < started[slow], f"the other job waited for the slow launch: {started}"


def test_a_shim_that_dies_before_forking_fails_its_job_once(daemon_factory: Any) -> None:
    """Not requeued (the launch would fail again and again): the job ends FAILED with the reason.
    (Spawned shims: a forked shim cannot be given another interpreter; tests/daemon/test_forkserver.py
    covers the fork server's failures.)"""
    daemon = daemon_factory(launcher="spawn")
    executor = daemon.call_in_loop(lambda: daemon.daemon.engine.executor)
    executor.python = "/bin/false"  # the shim's interpreter exits 1 at once
    try:
        with daemon.client() as c:
            job = wait_done(c, submit(c, spec("true"))).job
            assert job.state is JobState.FAILED and "job supervisor" in job.reason, job.reason
    finally:
        executor.python = sys.executable
    with daemon.client() as c:
        assert wait_done(c, submit(c, spec("true"))).job.state is JobState.COMPLETED


def test_time_limits_hold_while_a_launch_is_stuck(daemon_factory: Any, stuck_launches: set[int]) -> None:
    """Seen: a `--time 3` job ran for 20 s while the loop waited on someone else's launch."""
    d = daemon_factory(launch_timeout_s=300.0)
    with d.client() as c:
        stuck_launches.add(1)
        stuck = submit(c, spec("true"))
        os.kill(_forked(d.state_dir, stuck), signal.SIGSTOP)
        began = time.monotonic()
        limited = submit(c, spec("sleep", "60", time_limit_s=2))
        job = wait_done(c, limited, timeout=20).job
        assert job.state is JobState.TIMEOUT
        assert time.monotonic() - began < 2.0 + 2.0 + 6.0  # limit + kill grace + slack
        assert state_of(c, stuck) is JobState.STARTING


def test_cancel_reaches_a_job_stuck_before_exec(daemon_factory: Any, stuck_launches: set[int]) -> None:
    d = daemon_factory(launch_timeout_s=300.0)
    with d.client() as c:
        stuck_launches.add(1)
        stuck = submit(c, spec("true"))
        pid = _forked(d.state_dir, stuck)
        os.kill(pid, signal.SIGSTOP)
        assert c.call(CancelRequest(job_ids=[stuck]), CancelResult).cancelled == [stuck]
        job = wait_done(c, stuck, timeout=10).job  # kill_grace_s is 2 s
        assert job.state is JobState.CANCELLED
        assert not _alive(pid)


def test_daemon_stops_promptly_while_a_launch_is_stuck(daemon_factory: Any, stuck_launches: set[int]) -> None:
    """SIGTERM did not stop the daemon: its shutdown waited for the thread reading a stuck shim."""
    d: DaemonHandle = daemon_factory(launch_timeout_s=300.0)
    with d.client() as c:
        stuck_launches.add(1)
        stuck = submit(c, spec("true"))
        wait_until(lambda: _job_pid(d.state_dir, stuck), what="the shim to fork the job")
    began = time.monotonic()
    d.stop()
    assert time.monotonic() - began < 5.0


# ---- item 8: the root shim runs isolated --------------------------------------------------------


def test_a_module_planted_in_the_daemons_directory_never_runs(tmp_path: Path) -> None:
    """`python -m` put the daemon's working directory first on the root shim's sys.path."""
    base = short_tmpdir()
    planted = tempfile.mkdtemp(prefix="gs-planted-", dir="/tmp")
    os.chmod(planted, 0o1777)  # a world-writable start directory
    marker = tmp_path / "pwned"
    for name in ("json.py", "fcntl.py", "signal.py"):
        Path(planted, name).write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    config = Path(base, "gpusched.toml")  # relative --socket/--state-dir resolve against the start directory
    config.write_text('allow_root_jobs = true\ntick_s = 0.2\ncgroup_root = "off"\n')
    daemon = os.path.join(os.path.dirname(sys.executable), "gpuschedd")
    proc = subprocess.Popen([daemon, "--config", str(config), "--sim", "H100-80GB:1", "--socket", "g.sock",
                             "--state-dir", "state"], cwd=planted, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        sock = os.path.join(planted, "g.sock")
        wait_until(lambda: os.path.exists(sock), timeout=30, what="the daemon's socket")
        assert os.readlink(f"/proc/{proc.pid}/cwd") == "/"
        with Client(sock) as c:
            job_id = submit(c, JobSpec(argv=["true"], cwd=planted, request=WholeRequest(gpus=1)))
            assert wait_done(c, job_id).job.state is JobState.COMPLETED
        assert not marker.exists(), f"planted module ran: {marker.read_text()}"
    finally:
        proc.terminate()
        proc.wait(30)
        kill_job_processes(os.path.join(planted, "state"))
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(planted, ignore_errors=True)


# ---- item 9: nothing of a job outlives it --------------------------------------------------------


@pytest.mark.parametrize("script", [
    "nohup sleep 60 >/dev/null 2>&1 & echo $! > pid; exit 0",
    "set -m; sleep 60 & echo $! > pid; exit 0",  # job control: its own process group, same session
])
def test_processes_left_behind_die_before_the_job_ends(daemon: DaemonHandle, tmp_path: Path, script: str) -> None:
    with daemon.client() as c:
        job_id = submit(c, JobSpec(argv=["sh", "-c", script], cwd=str(tmp_path), env={"PATH": os.environ["PATH"]},
                                   request=WholeRequest(gpus=1)))
        job = wait_done(c, job_id).job
        assert job.state is JobState.COMPLETED
        left = int((tmp_path / "pid").read_text())
        assert not _alive(left), "the background process outlived its job (and kept its GPU)"


# ---- item 10: a suspended job cannot stop its own clock ------------------------------------------


def test_sigcont_while_suspended_runs_the_clock_again(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "60", time_limit_s=3))
        pid: int = wait_until(lambda: _show(c, job_id).pid if state_of(c, job_id) is JobState.RUNNING else 0,
                              what="running")
        c.call(SuspendRequest(job_ids=[job_id]), JobsChanged)
        wait_until(lambda: "T" in _proc_state(pid), what="the job stopped")
        began = time.monotonic()
        os.killpg(pid, signal.SIGCONT)  # the job's owner resumes it behind gpusched's back
        job = wait_done(c, job_id, timeout=15).job
        assert job.state is JobState.TIMEOUT, f"{job.state}: {job.reason}"
        assert any("continued by a signal" in t.reason for t in job.history)
        assert time.monotonic() - began < 3.0 + 2.0 + 5.0


def test_the_scan_of_suspended_jobs_does_not_hold_the_loop(daemon: DaemonHandle,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """While a job is suspended each tick reads every /proc/*/stat, about 12 us a process: a user
    with a suspended job and 100k processes made every tick take a second on the loop. The scan is
    held here for 3 s, and the daemon must answer meanwhile (audit)."""
    import threading

    from gpusched.daemon import engine_recovery

    real = engine_recovery.session_states
    scanning, release = threading.Event(), threading.Event()

    def slow_scan(sessions: Any) -> Any:
        scanning.set()
        release.wait(3)
        return real(sessions)

    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "60"))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="running")
        monkeypatch.setattr(engine_recovery, "session_states", slow_scan)
        c.call(SuspendRequest(job_ids=[job_id]), JobsChanged)
        assert scanning.wait(15), "no scan of the suspended job's session"
        began = time.monotonic()
        assert state_of(c, job_id) is JobState.SUSPENDED  # answered while the scan is held
        took = time.monotonic() - began
        release.set()
        assert took < 1.0, f"the daemon answered after {took:.1f} s: the scan held the loop"
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return ""


# ---- item 14: smaller ones -----------------------------------------------------------------------


def test_a_huge_memory_limit_fails_only_that_job(daemon_factory: Any, tmp_path: Path) -> None:
    """A 4,300-digit mem_mib with cgroups on crashed the pass (int -> str limit); the job ended LOST."""
    root = fake_cgroupfs(tmp_path / "gpusched.service")
    d = daemon_factory(cgroup_root=str(root))
    with d.client() as c:
        # (raw: the client's own model refuses it; the daemon must too, naming the field, and go on)
        reply = c.raw_call({"op": "submit", "spec": {"argv": ["true"], "cwd": "/tmp", "env": {},
                                                     "request": {"kind": "whole", "gpus": 1}, "mem_mib": 10**4299}})
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply
        assert "mem_mib" in reply["error"]["message"], reply
        assert wait_done(c, submit(c, spec("true", mem_mib=64))).job.state is JobState.COMPLETED


def test_mps_control_program_without_exec_bit(daemon_factory: Any, tmp_path: Path) -> None:
    """A pip install dropped simmps.py's exec bit: the share job stayed PENDING forever."""
    from gpusched.gpu import simmps

    copy = tmp_path / "simmps.py"
    shutil.copy(simmps.__file__, copy)
    copy.chmod(0o644)
    d = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="mps")}, mps_control=str(copy))
    share = JobSpec(argv=["true"], cwd="/", request=ShareRequest(fraction=0.5, gpu_mem_mib=1024))
    with d.client() as c:
        assert wait_done(c, c.call(SubmitRequest(spec=share), SubmitResult).job_id).job.state is JobState.COMPLETED


def test_an_mps_control_program_that_cannot_run_fails_the_share(daemon_factory: Any, tmp_path: Path) -> None:
    program = tmp_path / "nvidia-cuda-mps-control"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(stat.S_IRUSR)  # not executable
    d = daemon_factory(sim="H100-80GB:1", gpus={"0": GpuConfig(share="mps")}, mps_control=str(program))
    share = JobSpec(argv=["true"], cwd="/", request=ShareRequest(fraction=0.5, gpu_mem_mib=1024))
    with d.client() as c:
        job = wait_done(c, c.call(SubmitRequest(spec=share), SubmitResult).job_id).job
        assert job.state is JobState.FAILED and "cannot be run" in job.reason, job.reason
