"""Starting a job's shim: forked by the fork server (forkserver.py), or spawned as a fresh interpreter.

Both give the executor the same thing: the shim's pid, the read end of the pipe it reports on (job
pid, then "exec'd"), and a future for its exit watched through a pidfd (no SIGCHLD handler; any
loop, uvloop included). A spawned shim is our child and we reap it (its exit code is known); a
forked one is the fork server's child, which reaps it (its exit code is then None here: what
matters, the job's status, is in status.json either way).

With `launcher = "forkserver"` a launch that cannot get a shim from the fork server spawns one, so a
dead or broken fork server costs speed, never a job. The one subtle case is a fork server lost
after our request may have reached it: a shim may exist. Whatever it forked holds the write end of
the report pipe until it has reported, and nothing else does once the fork server is gone, so the
pipe decides: data means that shim runs the launch (we watch it, verified by its recorded start
time); end-of-file means no shim ever will, and we spawn one.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import json
import logging
import os
import sys
import termios
from dataclasses import dataclass

from gpusched.daemon import forkserver
from gpusched.daemon import shim as shim_module
from gpusched.daemon.forkclient import ForkServer, ForkServerError, Spare
from gpusched.daemon.shim import SHIM, process_start_time

log = logging.getLogger("gpusched.executor")

LAUNCHERS = ("forkserver", "spawn")


class LostLaunch(Exception):
    """The fork server was lost mid-launch and its shim cannot be accounted for; kill what holds the launch."""


@dataclass(frozen=True, slots=True)
class Shim:
    pid: int
    stdout_fd: int  # the read end of its report pipe; the caller closes it
    exited: asyncio.Future[int | None]  # its exit code; None when the fork server is its parent
    pidfd: int  # closed by the exit watcher
    forked: bool  # by the fork server (else spawned)


class ShimStarter:
    """Owns the fork server (if any) and starts shims; used on the daemon's event loop only."""

    def __init__(self, jobs_dir: str, python: str = sys.executable, launcher: str = "spawn") -> None:
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher: {launcher!r} is not one of {', '.join(LAUNCHERS)}")
        self.python = python
        self.forks = ForkServer(python, jobs_dir, shim_env()) if launcher == "forkserver" else None

    def open(self) -> None:
        """Start the fork server now, so the first job does not wait for it (on the running loop)."""
        if self.forks is None:
            return
        try:
            self.forks.start()
        except OSError as exc:
            log.warning("cannot start the fork server (%s); launches spawn shims until one starts", exc)

    def close(self) -> None:
        if self.forks is not None:
            self.forks.close()

    async def start(self, job_dir: str, deadline_s: float) -> Shim:
        """A running shim for the launch in `job_dir`. Raises OSError (spawn failed) or LostLaunch."""
        if self.forks is None:
            return self.spawn(job_dir)
        spare = self.forks.take_spare()
        if spare is not None and (shim := self._hand_to_spare(spare, job_dir)) is not None:
            return shim
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            try:
                forked = await self.forks.fork_shim(job_dir, write_fd, deadline_s)
            finally:
                os.close(write_fd)
        except ForkServerError as exc:
            try:
                shim = await self._after_lost_request(job_dir, read_fd, deadline_s) if exc.sent else None
            except BaseException:
                os.close(read_fd)
                raise
            if shim is not None:
                return shim
            os.close(read_fd)
            log.info("%s: spawning its shim instead: %s", job_dir, exc)
            return self.spawn(job_dir)
        except BaseException:
            os.close(read_fd)
            raise
        return self._watch(forked.pid, read_fd, forked.pidfd, forked=True)

    def _hand_to_spare(self, spare: Spare, job_dir: str) -> Shim | None:
        """Give the fork server's spare this launch: its job directory and the write end of its report
        pipe, in one message on its own channel. None if it cannot take it (it died waiting: EPIPE);
        once sent, the spare has it, as a forked shim has its request, and the report pipe tells the
        rest (a spare that dies before reporting closes it: the launch fails, as a shim's that died)."""
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            forkserver.send(spare.channel, {"job_dir": os.path.abspath(job_dir)}, [write_fd])
        except OSError as exc:
            os.close(read_fd)
            spare.close()
            log.info("%s: the spare shim is gone (%s); asking the fork server", job_dir, exc.strerror or exc)
            return None
        finally:
            os.close(write_fd)
        spare.channel.close()  # (the pidfd is the watch's now)
        return self._watch(spare.pid, read_fd, spare.pidfd, forked=True)

    def spawn(self, job_dir: str) -> Shim:
        """posix_spawn the shim in a new session.

        Not asyncio's subprocess machinery: its transports kill the child when they are closed or
        collected, and a shim must outlive the daemon.
        """
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.posix_spawn(
                # -I: isolated, so no directory a user can write (the daemon's cwd, PYTHONPATH, user
                # site) is on the root shim's sys.path; the shim is a stdlib-only script.
                self.python, [self.python, "-I", shim_module.__file__, job_dir], shim_env(),
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_DUP2, write_fd, 1)],
                setsid=True,
            )
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return self._watch(pid, read_fd, os.pidfd_open(pid), forked=False)

    def _watch(self, pid: int, stdout_fd: int, pidfd: int, *, forked: bool) -> Shim:
        """Resolve `exited` when the shim exits (reaping it when it is our child)."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int | None] = loop.create_future()

        def on_exit() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            code = None
            if not forked:
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
            if not exited.done():
                exited.set_result(code)

        loop.add_reader(pidfd, on_exit)
        return Shim(pid=pid, stdout_fd=stdout_fd, exited=exited, pidfd=pidfd, forked=forked)

    async def _after_lost_request(self, job_dir: str, read_fd: int, deadline_s: float) -> Shim | None:
        """The fork server failed (died, hung, or sent no pidfd) and may have forked a shim for us:
        the report pipe says (see above)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(read_fd, lambda: None if ready.done() else ready.set_result(None))
        try:
            async with asyncio.timeout(deadline_s):
                await ready
        except TimeoutError:
            raise LostLaunch(f"the fork server failed mid-launch and its shim did not report within "
                             f"{deadline_s:g} s") from None
        finally:
            loop.remove_reader(read_fd)
        if _unread_bytes(read_fd) == 0:  # readable with nothing to read: end of file, no shim
            return None
        recorded = _recorded_shim(os.path.join(job_dir, SHIM))  # written before the shim reports
        if recorded is not None:
            pid, start = recorded
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                pidfd = -1
            if pidfd >= 0:
                if process_start_time(pid) == start:  # the very shim, not a reused pid
                    log.warning("%s: the fork server failed mid-launch; watching the shim it forked (pid %d)",
                                job_dir, pid)
                    return self._watch(pid, read_fd, pidfd, forked=True)
                os.close(pidfd)
        raise LostLaunch("the fork server failed mid-launch and the shim it forked cannot be identified")


def _unread_bytes(fd: int) -> int:
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count, True)
    return count[0]


def _recorded_shim(path: str) -> tuple[int, int] | None:
    """(shim pid, its start time) from shim.json, or None when that is not readable."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
        pid, start = data["shim_pid"], data["shim_start"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (pid, start) if isinstance(pid, int) and isinstance(start, int) else None


def shim_env() -> dict[str, str]:
    """The shim imports only the standard library; nothing of the daemon's environment reaches the job
    (but GPUSCHED_EXECJOB=0, which has shims fork a Python child instead of gpusched-execjob)."""
    env = {"PATH": "/usr/bin:/bin"}
    if os.environ.get(shim_module.EXECJOB_ENV) == "0":
        env[shim_module.EXECJOB_ENV] = "0"
    return env
