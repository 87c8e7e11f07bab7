"""Start, signal and collect job processes, each under its own shim (see shim.py).

The executor decides nothing: the engine tells it which job to start with which environment, and
asks it to signal or collect. It owns the job directory layout:

    STATE/jobs/ID/launch.json   what the shim runs (argv, cwd, env, identity, log path)
    STATE/jobs/ID/shim.json     shim and job pids with their kernel start times (for re-adoption)
    STATE/jobs/ID/status.json   exit status, written by the shim when the job ends
    STATE/logs/ID.log           combined stdout and stderr, owned by the job's user
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from gpusched.daemon.shim import LAUNCH, SHIM, STATUS, process_start_time, write_atomic


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a job runs as. `drop` is set when the daemon is root and must switch to the user."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    drop: bool


@dataclass(frozen=True, slots=True)
class ExitStatus:
    exit_code: int | None
    signal: int | None
    error: str | None  # set when the job never started (bad executable, bad cwd, ...)
    ended_at: float | None


@dataclass(frozen=True, slots=True)
class _Shim:
    pid: int
    stdout_fd: int
    exited: asyncio.Future[int]  # the shim's exit code
    pidfd: int


@dataclass(frozen=True, slots=True)
class Started:
    pid: int
    error: str | None


class Executor:
    """Launches shims and reads what they record."""

    def __init__(self, state_dir: str, python: str = sys.executable) -> None:
        self.jobs_dir = os.path.join(state_dir, "jobs")
        self.logs_dir = os.path.join(state_dir, "logs")
        os.makedirs(self.jobs_dir, mode=0o700, exist_ok=True)
        os.makedirs(self.logs_dir, mode=0o711, exist_ok=True)
        os.chmod(self.logs_dir, 0o711)  # owners open their own log by name; nobody lists the others
        self.python = python
        self._shims: dict[int, _Shim] = {}

    def job_dir(self, job_id: int) -> str:
        return os.path.join(self.jobs_dir, str(job_id))

    def log_path(self, job_id: int) -> str:
        return os.path.join(self.logs_dir, f"{job_id}.log")

    async def start(
        self, job_id: int, argv: list[str], cwd: str, env: dict[str, str], who: Identity,
        cgroup: str | None = None, cpuset: tuple[int, ...] = (),
    ) -> Started:
        """Spawn the shim for a job and return the job's pid (or why it could not start)."""
        job_dir = self.job_dir(job_id)
        os.makedirs(job_dir, mode=0o700, exist_ok=True)
        for stale in (SHIM, STATUS):  # a requeued job starts afresh
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(job_dir, stale))
        log_path = self._create_log(job_id, who)
        launch: dict[str, Any] = {
            "argv": argv, "cwd": cwd, "env": env, "log_path": log_path,
            "uid": who.uid, "gid": who.gid, "groups": list(who.groups), "drop_privileges": who.drop,
            "cgroup": cgroup, "cpuset": list(cpuset),
        }
        write_atomic(os.path.join(job_dir, LAUNCH), launch)
        shim = await self._spawn_shim(job_dir)
        self._shims[job_id] = shim
        line = await asyncio.get_running_loop().run_in_executor(None, _read_line_and_close, shim.stdout_fd)
        if not line:
            await shim.exited
            self._shims.pop(job_id, None)
            return Started(pid=0, error=f"job supervisor exited with status {shim.exited.result()} before starting it")
        report = json.loads(line)
        return Started(pid=int(report["pid"]), error=report.get("error"))

    async def _spawn_shim(self, job_dir: str) -> _Shim:
        """posix_spawn the shim in a new session, and watch its exit through a pidfd.

        Not asyncio's subprocess machinery: its transports kill the child when they are closed or
        collected, and a shim must outlive the daemon. A pidfd needs no SIGCHLD handler and works
        on any loop (uvloop included) and in any thread.
        """
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.posix_spawn(
                self.python, [self.python, "-m", "gpusched.daemon.shim", job_dir], _shim_env(),
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_DUP2, write_fd, 1)],
                setsid=True,
            )
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()
        pidfd = os.pidfd_open(pid)

        def on_exit() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(pid, 0)
            if not exited.done():
                exited.set_result(os.waitstatus_to_exitcode(status))

        loop.add_reader(pidfd, on_exit)
        return _Shim(pid=pid, stdout_fd=read_fd, exited=exited, pidfd=pidfd)

    def _create_log(self, job_id: int, who: Identity) -> str:
        """Create the log as the job's owner in a directory only root writes: no symlink tricks."""
        path = self.log_path(job_id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            if who.drop:
                os.fchown(fd, who.uid, who.gid)
        finally:
            os.close(fd)
        return path

    async def wait(self, job_id: int) -> ExitStatus | None:
        """Wait for a shim this daemon started; None if it is not ours (re-adopted jobs are polled)."""
        shim = self._shims.get(job_id)
        if shim is None:
            return None
        await shim.exited
        self._shims.pop(job_id, None)
        return self.collect(job_id) or ExitStatus(None, None, "job supervisor died without recording a status", None)

    def detach(self) -> None:
        """Stop watching our shims (daemon shutdown); they and their jobs keep running."""
        loop = asyncio.get_running_loop()
        for shim in self._shims.values():
            if not shim.exited.done():
                loop.remove_reader(shim.pidfd)
                os.close(shim.pidfd)
                shim.exited.cancel()
        self._shims.clear()

    def collect(self, job_id: int) -> ExitStatus | None:
        """The recorded exit status, if the job has ended."""
        try:
            with open(os.path.join(self.job_dir(job_id), STATUS)) as f:
                data = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return ExitStatus(data.get("exit_code"), data.get("signal"), data.get("error"), data.get("ended_at"))

    def adopted_pid(self, job_id: int) -> int | None:
        """The job's pid as its shim recorded it (for a job the daemon lost track of while starting)."""
        try:
            with open(os.path.join(self.job_dir(job_id), SHIM)) as f:
                pid = json.load(f).get("pid")
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return int(pid) if pid else None

    def is_alive(self, job_id: int) -> bool:
        """Is the job's shim (or, failing that, the job) still the process we started?"""
        try:
            with open(os.path.join(self.job_dir(job_id), SHIM)) as f:
                info = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        for pid_key, start_key in (("shim_pid", "shim_start"), ("pid", "pid_start")):
            pid, start = info.get(pid_key), info.get(start_key)
            if pid and start is not None and process_start_time(int(pid)) == start:
                return True
        return False

    def signal(self, pid: int, sig: signal.Signals) -> bool:
        """Signal the job's whole process group (the job is a session leader). False if it is gone."""
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def owns(self, job_id: int) -> bool:
        return job_id in self._shims


def kill_recorded_jobs(state_dir: str) -> None:
    """SIGKILL the process group of every job whose shim recorded a pid under `state_dir`.

    Jobs deliberately outlive the daemon; tests and benchmarks that start throw-away daemons use
    this to leave nothing behind.
    """
    jobs_dir = os.path.join(state_dir, "jobs")
    if not os.path.isdir(jobs_dir):
        return
    for name in os.listdir(jobs_dir):
        try:
            with open(os.path.join(jobs_dir, name, SHIM)) as f:
                pid = int(json.load(f)["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _read_line_and_close(fd: int) -> bytes:
    """The shim's one report line (blocking; run in a thread). Empty if it died first."""
    with os.fdopen(fd, "rb") as pipe:
        return pipe.readline()


def _shim_env() -> dict[str, str]:
    """The shim needs to import gpusched; nothing of the daemon's environment reaches the job."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env
