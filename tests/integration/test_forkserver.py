"""The daemon with a fork server: jobs start through it, it holds nothing of the daemon, its death and
the daemon's restart (in-process and kill -9 of the real program) cost no job.

The executor-level cases (a fork server lost before or after forking, hung, or unable to start)
are in tests/daemon/test_forkserver.py, whose helpers these reuse.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from gpusched.config import ConfigError, load_config
from gpusched.daemon import forkserver
from gpusched.daemon.forkclient import ForkServer
from gpusched.model import JobState
from gpusched.protocol import ReloadRequest, ReloadResult
from gpusched_cli.client import Client
from tests.conftest import DaemonHandle, DaemonProcess, wait_until
from tests.daemon.test_forkserver import _alive, _cmdline, _forked_by_server, _record, _stat, _waits_for
from tests.integration.test_daemon import spec, state_of, submit, wait_done


def test_the_fork_server_holds_nothing_of_the_daemon(daemon: DaemonHandle) -> None:
    forks = daemon.call_in_loop(lambda: daemon.daemon.engine.executor.shims.forks)  # type: ignore[union-attr]
    assert forks is not None and forks.pid is not None
    pid = forks.pid
    assert _cmdline(pid)[1:3] == ["-I", forkserver.__file__]  # isolated: no user-writable sys.path
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "600"))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="job running")  # so it is past its setup
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        assert _stat(pid)["session"] == pid  # type: ignore[index]
        fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        assert fds[0].startswith("socket:") and fds[1] == os.devnull
        # Beyond stdin/out/err only the pidfds of its shims and the socketpairs it made for its
        # spares: not the database, and no socket of the daemon's (it runs in this process) but
        # the spare's channel, which the fork server handed it.
        spare_fd = daemon.call_in_loop(lambda: forks._spare.channel.fileno() if forks._spare else None)
        ours = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):  # (the listing's own descriptor, closed by now)
                if int(fd) != spare_fd:
                    ours.add(os.readlink(f"/proc/self/fd/{fd}"))
        beyond = [target for fd, target in fds.items() if fd > 2]
        assert all(t == "anon_inode:[pidfd]" or (t.startswith("socket:") and t not in ours) for t in beyond), fds
        # the job's shim, and the next spare, forked once that job had exec'd (with its socketpair)
        assert beyond.count("anon_inode:[pidfd]") in (1, 2)


# ---- the daemon with a fork server -------------------------------------------------------------


def _shim_of(state_dir: str, job_id: int) -> int:
    return int(_record(os.path.join(state_dir, "jobs", str(job_id)))["shim_pid"])


def _forks(d: DaemonHandle) -> ForkServer:
    forks = d.call_in_loop(lambda: d.daemon.engine.executor.shims.forks)  # type: ignore[union-attr]
    assert forks is not None
    return forks


def test_jobs_start_through_the_fork_server(daemon: DaemonHandle) -> None:
    server = _forks(daemon).pid
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "600"))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="job running")
        shim_pid = _shim_of(daemon.state_dir, job_id)
        assert _forked_by_server(shim_pid) and _stat(shim_pid)["ppid"] == server  # type: ignore[index]


def test_with_launcher_spawn_each_shim_is_an_interpreter(daemon_factory: Callable[..., DaemonHandle]) -> None:
    d = daemon_factory(launcher="spawn")
    assert d.call_in_loop(lambda: d.daemon.engine.executor.shims.forks) is None  # type: ignore[union-attr]
    with d.client() as c:
        job_id = submit(c, spec("sleep", "600"))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="job running")
        assert any(a.endswith("shim.py") for a in _cmdline(_shim_of(d.state_dir, job_id)))


def test_killing_the_fork_server_keeps_running_jobs_and_the_next_job_starts(daemon: DaemonHandle) -> None:
    go = os.path.join(os.path.dirname(daemon.state_dir), "go")
    old = _forks(daemon).pid
    assert old is not None
    with daemon.client() as c:
        running = submit(c, spec(*_waits_for(go, 5)))
        wait_until(lambda: state_of(c, running) is JobState.RUNNING, what="job running")
        shim_pid = _shim_of(daemon.state_dir, running)
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: _forks(daemon).pid is None, what="the daemon to notice its fork server died")
        assert _alive(shim_pid) and state_of(c, running) is JobState.RUNNING
        after = submit(c, spec("sleep", "600"))
        wait_until(lambda: state_of(c, after) is JobState.RUNNING, what="the next job running")
        new = _forks(daemon).pid
        assert new is not None and new != old  # a new fork server, started for this launch
        assert _forked_by_server(_shim_of(daemon.state_dir, after))
        Path(go).touch()
        job = wait_done(c, running).job  # its exit reached the daemon though its fork server is gone
        assert (job.state, job.exit_code) == (JobState.FAILED, 5)


def test_a_forked_job_survives_a_daemon_restart_and_is_readopted(daemon: DaemonHandle) -> None:
    go = os.path.join(os.path.dirname(daemon.state_dir), "go")
    old = _forks(daemon).pid
    with daemon.client() as c:
        job_id = submit(c, spec(*_waits_for(go, 3)))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="job running")
    shim_pid = _shim_of(daemon.state_dir, job_id)
    daemon.restart()
    new = _forks(daemon).pid
    assert new is not None and new != old
    assert _alive(shim_pid) and _stat(shim_pid)["ppid"] == old  # type: ignore[index]  # still reaped by the old one
    # Re-adopted: this daemon did not start it, so it watches it by the restart rules, from its files.
    assert not daemon.call_in_loop(lambda: daemon.daemon.engine.executor.owns(job_id))  # type: ignore[union-attr]
    with daemon.client() as c:
        assert state_of(c, job_id) is JobState.RUNNING
        Path(go).touch()
        job = wait_done(c, job_id).job
        assert (job.state, job.exit_code) == (JobState.FAILED, 3)
    assert old is not None
    wait_until(lambda: not _alive(old), what="the old fork server to exit once its last shim has")


def test_kill_9_of_the_daemon_leaves_forked_jobs_to_the_next_one(daemon_process: Callable[..., DaemonProcess],
                                                                tmp_path: Path) -> None:
    proc = daemon_process()
    proc.start()
    go = str(tmp_path / "go")
    with Client(proc.socket) as c:
        job_id = submit(c, spec(*_waits_for(go, 7)))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="job running")
    shim_pid = _shim_of(proc.state_dir, job_id)
    old = _stat(shim_pid)["ppid"]  # type: ignore[index]
    assert any(a.endswith("forkserver.py") for a in _cmdline(old))
    proc.kill9()
    assert _alive(shim_pid)
    proc.start()
    with Client(proc.socket) as c:
        assert state_of(c, job_id) is JobState.RUNNING
        Path(go).touch()
        job = wait_done(c, job_id).job
        assert (job.state, job.exit_code) == (JobState.FAILED, 7)
        assert wait_done(c, submit(c, spec("true"))).job.state is JobState.COMPLETED
    wait_until(lambda: not _alive(old), what="the dead daemon's fork server to exit after its last shim")
    assert proc.terminate() == 0


def test_the_launcher_is_chosen_at_start_and_a_bad_one_is_named(daemon_process: Callable[..., DaemonProcess],
                                                                tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('launcher = "vfork"\n')
    with pytest.raises(ConfigError, match="launcher"):
        load_config(str(bad), {"socket": "/tmp/x.sock", "state_dir": "/tmp/x"})
    proc = daemon_process().start()
    proc.write_config('launcher = "spawn"\n')
    with Client(proc.socket) as c:
        assert c.call(ReloadRequest(), ReloadResult).restart_needed == ["launcher"]  # a process started with it
        job_id = submit(c, spec("sleep", "600"))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="job running")
        assert _forked_by_server(_shim_of(proc.state_dir, job_id))  # still the fork server until a restart
    assert proc.terminate() == 0
