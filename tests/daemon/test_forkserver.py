"""The fork server: shims forked from a warm process keep every guarantee of a spawned shim.

Real processes throughout: the real fork server program, real shims, real jobs. Where a test needs
the fork server to fail at a precise moment it runs a small substitute server program that does
the real server's work up to that moment and then dies (see `_faulty_server`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusched.daemon import forkserver, shim
from gpusched.daemon.executor import Executor, ExitStatus, Identity, Started
from gpusched.daemon.forkclient import ForkServerError
from tests.conftest import kill_job_processes, wait_until

ME = Identity(os.getuid(), os.getgid(), (), drop=False)


# ---- helpers -----------------------------------------------------------------------------------


def _stat(pid: int) -> dict[str, Any] | None:
    """state, ppid and session of a process (None once it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return {"ppid": int(fields[1]), "session": int(fields[3])}


def _alive(pid: int) -> bool:
    return _stat(pid) is not None


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _record(job_dir: str) -> dict[str, Any]:
    path = os.path.join(job_dir, shim.SHIM)
    wait_until(lambda: os.path.exists(path), what=f"{path}")
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def _waits_for(go: str, code: int = 0) -> list[str]:
    """A job that runs until the test creates `go` (the job polls; the test never sleeps), then exits `code`."""
    return ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done; exit {code}"]


def _forked_by_server(shim_pid: int) -> bool:
    """A forked shim's command line is its fork server's (fork copies it); a spawned one names shim.py."""
    argv = _cmdline(shim_pid)
    return any(a.endswith("forkserver.py") for a in argv) and not any(a.endswith("shim.py") for a in argv)


@pytest.fixture
def state_dir() -> Iterator[str]:
    base = tempfile.mkdtemp(prefix="gsf-", dir="/tmp")
    yield os.path.join(base, "state")
    kill_job_processes(os.path.join(base, "state"))
    shutil.rmtree(base, ignore_errors=True)


def _run(executor_test: Callable[[Executor], Any], state_dir: str, **kwargs: Any) -> Any:
    """Run an async test body against a fork-server executor on a fresh loop, closing it after."""

    async def main() -> Any:
        executor = Executor(state_dir, launcher="forkserver")
        executor.open()
        try:
            return await executor_test(executor, **kwargs)
        finally:
            executor.detach()

    return asyncio.run(main())


async def _finish(executor: Executor, job_id: int, go: str) -> ExitStatus | None:
    Path(go).touch()
    return await asyncio.wait_for(executor.wait(job_id), 30)


def _faulty_server(tmp_path: Path, mode: str) -> str:
    """A fork server that takes one request and then dies: `before_fork`, `after_fork` (the real
    shim forked, no reply), or `reply_without_pidfd` (forked, and the reply lacks the pidfd, as when
    the real one is out of descriptors)."""
    script = tmp_path / "faulty_forkserver.py"
    script.write_text(f"""
import importlib.util, json, os, socket
spec = importlib.util.spec_from_file_location("forkserver", {forkserver.__file__!r})
forkserver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(forkserver)
channel = socket.socket(fileno=0)
data, fds = forkserver.receive(channel)
request = json.loads(data)
if {mode!r} != "before_fork":
    pid = os.fork()
    if pid == 0:
        forkserver._become_shim(forkserver.load_shim(), request["job_dir"], fds[0])
    if {mode!r} == "reply_without_pidfd":
        channel.send(json.dumps({{"id": request["id"], "pid": pid}}).encode())
os._exit(9)
""")
    return str(script)


# ---- the executor with a fork server -------------------------------------------------------------


def test_a_forked_shim_runs_the_job_in_its_own_session_and_records_its_status(state_dir: str) -> None:
    go = os.path.join(os.path.dirname(state_dir), "go")

    async def body(executor: Executor) -> None:
        server = _server(executor)
        started = await executor.start(1, _waits_for(go, 4), "/", {"PATH": "/usr/bin:/bin"}, ME)
        assert started.error is None and started.pid > 0
        record = _record(executor.job_dir(1))
        shim_pid = record["shim_pid"]
        # Forked by the fork server (its child, its command line), not an interpreter of its own.
        assert _forked_by_server(shim_pid) and _comm(shim_pid) == "gpusched-shim"
        assert _stat(shim_pid) == {"ppid": server, "session": shim_pid}  # its own session, like a spawned one
        assert _stat(started.pid) == {"ppid": shim_pid, "session": started.pid}  # the job leads its own
        assert executor.inspect(1).locked  # the shim holds the launch, as restart recovery expects
        status = await _finish(executor, 1, go)
        assert status is not None and (status.exit_code, status.signal, status.error) == (4, None, None)
        assert not executor.inspect(1).locked
        wait_until(lambda: not _alive(shim_pid), what="the shim to exit and be reaped by its fork server")

    _run(body, state_dir)


def test_a_job_that_cannot_start_is_reported_as_with_a_spawned_shim(state_dir: str) -> None:
    async def body(executor: Executor) -> tuple[Started, ExitStatus | None]:
        started = await executor.start(1, ["/no/such/program"], "/", {"PATH": "/usr/bin:/bin"}, ME)
        return started, await asyncio.wait_for(executor.wait(1), 30)

    started, status = _run(body, state_dir)
    assert started.error is not None and "/no/such/program" in started.error
    assert status is not None and status.exit_code is None and status.error == started.error


def test_a_revoked_launch_is_not_run_by_a_forked_shim(state_dir: str) -> None:
    marker = os.path.join(os.path.dirname(state_dir), "ran")

    async def body(executor: Executor) -> None:
        job_dir = executor.job_dir(1)
        os.makedirs(job_dir)
        launch = {"argv": ["sh", "-c", f"echo ran > {marker}"], "cwd": "/", "env": {}, "uid": ME.uid,
                  "gid": ME.gid, "groups": [], "drop_privileges": False, "log_path": executor.log_path(1)}
        shim.write_atomic(os.path.join(job_dir, shim.LAUNCH), launch)
        assert executor.revoke(1)
        forks = executor.shims.forks
        assert forks is not None
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            forked = await forks.fork_shim(job_dir, write_fd, 10)
            os.close(write_fd)
            write_fd = -1
            assert os.read(read_fd, 100) == b""  # it reported nothing and exited
            os.close(forked.pidfd)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        assert not os.path.exists(marker) and not os.path.exists(os.path.join(job_dir, shim.SHIM))

    _run(body, state_dir)


def test_the_fork_server_refuses_a_directory_outside_the_jobs_dir(state_dir: str) -> None:
    async def body(executor: Executor) -> None:
        forks = executor.shims.forks
        assert forks is not None
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            with pytest.raises(ForkServerError, match="job_dir") as err:
                await forks.fork_shim("/etc", write_fd, 10)
            assert not err.value.sent
            with pytest.raises(ForkServerError, match="not a job directory"):
                await forks.fork_shim(os.path.join(executor.jobs_dir, "..", "x"), write_fd, 10)
        finally:
            os.close(read_fd)
            os.close(write_fd)
        assert forks.pid is not None and _alive(forks.pid)  # refusing is not dying
        assert forkserver.job_dir_error(executor.jobs_dir, executor.job_dir(7)) is None

    _run(body, state_dir)


def test_the_spare_refuses_a_directory_outside_the_jobs_dir(state_dir: str) -> None:
    """The spare checks what the daemon hands it as the fork server checks a request: no launch."""
    planted = os.path.join(os.path.dirname(state_dir), "planted")
    os.makedirs(planted)
    shim.write_atomic(os.path.join(planted, shim.LAUNCH), {
        "argv": ["true"], "cwd": "/", "env": {}, "uid": ME.uid, "gid": ME.gid, "groups": [],
        "drop_privileges": False, "log_path": os.path.join(planted, "log")})

    async def body(executor: Executor) -> None:
        forks = executor.shims.forks
        assert forks is not None
        spare_pid = _held_spare(executor)
        spare = forks.take_spare()
        assert spare is not None and spare.pid == spare_pid
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            forkserver.send(spare.channel, {"job_dir": planted}, [write_fd])
            os.close(write_fd)
            write_fd = -1
            assert os.read(read_fd, 100) == b""  # it reported nothing and exited
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
            spare.close()
        wait_until(lambda: not _alive(spare_pid), what="the spare to exit")
        assert not os.path.exists(os.path.join(planted, shim.SHIM))

    _run(body, state_dir)


@pytest.mark.parametrize("mode", ["after_fork", "reply_without_pidfd"])
def test_a_fork_server_lost_after_forking_leaves_the_shim_it_forked_in_charge(state_dir: str, tmp_path: Path,
                                                                            mode: str) -> None:
    """No second shim: the launch belongs to the one forked before the fork server died."""
    go = os.path.join(os.path.dirname(state_dir), "go")

    async def body(executor: Executor) -> None:
        forks = executor.shims.forks
        assert forks is not None
        forks.close()  # the real one; the next launch starts the faulty one
        forks.program = _faulty_server(tmp_path, mode)
        started = await executor.start(1, _waits_for(go, 6), "/", {"PATH": "/usr/bin:/bin"}, ME)
        assert started.error is None
        shim_pid = _record(executor.job_dir(1))["shim_pid"]
        assert _forked_by_server(shim_pid)
        status = await _finish(executor, 1, go)
        assert status is not None and status.exit_code == 6

    _run(body, state_dir)


def test_a_fork_server_lost_before_forking_means_a_spawned_shim(state_dir: str, tmp_path: Path) -> None:
    go = os.path.join(os.path.dirname(state_dir), "go")

    async def body(executor: Executor) -> None:
        forks = executor.shims.forks
        assert forks is not None
        forks.close()
        forks.program = _faulty_server(tmp_path, "before_fork")
        started = await executor.start(1, _waits_for(go, 0), "/", {"PATH": "/usr/bin:/bin"}, ME)
        assert started.error is None
        shim_pid = _record(executor.job_dir(1))["shim_pid"]
        assert any(a.endswith("shim.py") for a in _cmdline(shim_pid))  # the interpreter, as with launcher=spawn
        status = await _finish(executor, 1, go)
        assert status is not None and status.exit_code == 0

    _run(body, state_dir)


def test_a_fork_server_that_stops_answering_is_killed_and_the_job_spawned(state_dir: str) -> None:
    go = os.path.join(os.path.dirname(state_dir), "go")

    async def body(executor: Executor) -> None:
        forks = executor.shims.forks
        assert forks is not None and forks.pid is not None
        stuck = forks.pid
        spare = _held_spare(executor)
        os.kill(stuck, signal.SIGSTOP)
        os.kill(spare, signal.SIGKILL)  # the launch cannot go to the spare: it asks the stopped server
        wait_until(lambda: not _alive(spare), what="the killed spare to exit")
        forks.reply_timeout_s = 0.2
        started = await executor.start(1, _waits_for(go, 0), "/", {"PATH": "/usr/bin:/bin"}, ME)
        assert started.error is None
        assert any(a.endswith("shim.py") for a in _cmdline(_record(executor.job_dir(1))["shim_pid"]))
        assert not _alive(stuck) and forks.pid is None  # killed; a later launch starts another
        assert (await _finish(executor, 1, go)) is not None

    _run(body, state_dir)


def test_a_fork_server_that_cannot_start_means_spawned_shims(state_dir: str) -> None:
    async def body(executor: Executor) -> None:
        forks = executor.shims.forks
        assert forks is not None
        forks.close()
        forks.python = "/nonexistent/python"
        started = await executor.start(1, ["true"], "/", {"PATH": "/usr/bin:/bin"}, ME)
        assert started.error is None
        status = await asyncio.wait_for(executor.wait(1), 30)
        assert status is not None and status.exit_code == 0
        with pytest.raises(ForkServerError, match="restarting after a failure"):  # backing off, not retrying
            await forks.fork_shim(executor.job_dir(2), 0, 10)

    _run(body, state_dir)


# ---- the spare shim ------------------------------------------------------------------------------


def _spares(server: int) -> list[int]:
    """The fork server's children that are waiting spares (`gpusched-spare`)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat["ppid"] == server:
                try:
                    if _comm(int(name)) == "gpusched-spare":
                        found.append(int(name))
                except OSError:
                    continue
    return found


def _server(executor: Executor) -> int:
    """The pid of the executor's fork server (started by `executor.open()`)."""
    assert executor.shims.forks is not None and executor.shims.forks.pid is not None
    return executor.shims.forks.pid


def _one_spare(server: int) -> int:
    spares: list[int] = wait_until(lambda: _spares(server), what="a spare shim")
    assert len(spares) == 1, spares
    return spares[0]


def _held_spare(executor: Executor) -> int:
    """The one spare, once the daemon's side holds it (its notice read): the next launch's shim."""
    forks = executor.shims.forks
    assert forks is not None
    spare = _one_spare(_server(executor))
    wait_until(lambda: forks.waiting_spare() == spare, what=f"the daemon to hold spare {spare}")
    return spare


def test_the_spare_waits_prepared_and_takes_the_next_launch(state_dir: str) -> None:
    """The shim forked ahead: its own session, nothing open but 0-2 and its socketpair, a
    subreaper, no ignored signal but SIGPIPE; a launch is handed to it, and the next spare is
    forked once that launch is over."""
    go = os.path.join(os.path.dirname(state_dir), "go")

    async def body(executor: Executor) -> None:
        server = _server(executor)
        spare = _held_spare(executor)
        assert _stat(spare) == {"ppid": server, "session": spare}
        fds = sorted(int(fd) for fd in os.listdir(f"/proc/{spare}/fd"))
        assert fds[:3] == [0, 1, 2] and len(fds) == 4
        assert os.readlink(f"/proc/{spare}/fd/{fds[3]}").startswith("socket:")
        with open(f"/proc/{spare}/status") as f:
            status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        mask = int(status["SigIgn"], 16)
        ignored = {n for n in range(1, 65) if mask >> (n - 1) & 1}
        assert ignored - {32, 33} == {signal.SIGPIPE}  # (glibc's own two cannot be changed from Python)
        started = await executor.start(1, _waits_for(go, 5), "/", {"PATH": "/usr/bin:/bin"}, ME)
        assert started.error is None
        assert _record(executor.job_dir(1))["shim_pid"] == spare and _comm(spare) == "gpusched-shim"
        assert _stat(started.pid) == {"ppid": spare, "session": started.pid}
        assert _one_spare(server) != spare  # the next one, once this launch is over
        status_ = await _finish(executor, 1, go)
        assert status_ is not None and status_.exit_code == 5

    _run(body, state_dir)


def test_a_killed_spare_costs_nothing_but_its_speed(state_dir: str, tmp_path: Path) -> None:
    """The daemon holds a spare that died: its channel refuses the job, and the launch asks the
    fork server (whose idle delay is an hour here, so no other spare can take the launch)."""
    go = os.path.join(os.path.dirname(state_dir), "go")

    async def body(executor: Executor) -> None:
        _restart_without_idle_refill(executor, tmp_path)
        spare = _held_spare(executor)
        os.kill(spare, signal.SIGKILL)
        wait_until(lambda: not _alive(spare), what="the killed spare to be reaped")
        started = await executor.start(1, _waits_for(go, 0), "/", {"PATH": "/usr/bin:/bin"}, ME)
        assert started.error is None
        shim_pid = _record(executor.job_dir(1))["shim_pid"]
        assert shim_pid != spare and _forked_by_server(shim_pid)  # forked on request, as before spares
        assert executor.shims.forks.waiting_spare() is None and _spares(_server(executor)) == []
        status = await _finish(executor, 1, go)
        assert status is not None and status.exit_code == 0

    _run(body, state_dir)


def test_a_spare_that_dies_waiting_is_replaced_once_the_server_is_idle(state_dir: str) -> None:
    """Not at once (a spare that keeps dying must not make the server fork in a loop), and not never."""

    async def body(executor: Executor) -> None:
        server = _server(executor)
        for _ in range(2):
            spare = _held_spare(executor)
            os.kill(spare, signal.SIGKILL)
            wait_until(lambda killed=spare: not _alive(killed), what="the killed spare to be reaped")
            assert _one_spare(server) != spare

    _run(body, state_dir)


def test_a_fork_server_that_only_forked_spares_is_a_healthy_one_when_it_dies(state_dir: str) -> None:
    """It never answered a request (the daemon gave its spare the launch), but it did its work: its
    death is not a failed start, so the next launch starts a new one at once, with no back-off."""
    go = os.path.join(os.path.dirname(state_dir), "go")

    async def body(executor: Executor) -> None:
        forks = executor.shims.forks
        assert forks is not None
        first = _server(executor)
        _held_spare(executor)
        started = await executor.start(1, _waits_for(go, 0), "/", {"PATH": "/usr/bin:/bin"}, ME)
        assert started.error is None
        os.kill(first, signal.SIGKILL)
        while forks.pid == first:  # (the loop hears of its death through its pidfd)
            await asyncio.sleep(0.01)
        started = await executor.start(2, _waits_for(go, 0), "/", {"PATH": "/usr/bin:/bin"}, ME)
        assert started.error is None and forks.starts == 2
        assert _forked_by_server(_record(executor.job_dir(2))["shim_pid"])  # not spawned while backing off
        for job_id in (1, 2):
            assert (await _finish(executor, job_id, go)) is not None

    _run(body, state_dir)


def test_the_spare_ends_when_the_daemon_goes(state_dir: str) -> None:
    async def body(executor: Executor) -> tuple[int, int]:
        server = _server(executor)
        return server, _one_spare(server)

    server, spare = _run(body, state_dir)  # (the executor is detached at the end: the channel closes)
    wait_until(lambda: not _alive(spare) and not _alive(server), what="the spare, then its fork server, to exit")


def _restart_without_idle_refill(executor: Executor, tmp_path: Path) -> None:
    """The executor's fork server replaced by one whose idle delay is an hour (below)."""
    assert executor.shims.forks is not None
    executor.shims.forks.close()
    executor.shims.forks.program = _server_without_idle_refill(tmp_path)
    executor.shims.forks.start()


def _server_without_idle_refill(tmp_path: Path) -> str:
    """The real fork server with its idle delay an hour long: a spare it forks comes from a launch."""
    script = tmp_path / "patient_forkserver.py"
    script.write_text(f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("forkserver", {forkserver.__file__!r})
forkserver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(forkserver)
forkserver.REFILL_DELAY_S = 3600.0
sys.exit(forkserver.main(sys.argv))
""")
    return str(script)


def test_the_next_spare_is_forked_once_the_spares_job_has_execd_and_the_job_never_has_its_socketpair(
        state_dir: str, tmp_path: Path) -> None:
    """One job after another: the idle delay never passed between them, so no launch but the first
    found a spare. The spare keeps its socketpair until its job has exec'd; its end of file has the
    server fork the next one at once (here the idle delay is an hour)."""
    go = os.path.join(os.path.dirname(state_dir), "go")

    async def body(executor: Executor) -> None:
        _restart_without_idle_refill(executor, tmp_path)
        server = _server(executor)
        for job_id in (1, 2, 3):
            spare = _held_spare(executor)
            started = await executor.start(job_id, _waits_for(go, 0), "/", {"PATH": "/usr/bin:/bin"}, ME)
            assert started.error is None and _record(executor.job_dir(job_id))["shim_pid"] == spare
            job_fds = [os.readlink(f"/proc/{started.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{started.pid}/fd")]
            assert not [target for target in job_fds if target.startswith("socket:")], job_fds
            assert _one_spare(server) != spare
        Path(go).touch()
        for job_id in (1, 2, 3):
            status = await asyncio.wait_for(executor.wait(job_id), 30)
            assert status is not None and status.exit_code == 0

    _run(body, state_dir)
