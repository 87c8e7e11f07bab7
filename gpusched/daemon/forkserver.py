"""The fork server: `python -I .../gpusched/daemon/forkserver.py JOBS_DIR`, one per daemon.

Starting a Python interpreter for every job's shim costs tens of milliseconds; forking one that has
already imported the shim costs well under one. The daemon starts this program once (daemon/
forkclient.py); over a SOCK_SEQPACKET socketpair on its stdin it hears of each spare (below), and
asks for a shim when it has none:

    request  {"id": N, "job_dir": "JOBS_DIR/ID"}   + SCM_RIGHTS: the write end of the shim's report pipe
    reply    {"id": N, "pid": PID}                 + SCM_RIGHTS: a pidfd of the shim
             {"id": N, "error": "why"}
    notice   {"spare": PID}                        + SCM_RIGHTS: a pidfd of the spare, and its channel

The socketpair is inherited, never a path: nobody but the daemon can ask for anything. Even so a
request names only a directory directly under JOBS_DIR; what runs there is what the daemon wrote
in its launch.json, exactly as for a spawned shim.

The fork server never runs user code: the forked child is the shim (shim.run, the same code a
spawned shim runs, loaded from the file next to this one), which forks the job. Each shim is
forked once, straight from here, and calls setsid, so it is a session leader like a spawned one.
The fork server is its parent and reaps it: it watches each shim through a pidfd and waits for
that very pid, so it needs no SIGCHLD handler (and leaves SIGCHLD at its default: SIG_IGN would
be inherited by the shim and make its own wait for the job fail). Why not double-fork: the shim
would be reparented to PID 1 at once, and a PID 1 that does not reap (a container's) would keep
one zombie per job; and why not a subreaper: the job's own orphans would then be reparented here,
and nothing of the job should ever be a child of this process.

One shim is forked ahead and waits for its job: the spare. It has done everything a shim does
before it knows its job (its session, its descriptors, its signals, becoming a subreaper:
shim.prepare) and blocks on a socketpair of its own, whose other end the server hands the daemon
at once (the notice above) and keeps a copy of. The daemon sends the spare its job directory and
report pipe itself: no request and reply through this process on the launch's path (on two
cores each process a launch passes through waits its turn for a CPU; this hop was ~1 ms of an
idle node's ~10 ms from submit to RUNNING). The spare checks the directory as a request's is
checked here, and when its job has exec'd it writes the job's directory on its socketpair and
closes it (close-on-exec: the job never has it): the server's cue to fork the next spare at once.
Not beside the launch in progress: on two cores, forking it then took back what the spare had
saved; and not only once the server had been idle (REFILL_DELAY_S), which left no spare for any
launch of a run of them, one job after another. A spare whose socketpair closes without that
note died waiting (someone killed it): the next one is forked once the server has been idle for
REFILL_DELAY_S, as after a request, which forks its shim then (the daemon had no spare: several
launches at once, or a dead one). A spare shows as `gpusched-spare` until it has a job.

When the daemon goes away (its end of the socketpair closes) the fork server forks no more, ends
its spare (which sees its socketpair close once the daemon's copy is gone too), keeps reaping the
shims it has, and exits once none is left. If it dies first, its shims are reparented
to PID 1 (or the nearest subreaper) as shims of a dead daemon always were; they need no parent,
and a restarted daemon re-adopts them from their files like any other (daemon/recovery.py).

Only the standard library, and run under -I, like the shim: nothing from the environment or any
working directory is on sys.path (a planted `json.py` must not run as root).
"""

from __future__ import annotations

import array
import contextlib
import importlib.util
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any, NoReturn

MAX_REQUEST = 65536
CHANNEL_FD = 0  # the socketpair end the daemon hands us as stdin
SPARE = "(spare)"  # the job directory of the spare shim while it waits
REFILL_DELAY_S = 0.05  # idle this long after a request left no spare before forking one anyway
_SPARE = "spare"  # selector data of the spare's socketpair (readable: its job has exec'd, or it died)


def load_shim() -> ModuleType:
    """shim.py from this file's own directory, by path: -I keeps every directory off sys.path."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim.py")
    spec = importlib.util.spec_from_file_location("gpusched_shim", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the shim from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job_dir_error(jobs_dir: str, job_dir: object) -> str | None:
    """Why a requested directory is refused (None: it is a job directory under jobs_dir)."""
    if not isinstance(job_dir, str) or not job_dir:
        return "job_dir: not a path"
    if os.path.dirname(job_dir) != jobs_dir or not os.path.basename(job_dir).isdigit():
        return f"job_dir: {job_dir!r} is not a job directory under {jobs_dir}"
    return None


def _become_shim(shim: ModuleType, job_dir: str, report_fd: int) -> None:
    """In the forked child: drop everything of the fork server, then be the shim. Never returns."""

    def work() -> int:
        os.dup2(report_fd, 1)
        _leave_server(shim)  # (and the report fd's copy)
        _set_comm("gpusched-shim")
        return int(shim.run(job_dir))

    _exit_with(work)


def _become_spare(shim: ModuleType, channel: socket.socket, jobs_dir: str) -> None:
    """In the forked child: a shim that waits for its job on `channel`. Never returns."""

    def work() -> int:
        _leave_server(shim, keep=channel.fileno())  # only its own socketpair stays
        _set_comm("gpusched-spare")
        subreaper = shim.prepare()
        data, fds = receive(channel)
        if not data or len(fds) != 1:  # the daemon and the fork server let it go: no job comes
            return 0
        try:
            job_dir = json.loads(data).get("job_dir")
        except (ValueError, AttributeError):
            job_dir = None
        error = job_dir_error(jobs_dir, job_dir)
        if error is not None:  # (only the daemon holds the other end): as a refused request, no launch
            print(f"gpusched spare shim: {error}", file=sys.stderr, flush=True)
            return 2
        os.dup2(fds[0], 1)  # the report pipe, as _become_shim has it; run() closes the original
        _set_comm("gpusched-shim")
        # The socketpair stays open until the job has exec'd; then run() writes the job's directory
        # on it and closes it: the server's cue to fork the next spare (close-on-exec, as every
        # socket: the job never has it).
        return int(shim.run(job_dir, subreaper, launched_fd=channel.detach()))

    _exit_with(work)


def _leave_server(shim: ModuleType, keep: int | None = None) -> None:
    """In a forked child: a session of its own, and nothing of the fork server's but 1, 2 and `keep`:
    0 becomes /dev/null (it was the channel: a shim cannot talk to the daemon's fork server), and
    the rest (other shims' pidfds) is closed; SIGCHLD is the default again."""
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    shim.close_descriptors(keep)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def _exit_with(work: Callable[[], int]) -> NoReturn:
    """Run a forked child's `work` and exit with its code, whatever happens (a bug's traceback goes
    to stderr): a child must never return into the fork server's loop."""
    code = 1
    try:
        code = work()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stderr.flush()
    finally:
        os._exit(code)


def _set_comm(name: str) -> None:
    """`ps -o comm` tells shims and the spare from their fork server."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name)


def send(channel: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    """One message and the descriptors to pass with it (both sides use this, as `receive`)."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    channel.sendmsg([json.dumps(message).encode()], ancillary)


def receive(channel: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors passed with it (both sides use this)."""
    data, ancdata, _flags, _addr = channel.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(4 * 4))
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
            fds.extend(received)
    return data, fds


class Server:
    """The request loop and the shims it has forked (and must reap)."""

    def __init__(self, channel: socket.socket, jobs_dir: str, shim: ModuleType) -> None:
        self.channel = channel
        self.jobs_dir = jobs_dir
        self.shim = shim
        # poll, not epoll: an epoll instance would be shared with every forked child until it closes it.
        self.selector = selectors.PollSelector()
        self.selector.register(channel, selectors.EVENT_READ, None)
        self.shims: dict[int, tuple[int, str]] = {}  # pidfd -> (pid, job dir, or SPARE)
        self.unwatched: set[int] = set()  # shims we could not open a pidfd for: reaped when we can
        self.serving = True
        self.spare: tuple[int, int, socket.socket] | None = None  # (pid, pidfd, its socketpair's other end)
        self.spare_launched = False  # the spare has noted its launched job (see _spare_done)
        self.refill_at: float | None = None  # monotonic time to fork the next spare, if none is waiting

    def run(self) -> int:
        self._fork_spare()
        while self.serving or self.shims or self.unwatched:
            # Unwatched shims (no pidfd: out of descriptors) are checked on every event, and at
            # least once a second while there are any.
            timeout = 1.0 if self.unwatched else None
            if self.refill_at is not None:  # and in time to fork the next spare
                until_refill = max(0.0, self.refill_at - time.monotonic())
                timeout = until_refill if timeout is None else min(timeout, until_refill)
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    self._serve_one()
                elif key.data is _SPARE:
                    self._spare_done(key.fileobj)  # type: ignore[arg-type]  # (registered as a socket)
                else:
                    self._reap(key.fd)
            if self.refill_at is not None and time.monotonic() >= self.refill_at:
                self.refill_at = None
                if self.serving and self.spare is None:
                    self._fork_spare()
            for pid in list(self.unwatched):
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(pid, os.WNOHANG)[0] == 0:
                        continue
                self.unwatched.discard(pid)
        return 0

    def _serve_one(self) -> None:
        try:
            data, fds = receive(self.channel)
        except OSError:
            data, fds = b"", []
        if not data:  # the daemon is gone: fork no more, but keep reaping our shims
            self._stop_serving()
            return
        try:
            reply = self._handle(data, fds)
        except Exception as exc:  # a bug here must cost one launch (the daemon spawns it), not the server
            reply = ({"id": None, "error": f"fork server: {exc!r}"}, [])
        finally:
            for fd in fds:
                os.close(fd)
        message, pass_fds = reply
        try:
            send(self.channel, message, pass_fds)
        except OSError:
            self._stop_serving()
        if self.serving and self.spare is None:  # the next one, once this launch has had the CPUs
            self.refill_at = time.monotonic() + REFILL_DELAY_S

    def _handle(self, data: bytes, fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        try:
            request = json.loads(data)
            request_id = request["id"]
            job_dir = request["job_dir"]
        except (ValueError, TypeError, KeyError):
            return {"id": None, "error": "request: not the JSON object the daemon sends"}, []
        error = job_dir_error(self.jobs_dir, job_dir)
        if error is None and len(fds) != 1:
            error = f"request: expected the report pipe's descriptor, got {len(fds)} descriptors"
        if error is not None:
            return {"id": request_id, "error": error}, []
        # (never the spare: the daemon has it, and asks only when it has none)
        try:
            pid = os.fork()
        except OSError as exc:
            return {"id": request_id, "error": f"fork: {exc.strerror or exc}"}, []
        if pid == 0:
            _become_shim(self.shim, job_dir, fds[0])
        # Only this loop reaps, and only a pid whose pidfd said it exited: the pid cannot be reused
        # before we open the pidfd.
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # EMFILE: the daemon finds the shim from its record (shimstart.py)
            self.unwatched.add(pid)
            return {"id": request_id, "pid": pid}, []
        self.shims[pidfd] = (pid, job_dir)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        return {"id": request_id, "pid": pid}, [pidfd]

    def _fork_spare(self) -> None:
        """A shim that waits, prepared, for the daemon's next launch, and the notice that hands the
        daemon its channel (none if it cannot be made: requests then fork their shims, as before)."""
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError:
            return
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return
        if pid == 0:
            ours.close()
            _become_spare(self.shim, theirs, self.jobs_dir)
        theirs.close()
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # (out of descriptors) a spare we could not hand out: end it, reap it later
            ours.close()
            self.unwatched.add(pid)
            return
        self.shims[pidfd] = (pid, SPARE)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        ours.setblocking(False)
        self.selector.register(ours, selectors.EVENT_READ, _SPARE)
        self.spare = (pid, pidfd, ours)
        try:  # (the daemon gets copies: the pidfd and this end stay ours too)
            send(self.channel, {"spare": pid}, [pidfd, ours.fileno()])
        except OSError:  # the daemon is gone
            self._stop_serving()

    def _spare_done(self, channel: socket.socket) -> None:
        """The spare's socketpair has something: the note of its launched job (the daemon handed it
        one, and it has exec'd) and, once it closed its end, end of file. With the note the next
        spare is forked now, while no launch of ours needs the CPUs (ready for the next of a run of
        launches, which the idle delay never left room for); without it, the spare died waiting,
        and the next one comes once the server is idle (never a fork loop behind a spare that dies)."""
        while True:
            try:
                note = channel.recv(MAX_REQUEST)
            except BlockingIOError:
                return  # the note, and not yet the end of file: that comes next
            except OSError:
                note = b""
            if not note:
                break
            self._note_launched(note)
        self.selector.unregister(channel)
        channel.close()
        if self.spare is None or self.spare[2] is not channel:
            return  # (only the spare's is ever registered)
        launched, self.spare_launched = self.spare_launched, False
        self.spare = None
        if not self.serving:
            return
        if launched:
            self.refill_at = None
            self._fork_spare()
        else:
            self.refill_at = time.monotonic() + REFILL_DELAY_S

    def _note_launched(self, note: bytes) -> None:
        """The spare names the job directory it launched, for the message should its shim fail."""
        if self.spare is not None:
            self.spare_launched = True
            pid, pidfd, _ = self.spare
            if pidfd in self.shims:
                self.shims[pidfd] = (pid, os.path.join(self.jobs_dir, note.decode(errors="replace")))

    def _reap(self, pidfd: int) -> None:
        self.selector.unregister(pidfd)
        pid, job_dir = self.shims.pop(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return
        code = os.waitstatus_to_exitcode(status)
        if code not in (0, self.shim.EXIT_REVOKED):  # the job's own status is in status.json
            print(f"gpusched fork server: shim {pid} for {job_dir} exited with status {code}",
                  file=sys.stderr, flush=True)

    def _stop_serving(self) -> None:
        if self.serving:
            self.serving = False
            self.selector.unregister(self.channel)
            self.channel.close()
            if self.spare is not None:  # unless launched, it sees its socketpair close (the daemon's copy
                # too: the daemon went, or let it go) and exits; reaped as a shim
                self.selector.unregister(self.spare[2])
                self.spare[2].close()
                self.spare = None


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not os.path.isabs(argv[1]):
        print("usage: forkserver.py JOBS_DIR (absolute)", file=sys.stderr)
        return 2
    # Nothing of the daemon but the channel: not its database, its sockets or its cwd.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir("/")
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # never SIG_IGN: that would reap shims behind our back
    channel = socket.socket(fileno=CHANNEL_FD)
    if channel.type != socket.SOCK_SEQPACKET:
        print("forkserver.py: stdin must be the daemon's SOCK_SEQPACKET socketpair", file=sys.stderr)
        return 2
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write("gpusched-forks")
    return Server(channel, os.path.normpath(argv[1]), load_shim()).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
