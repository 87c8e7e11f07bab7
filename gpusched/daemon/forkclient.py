"""The daemon's side of the fork server (forkserver.py): start it, ask it for shims, notice its death.

The fork server keeps one shim forked ahead, the spare, and hands us its channel as soon as it is
forked (a notice on our channel): a launch gives the spare its job directly (`take_spare`), with no
request and reply through the fork server on its path, and asks for a shim only when it has no spare.
One request is in flight at a time (each takes well under a millisecond), so a reply is matched by
its id and nothing queues behind a lost one. The fork server is our child: we watch it through a
pidfd and reap it. When it dies, or does not answer within `reply_timeout_s` (it is then killed),
the launch in progress learns whether its request may have reached it (`ForkServerError.sent`),
and the next launch starts a new one. A fork server that dies before answering anything is not
restarted at once: starts back off (1 s, 2 s, ... up to a minute) and launches spawn meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gpusched.daemon import forkserver

log = logging.getLogger("gpusched.forkserver")

REPLY_TIMEOUT_S = 5.0  # the fork server's part runs no user code: only a hung or starved server is this slow
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0


class ForkServerError(Exception):
    """No shim from the fork server. `sent`: the request may have reached it, so a shim may exist."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


@dataclass(frozen=True, slots=True)
class Forked:
    pid: int
    pidfd: int  # ours to close; the shim is the fork server's child, not ours


@dataclass(eq=False)
class Spare:
    """The fork server's spare shim, waiting for a job on `channel` (ours to close, with the pidfd)."""

    pid: int
    pidfd: int
    channel: socket.socket

    def close(self) -> None:
        os.close(self.pidfd)
        self.channel.close()


@dataclass(eq=False)
class _Proc:
    """One fork server process."""

    pid: int
    pidfd: int
    channel: socket.socket | None  # None once we stopped talking to it
    answered: bool = False  # has it ever forked a shim for us (a healthy server that later died restarts at once)
    exited: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class ForkServer:
    """Starts and talks to the fork server; used from the daemon's event loop only."""

    def __init__(self, python: str, jobs_dir: str, env: dict[str, str],
                 reply_timeout_s: float = REPLY_TIMEOUT_S) -> None:
        self.python = python
        self.jobs_dir = os.path.abspath(jobs_dir)
        self.env = env
        self.reply_timeout_s = reply_timeout_s
        self.program = forkserver.__file__  # what `python -I` runs (tests substitute a faulty server)
        self.starts = 0  # fork servers started, for `doctor`-style reporting and tests
        self._proc: _Proc | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0
        self._pending: tuple[int, asyncio.Future[tuple[dict[str, Any], list[int]]]] | None = None
        self._spare: Spare | None = None  # the current fork server's spare, once it noticed us of it
        self._failures = 0  # consecutive fork servers that died before answering
        self._retry_at = 0.0  # monotonic time before which no new fork server is started

    @property
    def pid(self) -> int | None:
        """The current fork server's pid (None when there is none)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> int:
        """Spawn a fork server now (must be called on the running loop). Raises OSError."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # posix_spawn's dup2 of a descriptor onto itself would keep its close-on-exec flag.
            child_fd = theirs.fileno() if theirs.fileno() > 2 else os.dup(theirs.fileno())
            try:
                pid = os.posix_spawn(
                    self.python, [self.python, "-I", self.program, self.jobs_dir], self.env,
                    file_actions=[(os.POSIX_SPAWN_DUP2, child_fd, forkserver.CHANNEL_FD),
                                  (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)],
                    setsid=True,  # no terminal's signals, and not in the daemon's process group
                    setsigmask=(),  # whatever the daemon's loop thread blocks, shims and jobs must not
                )
            finally:
                if child_fd != theirs.fileno():
                    os.close(child_fd)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        proc = _Proc(pid=pid, pidfd=os.pidfd_open(pid), channel=ours)
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.pidfd, self._on_exit, proc)
        loop.add_reader(ours.fileno(), self._on_readable, proc)
        self._proc = proc
        self.starts += 1
        return pid

    async def fork_shim(self, job_dir: str, report_fd: int, timeout_s: float) -> Forked:
        """A shim for `job_dir` whose stdout is `report_fd` (a pipe's write end; we keep our copy)."""
        job_dir = os.path.abspath(job_dir)  # the fork server's cwd is /, and it wants JOBS_DIR/ID exactly
        async with self._lock:
            proc = self._ensure_started()
            assert proc.channel is not None
            self._next_id += 1
            request_id = self._next_id
            reply: asyncio.Future[tuple[dict[str, Any], list[int]]] = asyncio.get_running_loop().create_future()
            self._pending = (request_id, reply)
            try:
                try:
                    forkserver.send(proc.channel, {"id": request_id, "job_dir": job_dir}, [report_fd])
                except OSError as exc:  # EPIPE / ECONNRESET: it is gone, and never saw the request
                    self._lose(proc, f"could not be asked: {exc.strerror or exc}", failed=not proc.answered)
                    raise ForkServerError(f"the fork server is gone: {exc.strerror or exc}", sent=False) from None
                try:
                    async with asyncio.timeout(min(timeout_s, self.reply_timeout_s)):
                        message, fds = await reply
                except TimeoutError:
                    self._lose(proc, f"did not answer within {min(timeout_s, self.reply_timeout_s):g} s; killed",
                               failed=True, kill=True)
                    raise ForkServerError("the fork server did not answer", sent=True) from None
            finally:
                self._pending = None
        pid = message.get("pid")
        if isinstance(pid, int) and pid > 0 and len(fds) == 1:
            proc.answered = True
            self._failures = 0
            return Forked(pid=pid, pidfd=fds[0])
        for fd in fds:
            os.close(fd)
        if isinstance(pid, int):  # forked, but the pidfd did not come with it: a shim exists
            raise ForkServerError(f"the fork server forked shim {pid} but sent no pidfd", sent=True)
        raise ForkServerError(f"the fork server refused: {message.get('error')}", sent=False)

    def waiting_spare(self) -> int | None:
        """The pid of the spare waiting for our next launch (None: none, or no notice of one yet).
        Notices still unread on the channel are read first: a spare forked a moment ago counts. A
        spare that died waiting is only found out when its channel refuses the job (EPIPE)."""
        if self._proc is not None:
            self._on_readable(self._proc)
        return self._spare.pid if self._spare is not None else None

    def take_spare(self) -> Spare | None:
        """The spare, now ours to give a job (see waiting_spare); None when there is none."""
        self.waiting_spare()
        spare, self._spare = self._spare, None
        return spare

    def _hold_spare(self, message: dict[str, Any], fds: list[int]) -> None:
        pid = message.get("spare")
        if not isinstance(pid, int) or pid <= 0 or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            return
        if self._spare is not None:  # (the server forks one only after the last one's end): let it go
            self._spare.close()
        channel = socket.socket(fileno=fds[1])
        channel.setblocking(False)
        self._spare = Spare(pid=pid, pidfd=fds[0], channel=channel)

    def _drop_spare(self) -> None:
        if self._spare is not None:
            self._spare.close()
            self._spare = None

    def _ensure_started(self) -> _Proc:
        if self._proc is not None:
            return self._proc
        if time.monotonic() < self._retry_at:
            raise ForkServerError("the fork server is restarting after a failure", sent=False)
        try:
            pid = self.start()
        except OSError as exc:
            self._note_failure()
            log.warning("cannot start the fork server (%s); spawning shims for %g s", exc,
                        self._retry_at - time.monotonic())
            raise ForkServerError(f"cannot start the fork server: {exc}", sent=False) from None
        if self.starts > 1:
            log.warning("started a new fork server (pid %d)", pid)
        assert self._proc is not None
        return self._proc

    def _note_failure(self) -> None:
        self._failures += 1
        self._retry_at = time.monotonic() + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._failures - 1))

    def _on_readable(self, proc: _Proc) -> None:
        """Replies (or EOF) on the channel; a reply nobody waits for any more is dropped."""
        while proc.channel is not None:
            try:
                data, fds = forkserver.receive(proc.channel)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._lose(proc, "closed its channel", failed=not proc.answered)
                return
            try:
                message = json.loads(data)
            except ValueError:
                message = {}
            if isinstance(message, dict) and "spare" in message:
                proc.answered = True  # (a server that forks spares is a healthy one, as one that answers)
                self._hold_spare(message, fds)
                continue
            pending = self._pending
            if pending is not None and isinstance(message, dict) and message.get("id") == pending[0] \
                    and not pending[1].done():
                pending[1].set_result((message, fds))
                continue
            for fd in fds:
                os.close(fd)

    def _on_exit(self, proc: _Proc) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.pidfd)
        os.close(proc.pidfd)
        try:
            _, status = os.waitpid(proc.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = -1
        if not proc.exited.done():
            proc.exited.set_result(code)
        self._lose(proc, f"exited with status {code}", failed=not proc.answered)

    def _lose(self, proc: _Proc, why: str, *, failed: bool, kill: bool = False) -> None:
        """Stop using `proc`: fail the launch waiting on it, and let the next launch start another."""
        if kill and not proc.exited.done():
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(proc.pidfd, signal.SIGKILL)
        if proc.channel is not None:
            asyncio.get_running_loop().remove_reader(proc.channel.fileno())
            proc.channel.close()
            proc.channel = None
            if self._proc is proc:
                self._drop_spare()  # (its server gone, it sees its channel close once we let go)
                self._proc = None
                if failed:
                    self._note_failure()
                log.warning("fork server (pid %d) %s; the next launch starts a new one", proc.pid, why)
        if self._pending is not None and not self._pending[1].done():
            self._pending[1].set_exception(ForkServerError(f"the fork server {why}", sent=True))

    def close(self) -> None:
        """Stop talking to the fork server (daemon shutdown): it forks no more, reaps its shims, and
        exits once they have; they and their jobs keep running."""
        proc, self._proc = self._proc, None
        self._drop_spare()  # it exits once its fork server, which stops serving, lets go too
        if proc is None:
            return
        loop = asyncio.get_running_loop()
        if proc.channel is not None:
            loop.remove_reader(proc.channel.fileno())
            proc.channel.close()
            proc.channel = None
        if not proc.exited.done():
            loop.remove_reader(proc.pidfd)
            os.close(proc.pidfd)
            proc.exited.cancel()
            # It is still our child: reap it whenever it exits (a daemon restarted in-process, as
            # the tests do, would otherwise collect zombies; a daemon that exits leaves it to PID 1).
            threading.Thread(target=_reap, args=(proc.pid,), name="gpusched-forkserver-reaper", daemon=True).start()


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)

