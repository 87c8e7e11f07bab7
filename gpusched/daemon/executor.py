"""Start, signal and collect job processes, each under its own shim (see shim.py).

The executor decides nothing: the engine tells it which job to start with which environment, and
asks it to signal or collect. It owns the job directory layout:

    STATE/jobs/ID/launch.json   what the shim runs (argv, cwd, env, identity, log path)
    STATE/jobs/ID/shim.json     shim and job pids with their kernel start times (for re-adoption)
    STATE/jobs/ID/status.json   exit status, written by the shim when the job ends
    STATE/logs/ID.log           combined stdout and stderr, owned by the job's user

How a shim starts (forked by the fork server, or spawned) is shimstart.py's business; everything
the shim leaves behind, and so everything here after the start, is the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from gpusched.daemon.procfs import lock_holder, session_leaders_under
from gpusched.daemon.shim import LAUNCH, SHIM, STATUS, process_start_time, write_atomic
from gpusched.daemon.shimstart import LostLaunch, Shim, ShimStarter


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


class Record(Enum):
    """How a file the shim writes was found."""

    ABSENT = "absent"
    TORN = "torn"  # there, but not the JSON object the shim writes (truncated, corrupt)
    OK = "ok"


@dataclass(frozen=True, slots=True)
class Trace:
    """What a job's directory and /proc say about it, for the restart rules (daemon/recovery.py)."""

    shim: Record  # shim.json: written once the shim has forked the job
    status: Record  # status.json: written once the job has ended
    exit: ExitStatus | None  # the status, when status is OK
    pid: int | None  # the job's pid per shim.json
    locked: bool  # a live shim holds launch.json's lock (locks die with their process: no pid reuse)
    job_alive: bool  # the recorded job pid is the very process the shim forked (start time matches)

    @property
    def alive(self) -> bool:
        return self.locked or self.job_alive


# What inspect finds for a job that has no directory: recovery skips reading 100k of them at start-up.
NEVER_LAUNCHED = Trace(shim=Record.ABSENT, status=Record.ABSENT, exit=None, pid=None, locked=False, job_alive=False)


@dataclass(frozen=True, slots=True)
class Started:
    pid: int
    error: str | None
    timed_out: bool = False


class Executor:
    """Launches shims and reads what they record."""

    def __init__(self, state_dir: str, python: str = sys.executable, launcher: str = "spawn") -> None:
        self.jobs_dir = os.path.join(state_dir, "jobs")
        self.logs_dir = os.path.join(state_dir, "logs")
        os.makedirs(self.jobs_dir, mode=0o700, exist_ok=True)
        os.makedirs(self.logs_dir, mode=0o711, exist_ok=True)
        os.chmod(self.logs_dir, 0o711)  # owners open their own log by name; nobody lists the others
        self.shims = ShimStarter(self.jobs_dir, python, launcher)
        self._shims: dict[int, Shim] = {}

    def highest_job_id(self) -> int:
        """The largest job id with a directory or a log here (0 if none)."""
        highest = 0
        for folder, suffix in ((self.jobs_dir, ""), (self.logs_dir, ".log")):
            with os.scandir(folder) as entries:
                for entry in entries:
                    stem = entry.name[: len(entry.name) - len(suffix)] if entry.name.endswith(suffix) else ""
                    if stem.isdigit() and stem.isascii():
                        highest = max(highest, int(stem))
        return highest

    @property
    def python(self) -> str:
        """The interpreter spawned shims run on (tests point it elsewhere to break spawning)."""
        return self.shims.python

    @python.setter
    def python(self, value: str) -> None:
        self.shims.python = value

    def open(self) -> None:
        """Start the fork server, if configured (call on the running loop, after cgroup setup: it and
        the shims it forks stay in the cgroup the daemon is in now)."""
        self.shims.open()

    def job_dir(self, job_id: int) -> str:
        return os.path.join(self.jobs_dir, str(job_id))

    def log_path(self, job_id: int) -> str:
        return os.path.join(self.logs_dir, f"{job_id}.log")

    async def start(
        self, job_id: int, argv: list[str], cwd: str, env: dict[str, str], who: Identity,
        cgroup: str | None = None, cpuset: tuple[int, ...] = (), *, deadline_s: float = 30.0,
        on_pid: Callable[[int], None] | None = None,
    ) -> Started:
        """Start the shim for a job and return the job's pid (or why it could not start).

        Everything between the shim's fork and the job's exec runs as the job's user, who can stop
        or slow it: the launch has a deadline, and `on_pid` hears the pid as soon as the shim forks,
        so a cancel can reach a child that never gets to exec. Past the deadline the child (or, before
        a fork, the shim) is SIGKILLed and the result says why; the shim still records a status.
        """
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
        # Not fsynced: only shims of this boot read it (a machine crash ends them, and a restarted
        # daemon rewrites or revokes it before any other shim could), and its two fsyncs were on
        # every launch's critical path. shim.json and status.json stay durable.
        write_atomic(os.path.join(job_dir, LAUNCH), launch, durable=False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s  # the fork server's part counts too
        try:
            shim = await self.shims.start(job_dir, deadline_s)
        except LostLaunch:
            self.kill_job(job_id)  # whatever holds the launch now: it never reported as started
            raise
        self._shims[job_id] = shim
        pid = 0
        reader = asyncio.StreamReader(limit=2**20)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(shim.stdout_fd, "rb", 0))
        try:
            async with asyncio.timeout_at(deadline):
                first = await reader.readline()
                if not first:  # left in _shims: wait() reaps it and reports the job FAILED
                    code = await shim.exited
                    status = "" if code is None else f" with status {code}"
                    return Started(pid=0, error=f"job supervisor exited{status} before starting it")
                pid = int(json.loads(first)["pid"])
                if on_pid is not None:
                    on_pid(pid)
                second = await reader.readline()
        except TimeoutError:
            self._kill_launch(shim, pid)
            return Started(pid=pid, error=f"launch did not finish within {deadline_s:g} s (launch_timeout_s)",
                           timed_out=True)
        finally:
            transport.close()
        if not second:
            return Started(pid=pid, error="job supervisor exited before the job started")
        return Started(pid=pid, error=json.loads(second).get("error"))

    def _kill_launch(self, shim: Shim, pid: int) -> None:
        """A launch past its deadline: kill the job's child if the shim has forked it, else the shim."""
        if not pid:
            if not shim.exited.done():  # else its pidfd is closed, and there is nothing to kill
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(shim.pidfd, signal.SIGKILL)
            return
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)

    def _create_log(self, job_id: int, who: Identity) -> str:
        """Create the log as the job's owner in a directory only root writes: no symlink tricks."""
        path = self.log_path(job_id)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except BlockingIOError:
            # A process of the job's last run holds a lease on it, which a plain open would wait
            # out (45 s, with the loop): that run's log stays with that process, this run gets a new one.
            os.unlink(path)
            fd = os.open(path, flags | os.O_EXCL, 0o600)
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
        self.shims.close()

    def collect(self, job_id: int) -> ExitStatus | None:
        """The recorded exit status, if the job has ended (and its record is readable)."""
        record, status = self._read_status(job_id)
        return status if record is Record.OK else None

    def _read_status(self, job_id: int) -> tuple[Record, ExitStatus | None]:
        record, data = _read_record(os.path.join(self.job_dir(job_id), STATUS))
        if data is None:
            return record, None
        try:
            status = ExitStatus(_opt_int(data.get("exit_code")), _opt_int(data.get("signal")),
                                _opt_str(data.get("error")), _opt_float(data.get("ended_at")))
        except (TypeError, ValueError):
            return Record.TORN, None
        return Record.OK, status

    def launched(self) -> set[int]:
        """Jobs that have a directory here (a launch began): one listing instead of a stat per job."""
        return {int(name) for name in os.listdir(self.jobs_dir) if name.isdigit()}

    def inspect(self, job_id: int) -> Trace:
        """Read everything the shim leaves for a job; never raises on what it finds."""
        job_dir = self.job_dir(job_id)
        status_record, status = self._read_status(job_id)
        shim_record, info = _read_record(os.path.join(job_dir, SHIM))
        pid = job_alive = None
        if info is not None:
            try:
                pid = _opt_int(info.get("pid"))
                start = _opt_int(info.get("pid_start"))
            except (TypeError, ValueError):
                shim_record, pid, start = Record.TORN, None, None
            job_alive = bool(pid and pid > 0 and start is not None and process_start_time(pid) == start)
        return Trace(shim=shim_record, status=status_record, exit=status, pid=pid,
                     locked=_lock_held(os.path.join(job_dir, LAUNCH)), job_alive=bool(job_alive))

    def revoke(self, job_id: int) -> bool:
        """Make sure no shim will ever run this launch; False when a shim holds it (it is running).

        Unlinks launch.json under its lock: a shim that opened it earlier sees it gone once it gets
        the lock, and starts nothing (see shim.py).
        """
        path = os.path.join(self.job_dir(job_id), LAUNCH)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        finally:
            os.close(fd)
        return True

    def kill_job(self, job_id: int) -> None:
        """SIGKILL what may be left of a job the daemon gives up on: the job's session and its shim.

        Only processes proven to be this job's are touched: the job pid when its start time matches
        shim.json, and the shim holding launch.json's lock (found in /proc/locks), with the session
        it forked. A recorded pid that now belongs to someone else is left alone.
        """
        trace = self.inspect(job_id)
        victims = {trace.pid} if trace.pid and trace.job_alive else set()
        holder = lock_holder(os.path.join(self.job_dir(job_id), LAUNCH))
        if holder is not None and holder > 1:
            victims.update(session_leaders_under(holder))
        for leader in victims:
            self.signal(leader, signal.SIGKILL)
        if holder is not None and holder > 1:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(holder, signal.SIGKILL)

    def signal(self, pid: int, sig: signal.Signals) -> bool:
        """Signal the job's whole process group (the job is a session leader). False if it is gone."""
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
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


def _read_record(path: str) -> tuple[Record, dict[str, Any] | None]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return Record.ABSENT, None
    except (OSError, ValueError):  # unreadable, truncated, not UTF-8, not JSON
        return Record.TORN, None
    return (Record.OK, data) if isinstance(data, dict) else (Record.TORN, None)


def _lock_held(path: str) -> bool:
    """Does a (live) shim hold this launch file's lock?"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops our own shared lock, if we got it
    return False


def _opt_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"not an integer: {value!r}")
    return int(value)


def _opt_float(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"not a number: {value!r}")
    return float(value)


def _opt_str(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"not a string: {value!r}")

