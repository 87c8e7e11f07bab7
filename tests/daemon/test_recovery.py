"""The restart rules, exhaustively: every job state x shim record x status record x process.

One store holds a job for every combination; each has a real job directory (shim.json and
status.json absent, torn or whole) and real processes behind it:

- alive: a real shim (holding its launch lock) running a real `sleep` job;
- dead: the recorded pids belonged to processes that have exited and been reaped;
- zombie: the recorded pid is an exited, unreaped process;
- reused: the recorded pid is a live process that is not the job (its start time differs).

Ended jobs are never re-read (the store is their record), so their rows only check that.

Then the real engine starts on that state, as a restarted daemon would, and every job must end
where docs/architecture.md ("Recovery rules") says, by legal transitions, with a reason; nothing it
ended may leave a process running, and a process that merely reuses a recorded pid is never killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpusched.config import DaemonConfig
from gpusched.core.scheduler import Scheduler
from gpusched.daemon import shim
from gpusched.daemon.engine import Engine
from gpusched.daemon.executor import NEVER_LAUNCHED, Executor, ExitStatus, Record, kill_recorded_jobs
from gpusched.daemon.main import scheduler_config
from gpusched.daemon.procfs import lock_holder
from gpusched.daemon.recovery import StopRequest, Verdict, decide, outcome, path_to
from gpusched.daemon.store import Store
from gpusched.gpu.nvml import open_backend
from gpusched.model import TERMINAL_STATES, TRANSITIONS, JobSpec, JobState, WholeRequest

STATES = list(JobState)
RECORDS = ["absent", "torn", "ok"]
PROCESSES = ["alive", "dead", "zombie", "reused"]
CASES = list(itertools.product(STATES, RECORDS, RECORDS, PROCESSES))

# A legal path from PENDING to each state (how a job gets there).
PATHS: dict[JobState, list[JobState]] = {
    JobState.PENDING: [],
    JobState.HELD: [JobState.HELD],
    JobState.STARTING: [JobState.STARTING],
    JobState.RUNNING: [JobState.STARTING, JobState.RUNNING],
    JobState.SUSPENDED: [JobState.STARTING, JobState.RUNNING, JobState.SUSPENDED],
    JobState.PREEMPTED: [JobState.STARTING, JobState.RUNNING, JobState.PREEMPTED],
    JobState.COMPLETED: [JobState.STARTING, JobState.RUNNING, JobState.COMPLETED],
    JobState.FAILED: [JobState.FAILED],
    JobState.CANCELLED: [JobState.CANCELLED],
    JobState.TIMEOUT: [JobState.STARTING, JobState.RUNNING, JobState.TIMEOUT],
    JobState.LOST: [JobState.STARTING, JobState.RUNNING, JobState.LOST],
}


def expected(state: JobState, shim_record: str, status: str, process: str) -> JobState:
    """The rule table of docs/architecture.md, written out independently of daemon/recovery.py."""
    if state in TERMINAL_STATES or state in (JobState.PENDING, JobState.HELD):
        return state  # ended jobs are never re-read; waiting jobs stay waiting
    if state is JobState.PREEMPTED:
        return JobState.PENDING
    if status == "ok":
        return JobState.COMPLETED  # the recorded status is exit code 0
    if status == "torn":
        return JobState.LOST
    if process == "alive":
        if shim_record == "ok":
            return JobState.RUNNING if state is JobState.STARTING else state  # re-adopted
        return JobState.STARTING if state is JobState.STARTING else JobState.LOST  # launch in progress
    if state is JobState.STARTING and shim_record == "absent":
        return JobState.PENDING  # never launched: requeued
    return JobState.LOST


@dataclass
class Case:
    job_id: int
    shim_pid: int | None = None  # a real shim (alive cases)
    job_pid: int | None = None


@dataclass
class World:
    state_dir: str
    cases: dict[tuple[JobState, str, str, str], Case] = field(default_factory=dict)
    final: dict[int, tuple[JobState, str, list[JobState]]] = field(default_factory=dict)
    reused_pid: int = 0
    error: BaseException | None = None


def _start_time(pid: int) -> int:
    value = shim.process_start_time(pid)
    assert value is not None
    return value


def _write(path: str, record: str, data: dict[str, object]) -> None:
    if record == "absent":
        if os.path.exists(path):
            os.unlink(path)
    elif record == "torn":
        with open(path, "w") as f:
            f.write(json.dumps(data)[: len(json.dumps(data)) // 2])  # a half-written file
    else:
        with open(path, "w") as f:
            json.dump(data, f)


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    base = tempfile.mkdtemp(prefix="gs-rec-", dir="/tmp")
    w = World(state_dir=os.path.join(base, "state"))
    config = DaemonConfig(socket=os.path.join(base, "g.sock"), state_dir=w.state_dir, sim="H100-80GB:1",
                          cgroup_root="off", allow_root_jobs=True)
    os.makedirs(w.state_dir)
    store = Store(config.db_path)
    executor = Executor(w.state_dir)
    spec = JobSpec(argv=["sleep", "600"], cwd="/", env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1))
    helpers: list[subprocess.Popen[bytes]] = []

    # Shared stand-ins: a reaped pid, an unreaped zombie, and a live process that is not the job.
    gone = subprocess.Popen(["sleep", "0"])
    gone_start = _start_time(gone.pid) if shim.process_start_time(gone.pid) else 1
    gone.wait()
    zombie = subprocess.Popen(["sleep", "0.05"])
    helpers.append(zombie)
    zombie_start = _start_time(zombie.pid)
    _wait(lambda: shim.process_start_time(zombie.pid) is None, "the zombie to exit")
    reused = subprocess.Popen(["sleep", "600"], start_new_session=True)
    helpers.append(reused)
    w.reused_pid = reused.pid
    stand_in = {"dead": (gone.pid, gone_start), "zombie": (zombie.pid, zombie_start),
                "reused": (reused.pid, _start_time(reused.pid) + 1)}
    try:
        for state, shim_record, status, process in CASES:
            now = time.time()
            job = store.submit(uid=0, gid=0, user="root", spec=spec, now=now)
            for step in PATHS[state]:
                job = store.transition(job, step, now=now, reason=f"test: {step}")
            case = Case(job.id)
            job_dir = executor.job_dir(job.id)
            os.makedirs(job_dir)
            launch = {"argv": spec.argv, "cwd": "/", "env": spec.env, "log_path": executor.log_path(job.id),
                      "uid": 0, "gid": 0, "groups": [], "drop_privileges": False, "cgroup": None, "cpuset": []}
            with open(os.path.join(job_dir, shim.LAUNCH), "w") as f:
                json.dump(launch, f)
            if process == "alive":
                proc = subprocess.Popen([sys.executable, "-I", shim.__file__, job_dir], stdout=subprocess.DEVNULL,
                                        start_new_session=True)
                helpers.append(proc)
                _wait(lambda d=job_dir: os.path.exists(os.path.join(d, shim.SHIM)), "a shim to fork its job")  # type: ignore[misc]
                with open(os.path.join(job_dir, shim.SHIM)) as f:
                    record = json.load(f)
                case.shim_pid, case.job_pid = proc.pid, record["pid"]
            else:
                pid, start = stand_in[process]
                record = {"shim_pid": pid, "shim_start": start, "pid": pid, "pid_start": start, "started_at": now}
            _write(os.path.join(job_dir, shim.SHIM), shim_record, record)
            _write(os.path.join(job_dir, shim.STATUS), status,
                   {"pid": record["pid"], "exit_code": 0, "signal": None, "error": None, "ended_at": now})
            if state in (JobState.RUNNING, JobState.SUSPENDED):
                store.update(job, pid=record["pid"])
            w.cases[(state, shim_record, status, process)] = case

        async def restart() -> None:
            engine = Engine(config, store, open_backend(config.sim), executor,
                            Scheduler(scheduler_config(config), incremental=True))
            try:
                await engine.start()
                # Read before the loop's first pass can run (it would start the requeued jobs).
                for case in w.cases.values():
                    job = store.get(case.job_id)
                    assert job is not None
                    w.final[case.job_id] = (job.state, job.reason, [t.state for t in job.history])
            except BaseException as exc:
                w.error = exc
            finally:
                await engine.stop()

        asyncio.run(restart())
        yield w
    finally:
        store.close()
        for case in w.cases.values():
            holder = lock_holder(os.path.join(executor.job_dir(case.job_id), shim.LAUNCH))
            for victim in (case.job_pid, case.shim_pid, holder):
                if victim:
                    kill = os.killpg if victim == case.job_pid else os.kill
                    with contextlib.suppress(ProcessLookupError):
                        kill(victim, signal.SIGKILL)
        kill_recorded_jobs(w.state_dir)
        for proc in helpers:
            proc.kill()
            proc.wait()
        shutil.rmtree(base, ignore_errors=True)


def _alive(pid: int | None) -> bool:
    return bool(pid) and shim.process_start_time(pid or 0) is not None


@pytest.mark.parametrize(("state", "shim_record", "status", "process"), CASES,
                         ids=["-".join((s.value, a, b, p)) for s, a, b, p in CASES])
def test_recovery_matrix(world: World, state: JobState, shim_record: str, status: str, process: str) -> None:
    assert world.error is None, f"the daemon did not start: {world.error!r}"
    case = world.cases[(state, shim_record, status, process)]
    final, reason, history = world.final[case.job_id]
    want = expected(state, shim_record, status, process)
    assert final is want, f"job {case.job_id}: {state} -> {final} ({reason!r}), expected {want}"
    for before, after in itertools.pairwise(history):
        assert after in TRANSITIONS[before], f"illegal {before} -> {after} in {history}"
    if final is not state:
        assert reason, "every recovery transition has a reason"
    still_watched = final in (JobState.RUNNING, JobState.SUSPENDED, JobState.STARTING)
    if process == "alive" and not still_watched and state not in TERMINAL_STATES:
        # Ended or requeued: nothing of it may keep running (and holding its devices).
        _wait(lambda: not _alive(case.job_pid) and not _alive(case.shim_pid), f"job {case.job_id}'s processes to die")
    if process == "alive" and still_watched:
        assert _alive(case.job_pid), "a re-adopted job keeps running"
    assert _alive(world.reused_pid), "a process that merely reuses a recorded pid is never killed"


# ---- the pure rules, and the paths they take ----------------------------------------------------


@pytest.mark.parametrize("state", list(JobState))
@pytest.mark.parametrize("final", [*sorted(TERMINAL_STATES), JobState.PREEMPTED])
def test_path_to_is_always_legal(state: JobState, final: JobState) -> None:
    """Whatever the outcome of a status, the steps to record it are legal from any state."""
    if state in TERMINAL_STATES:
        return
    steps = path_to(state, final)
    for before, after in itertools.pairwise([state, *steps]):
        assert after in TRANSITIONS[before]


def test_starting_job_whose_status_says_it_completed_passes_through_running() -> None:
    """Issue #12 item 1: `illegal transition STARTING -> COMPLETED (exit code 0)` aborted the restart."""
    assert path_to(JobState.STARTING, JobState.COMPLETED) == [JobState.RUNNING, JobState.COMPLETED]
    assert path_to(JobState.STARTING, JobState.TIMEOUT) == [JobState.RUNNING, JobState.TIMEOUT]
    status = ExitStatus(exit_code=0, signal=None, error=None, ended_at=1.0)
    assert outcome(status, None) == (JobState.COMPLETED, "exit code 0")
    assert outcome(status, StopRequest(JobState.CANCELLED, "cancelled by alice")) == (JobState.CANCELLED,
                                                                                      "cancelled by alice")


def test_decide_never_adopts_without_a_record_of_the_job() -> None:
    from gpusched.daemon.executor import Trace

    trace = Trace(shim=Record.ABSENT, status=Record.ABSENT, exit=None, pid=None, locked=True, job_alive=False)
    assert decide(JobState.RUNNING, trace).verdict is Verdict.LOST
    assert decide(JobState.RUNNING, trace).kill
    assert decide(JobState.STARTING, trace).verdict is Verdict.KEEP  # its shim is still launching it


# ---- the launch lock -------------------------------------------------------------------------------


def _launch_dir(tmp_path: Path, argv: list[str]) -> tuple[Executor, str]:
    executor = Executor(os.path.join(tmp_path, "state"))
    job_dir = executor.job_dir(1)
    os.makedirs(job_dir)
    launch = {"argv": argv, "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}, "log_path": executor.log_path(1),
              "uid": 0, "gid": 0, "groups": [], "drop_privileges": False, "cgroup": None, "cpuset": []}
    with open(os.path.join(job_dir, shim.LAUNCH), "w") as f:
        json.dump(launch, f)
    return executor, job_dir


def test_a_revoked_launch_never_runs(tmp_path: Path) -> None:
    """Recovery requeues a STARTING job with no shim record only after revoking its launch: a shim
    that starts afterwards (it was spawned just before the kill -9) must run nothing."""
    marker = os.path.join(tmp_path, "ran")
    executor, job_dir = _launch_dir(tmp_path, ["sh", "-c", f"echo ran > {marker}"])
    assert executor.revoke(1)
    proc = subprocess.run([sys.executable, "-I", shim.__file__, job_dir], capture_output=True, timeout=30)
    assert proc.returncode == shim.EXIT_REVOKED
    assert not os.path.exists(marker) and not os.path.exists(os.path.join(job_dir, shim.SHIM))


def test_revoke_refuses_while_a_shim_holds_the_launch(tmp_path: Path) -> None:
    executor, job_dir = _launch_dir(tmp_path, ["sleep", "60"])
    proc = subprocess.Popen([sys.executable, "-I", shim.__file__, job_dir], stdout=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        _wait(lambda: os.path.exists(os.path.join(job_dir, shim.SHIM)), "the shim to fork its job")
        trace = executor.inspect(1)
        assert trace.locked and trace.job_alive and trace.shim is Record.OK and trace.status is Record.ABSENT
        assert not executor.revoke(1)
        assert os.path.exists(os.path.join(job_dir, shim.LAUNCH))
        executor.kill_job(1)
        proc.wait(10)
        _wait(lambda: not _alive(trace.pid), "the job to die with its shim")  # SIGKILL lands asynchronously
    finally:
        proc.kill()
        proc.wait()


def test_a_job_without_a_directory_reads_as_never_launched(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Start-up skips reading jobs that `Executor.launched` does not list; what it assumes for them
    must be exactly what reading them would find."""
    executor = Executor(str(tmp_path))
    os.makedirs(executor.job_dir(7))
    assert executor.launched() == {7}
    assert executor.inspect(8) == NEVER_LAUNCHED
    assert decide(JobState.PENDING, NEVER_LAUNCHED).kill is False
