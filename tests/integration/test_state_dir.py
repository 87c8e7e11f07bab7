"""The state directory: one daemon at a time, clear refusals, and what a crash or a restored backup
must not do to it (found by the durability audit; each test failed on the code before its fix)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from gpusched.daemon import store as store_module
from gpusched.daemon.standing import save_scheduler_state
from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    LogsRequest,
    LogsResult,
    ShowRequest,
    ShowResult,
    SubmitRequest,
    SubmitResult,
)
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, DaemonProcess, short_tmpdir, wait_until

CRASHPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crashpoint.py")


def spec(*argv: str, **fields: Any) -> JobSpec:
    return JobSpec(argv=list(argv), cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1),
                   **fields)


def gpuschedd(config: str, sim: str, socket: str, state_dir: str) -> list[str]:
    return [sys.executable, "-m", "gpusched.daemon.main", "--config", config, "--sim", sim, "--socket", socket,
            "--state-dir", state_dir]


@dataclass
class CrashingDaemon(DaemonProcess):
    """The real program, SIGKILLed just before it commits a running job's move to `crash_at`."""

    crash_at: str = ""

    def program(self) -> list[str]:
        return [sys.executable, CRASHPOINT] if self.crash_at else super().program()

    def environment(self) -> dict[str, str] | None:
        return {**os.environ, "CRASH_AT": self.crash_at} if self.crash_at else None

    def killed_at_its_crash_point(self) -> bool:
        assert self.proc is not None
        try:
            return self.proc.wait(20) == -9
        except subprocess.TimeoutExpired:
            return False


def show(socket: str, job_id: int) -> ShowResult:
    with Client(socket) as c:
        return c.call(ShowRequest(job_id=job_id), ShowResult)


def test_a_second_daemon_on_the_same_state_dir_refuses_to_start(daemon_process: Callable[..., DaemonProcess]) -> None:
    """Only the socket was checked: a second daemon with another --socket ran a second scheduler
    on the same database, and put two jobs on one GPU."""
    first = daemon_process().start()
    other_socket = os.path.join(os.path.dirname(first.socket), "other.sock")
    out = subprocess.run(gpuschedd(first.config_path, first.sim, other_socket, first.state_dir),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert f"another gpuschedd (pid {first.proc.pid if first.proc else '?'}) is using the state directory" \
           in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not os.path.exists(other_socket)
    with Client(first.socket) as c:  # the first one is unharmed
        job = c.call(SubmitRequest(spec=spec("true")), SubmitResult).job_id
        wait_until(lambda: c.call(ShowRequest(job_id=job), ShowResult).job.state is JobState.COMPLETED,
                   what="a job on the first daemon")
    first.kill9()  # the kernel drops the lock with the process: the next start takes it
    first.start()


def test_a_damaged_database_is_refused_with_a_message_not_a_traceback(tmp_path: Any) -> None:
    base = short_tmpdir()
    try:
        state = os.path.join(base, "state")
        os.makedirs(state)
        with open(os.path.join(state, "gpusched.db"), "wb") as f:
            f.write(b"this is not a database" * 400)
        config = os.path.join(base, "g.toml")
        with open(config, "w") as f:
            f.write('allow_root_jobs = true\ncgroup_root = "off"\n')
        out = subprocess.run(gpuschedd(config, "H100-80GB:1", os.path.join(base, "g.sock"), state),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        assert "Traceback" not in out.stderr, out.stderr[-800:]
        assert "cannot open the state database" in out.stderr and "restore it from a backup" in out.stderr

        blocked = os.path.join(base, "file")
        open(blocked, "w").close()  # a state "directory" that is a file
        out = subprocess.run(gpuschedd(config, "H100-80GB:1", os.path.join(base, "h.sock"), blocked),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        assert "Traceback" not in out.stderr, out.stderr[-800:]
        assert f"state directory {blocked}:" in out.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize(("crash_at", "final"), [("CANCELLED", JobState.CANCELLED), ("TIMEOUT", JobState.TIMEOUT)])
def test_a_crash_as_a_stopped_job_ends_keeps_why_it_was_stopped(
    daemon_process: Callable[..., DaemonProcess], crash_at: str, final: JobState,
) -> None:
    """The stop request was erased (and committed) before the end was: a kill -9 in between left a
    job dead with no reason, and the restart ended an acknowledged cancel, or a time limit, FAILED."""
    d = daemon_process(cls=CrashingDaemon)
    assert isinstance(d, CrashingDaemon)
    d.crash_at = crash_at
    d.start()
    with Client(d.socket) as c:
        job = c.call(SubmitRequest(spec=spec("sleep", "300", time_limit_s=2 if final is JobState.TIMEOUT else None)),
                     SubmitResult).job_id
        if final is JobState.CANCELLED:
            wait_until(lambda: c.call(ShowRequest(job_id=job), ShowResult).job.state is JobState.RUNNING,
                       what="the job to run")
            assert c.call(CancelRequest(job_ids=[job]), CancelResult).cancelled == [job]
    assert d.killed_at_its_crash_point(), d.log()
    d.crash_at = ""
    d.start()
    ended = show(d.socket, job).job
    assert ended.state is final, (ended.state, ended.reason)


def test_a_start_that_could_not_be_recorded_is_tried_again(daemon: DaemonHandle,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler had taken the job off its queue; the failed write (a full disk) ended the pass,
    and the job waited PENDING for ever beside an idle GPU. Saving the standing failed first too."""
    real_transition = store_module.Store.transition
    failures = {"STARTING": 2}

    def full_disk(self: store_module.Store, job: Any, new: JobState, **kwargs: Any) -> Any:
        if failures.get(new.value, 0) > 0:
            failures[new.value] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        return real_transition(self, job, new, **kwargs)

    standing_failures = [1]

    def standing_full_disk(*args: Any, **kwargs: Any) -> None:
        if standing_failures[0] > 0:
            standing_failures[0] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        save_scheduler_state(*args, **kwargs)

    monkeypatch.setattr(store_module.Store, "transition", full_disk)
    monkeypatch.setattr("gpusched.daemon.engine.save_scheduler_state", standing_full_disk)
    with daemon.client() as c:
        job = c.call(SubmitRequest(spec=spec("true")), SubmitResult).job_id
        wait_until(lambda: c.call(ShowRequest(job_id=job), ShowResult).job.state is JobState.COMPLETED,
                   timeout=15, what="the job to run once its start could be recorded")
    assert failures["STARTING"] == 0 and standing_failures == [0]


def test_after_a_restored_backup_new_jobs_do_not_take_a_forgotten_jobs_id_or_log(daemon: DaemonHandle) -> None:
    """admin-guide's restore (replace gpusched.db, remove -wal and -shm) handed out again the ids of
    the jobs run since the backup, and with them their logs: another user read the old output."""
    db = os.path.join(daemon.state_dir, "gpusched.db")

    def run(text: str) -> int:
        with daemon.client() as c:
            job_id = c.call(SubmitRequest(spec=spec("sh", "-c", f"echo {text}")), SubmitResult).job_id
            wait_until(lambda: c.call(ShowRequest(job_id=job_id), ShowResult).job.state is JobState.COMPLETED,
                       what=f"job {job_id}")
        return job_id

    run("before-the-backup")
    backup = os.path.join(os.path.dirname(daemon.socket), "backup.db")
    src, dst = sqlite3.connect(db), sqlite3.connect(backup)  # what `sqlite3 DB ".backup FILE"` does
    src.backup(dst)
    src.close()
    dst.close()
    forgotten = run("SECRET")
    daemon.stop()
    shutil.copy(backup, db)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.unlink(db + suffix)
    daemon.daemon = None
    daemon.start()
    new = run("mine")
    assert new > forgotten
    with daemon.client() as c:
        assert c.call(LogsRequest(job_id=new), LogsResult).data == "mine\n"


def test_a_change_whose_commit_failed_is_not_applied_anyway(daemon: DaemonHandle,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`release` and `cancel` answered an internal error when the COMMIT failed (a full disk), yet
    the daemon went on as if they had happened: it listed the held job PENDING and dropped the other
    from the queue, while the store (and any restart) still had both HELD."""
    from gpusched.protocol import QueueRequest, QueueResult, ReleaseRequest

    real_commit, real_transition = store_module.Store._commit, store_module.Store.transition
    fail = [0]
    changing = [False]  # only the COMMIT of a transaction that changed a job's state fails (not the loop's own)

    def transition(self: store_module.Store, *args: Any, **kwargs: Any) -> Any:
        changing[0] = True
        return real_transition(self, *args, **kwargs)

    def commit(self: store_module.Store) -> None:
        if fail[0] > 0 and changing[0]:
            fail[0] -= 1
            changing[0] = False
            self._db.execute("ROLLBACK")  # as _commit does when COMMIT fails
            raise sqlite3.OperationalError("database or disk is full")
        changing[0] = False
        real_commit(self)

    monkeypatch.setattr(store_module.Store, "transition", transition)
    monkeypatch.setattr(store_module.Store, "_commit", commit)
    with daemon.client() as c:
        held = c.call(SubmitRequest(spec=spec("true"), hold=True), SubmitResult).job_id
        other = c.call(SubmitRequest(spec=spec("true"), hold=True), SubmitResult).job_id
        for request in (ReleaseRequest(job_ids=[held]), CancelRequest(job_ids=[other])):
            fail[0] = 1
            reply = c.raw_call(request.model_dump(mode="json"))
            assert reply["ok"] is False and reply["error"]["code"] == "internal", reply
        states = {r.id: r.state for r in c.call(QueueRequest(all=True), QueueResult).jobs}
        assert states == {held: JobState.HELD, other: JobState.HELD}, states
        # with room again, both go through, and the released one runs
        assert c.raw_call(ReleaseRequest(job_ids=[held]).model_dump(mode="json"))["ok"]
        assert c.call(CancelRequest(job_ids=[other]), CancelResult).cancelled == [other]
        wait_until(lambda: c.call(ShowRequest(job_id=held), ShowResult).job.state is JobState.COMPLETED,
                   what="the released job to run")


def test_an_end_that_could_not_be_recorded_is_recorded_once_it_can(daemon: DaemonHandle,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that ended while its end could not be written (a full disk) was dropped: `queue` lost
    it, `show` said RUNNING for ever, and nothing tried again once there was room."""
    from gpusched.protocol import QueueRequest, QueueResult

    real_transition = store_module.Store.transition
    refused = [2]  # the reaper's try and the next tick's: the one after must record how it really ended

    def full_disk(self: store_module.Store, job: Any, new: JobState, **kwargs: Any) -> Any:
        if new in (JobState.COMPLETED, JobState.FAILED, JobState.LOST) and refused[0] > 0:
            refused[0] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        return real_transition(self, job, new, **kwargs)

    monkeypatch.setattr(store_module.Store, "transition", full_disk)
    with daemon.client() as c:
        job = c.call(SubmitRequest(spec=spec("true")), SubmitResult).job_id
        wait_until(lambda: refused[0] == 0 or c.call(ShowRequest(job_id=job), ShowResult).job.state
                   is JobState.COMPLETED, what="the job's end to be refused")
        ended = wait_until(lambda: (j := c.call(ShowRequest(job_id=job), ShowResult).job).state
                           in (JobState.COMPLETED, JobState.FAILED, JobState.LOST) and j, timeout=15,
                           what="its end to be recorded once it could be")
        assert ended.state is JobState.COMPLETED and ended.exit_code == 0, (ended.state, ended.reason)
        assert job in {r.id for r in c.call(QueueRequest(all=True), QueueResult).jobs}
