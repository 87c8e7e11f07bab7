"""The per-job supervisor: `python -I .../gpusched/daemon/shim.py JOB_DIR`.

The daemon starts one shim per job in a session of its own, so the job outlives a daemon crash or
`systemctl restart`. The shim forks the job (in a new session, as the submitting user), records and
reports the job's pid at once, reports again once the job has exec'd (or why it could not), waits
for it, kills whatever the job left behind in its session, and writes the exit status durably to
JOB_DIR, where the daemon collects it whenever it is next running.

Only the standard library is used, and the daemon runs this file as a script under `-I`: nothing
from the environment or any working directory is on `sys.path` (a planted `json.py` must not run
as root), and the shim starts once per job, so it must be cheap.

The shim holds an exclusive `flock` on its `launch.json` for its whole life. That lock is how a
restarted daemon tells "a shim is (still) running this job" from "no shim will ever run it": locks
die with their process, so pid reuse cannot fool it. A daemon that finds the lock free and no
record of a launch unlinks `launch.json` under the lock, and a shim that gets the lock afterwards
sees the file gone and starts nothing.
"""

from __future__ import annotations

import _signal  # the C module under `signal`: see _reset_ignored_signals
import binascii
import contextlib
import ctypes  # (loaded once in the fork server, which imports this module)
import fcntl
import json
import os
import signal
import sys
import time
from typing import Any

LAUNCH = "launch.json"
SHIM = "shim.json"
STATUS = "status.json"

# Exit codes of the shim itself (the job's own status is in status.json).
EXIT_REVOKED = 3  # the launch was revoked by a restarted daemon, or another shim holds it
CLAIM_TRIES = 100  # x 10 ms

# gpusched-execjob (execjob.c): the job's child in C, started with posix_spawn, when it is built
# (`make`, daemon/execjob_build.py) from this very source; else a forked Python child (_child).
EXECJOB_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "execjob.c")
EXECJOB_DIR = os.path.join(os.path.dirname(EXECJOB_SOURCE), "_execjob")
EXECJOB_ENV = "GPUSCHED_EXECJOB"  # "0": fork the Python child even where the helper is built
_REPORT_FD = 3  # where the helper finds the failure pipe (execjob.c)


def execjob_path(source: str = EXECJOB_SOURCE, out_dir: str = EXECJOB_DIR) -> str | None:
    """Where the helper built from `source` as it is now lives (None: the source cannot be read).
    Named by the text's checksum, so a build from an older text is never run."""
    try:
        with open(source, "rb") as f:
            text = f.read()
    except OSError:
        return None
    return os.path.join(out_dir, f"gpusched-execjob-{binascii.crc32(text):08x}-{len(text)}")


def usable_execjob() -> str | None:
    """The helper this process would use if it looked now (None: the Python child): built from
    today's source, executable, and not switched off by GPUSCHED_EXECJOB=0."""
    if os.environ.get(EXECJOB_ENV, "") == "0":
        return None
    path = execjob_path()
    return path if path is not None and os.access(path, os.X_OK) else None


EXECJOB = usable_execjob()  # once per process: the fork server's shims inherit the answer


def write_atomic(path: str, data: dict[str, Any], *, durable: bool = True) -> None:
    """Write-then-rename, so a reader sees the old file or the whole new one; with `durable`, fsync
    the file and its directory too, so the record also survives the machine crashing."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(data).encode())
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    if durable:
        _fsync(os.path.dirname(path) or ".")


def make_durable(path: str) -> None:
    """fsync a file written with `durable=False`, and its directory (which holds its new name).

    Best effort: by now the job runs, and the shim must live to record its end, whatever became of
    the file meanwhile (removed, or a failing disk: status.json will say so when it cannot be written).
    """
    with contextlib.suppress(OSError):
        _fsync(path)
        _fsync(os.path.dirname(path) or ".")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/PID/stat (state first); None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    return stat[stat.rindex(b")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks (field 22 of /proc/PID/stat); None if gone or a zombie."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in (b"Z", b"X"):
        return None  # exited, not yet reaped: as good as gone
    return int(fields[19])


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
KILL_ROUNDS = 10_000  # scans of what is left of a job before giving up (each one kills all it finds)


def become_subreaper() -> bool:
    """Make this shim a child subreaper: a process of the job whose parent dies is re-parented here,
    not to PID 1, whether or not it left the job's session (setsid) or process group. So every
    process the job started stays below the shim, which can find and kill it when the job ends.
    False where the kernel (or libc) does not offer it: then the session is what is killed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _children() -> list[int] | None:
    """This process's children, as the kernel has them at the moment of the read (None where the
    kernel does not offer /proc/PID/task/TID/children). A scan of /proc cannot be trusted for this:
    a process that forks and exits faster than the scan reads it is always seen already dead."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except (OSError, ValueError):
        return None


def _in_session(leader: int) -> list[int]:
    """Live processes of the job's session other than its leader, by one scan of /proc."""
    sid = str(leader).encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == leader:
            continue
        fields = _stat_fields(int(name))
        if fields is not None and len(fields) > 3 and fields[3] == sid and fields[0] not in (b"Z", b"X"):
            found.append(int(name))
    return found


def _live_children(leader: int, children: list[int]) -> list[int]:
    """Of this shim's children, those still running; the exited ones (but the leader) are reaped."""
    live = []
    for pid in children:
        if pid != leader:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    live.append(pid)
    return live


def kill_session(leader: int, subreaper: bool = False) -> int:
    """SIGKILL what is left of a job: its process group, every process still in its session, and,
    when this shim is a subreaper (become_subreaper), every process below it.

    Called while the job's leader is an unreaped zombie, so neither its pid nor its process-group
    or session id can have been reused. Below a subreaper every process the job started is a
    descendant, and one whose parent dies is a child here before that parent can be reaped: so
    killing and reaping this shim's children until it has none but the leader leaves nothing,
    whatever left the session or keeps changing its pid (and a process cannot fork once SIGKILL is
    pending). Without one, the session as /proc shows it, until a scan finds none (a process that
    forks and exits faster than the scan can be missed: cgroups, or the subreaper, close that).
    Returns how many processes were signalled besides the group.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)
    killed = 0
    for _ in range(KILL_ROUNDS):
        children = _children() if subreaper else None
        if children is None:
            left = _in_session(leader)
            if not left:
                break
        else:
            if not [pid for pid in children if pid != leader]:
                break  # nothing below us: nothing of the job is left anywhere
            left = _live_children(leader, children)  # (the exited ones' orphans are ours by now)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def _wait_for_leader(leader: int) -> None:
    """Until the leader exits (left unreaped: its pid must stay reserved), reap the orphans of the
    job that are re-parented to this shim and exit meanwhile, so none lingers as a zombie."""
    while True:
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        if info is None or info.si_pid == leader:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


def _reset_ignored_signals() -> None:
    """Every signal ignored here back to its default: an ignored signal stays ignored across exec,
    and Python ignores SIGPIPE and SIGXFSZ, the shim TERM, INT and HUP, and whatever started the
    daemon may have ignored others (a job over its `ulimit -f` must be killed, not get EFBIG). glibc's
    own signals (32, 33), which posix_spawn leaves ignored, cannot be changed from Python.

    Through `_signal`, with the numbers listed once: `signal`'s wrappers turn every number and
    handler into an enum member, and the loop took 0.35 ms that way, twice on each launch's path
    (here in the shim, and in the job's child before its exec), against 3 us."""
    ignored, default = _signal.SIG_IGN, _signal.SIG_DFL
    for sig in _SIGNALS:
        if _signal.getsignal(sig) == ignored:
            with contextlib.suppress(OSError, ValueError):  # (only for the few ignored ones)
                _signal.signal(sig, default)


_SIGNALS = tuple(int(sig) for sig in signal.valid_signals())


def _child(launch: dict[str, Any], err_w: int) -> None:
    """In the forked child: become the job. Never returns; reports a failure on `err_w`."""
    stage = "setsid"
    try:
        os.setsid()
        if launch.get("cgroup"):
            # Join the job's cgroup before anything of the job runs (and while still root).
            stage = f"join cgroup {launch['cgroup']}"
            with open(os.path.join(launch["cgroup"], "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
        if launch.get("cpuset"):  # (without a cgroup, or one without the CPU controllers)
            stage = "set CPU affinity"
            os.sched_setaffinity(0, launch["cpuset"])
        if launch.get("drop_privileges"):
            stage = "setgroups"
            os.setgroups(launch["groups"])
            stage = "setgid"
            os.setgid(launch["gid"])
            stage = "setuid"
            os.setuid(launch["uid"])
        stage = f"open log {launch['log_path']}"
        log_fd = os.open(launch["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        stage = f"chdir {launch['cwd']}"
        os.chdir(launch["cwd"])
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        _reset_ignored_signals()
        argv = launch["argv"]
        stage = f"exec {argv[0]}"
        os.execvpe(argv[0], argv, launch["env"])
    except OSError as exc:
        os.write(err_w, f"{stage}: {exc.strerror or exc}".encode())
    except BaseException as exc:
        os.write(err_w, f"{stage}: {exc}".encode())
    os._exit(127)


def execjob_environment(launch: dict[str, Any]) -> dict[str, str]:
    """The helper's environment for `launch` (execjob.c): its parameters, and the job's variables as
    the values of E0, E1, ... in order, names the loader ignores: a submitter's LD_PRELOAD must not
    act in the helper, which runs as root, and argv (/proc/PID/cmdline) is anyone's to read."""
    return {
        **{f"E{i}": f"{k}={v}" for i, (k, v) in enumerate(launch["env"].items())},
        "GPUSCHED_X_CGROUP": launch.get("cgroup") or "",
        "GPUSCHED_X_CPUSET": ",".join(str(c) for c in launch.get("cpuset") or ()),
        "GPUSCHED_X_DROP": "1" if launch.get("drop_privileges") else "0",
        "GPUSCHED_X_UID": str(launch.get("uid", 0)), "GPUSCHED_X_GID": str(launch.get("gid", 0)),
        "GPUSCHED_X_GROUPS": ",".join(str(g) for g in launch.get("groups") or ()),
        "GPUSCHED_X_LOG": launch["log_path"], "GPUSCHED_X_CWD": launch["cwd"],
    }


def _spawn_child(helper: str, launch: dict[str, Any], err_w: int) -> int | None:
    """Start the job's child as gpusched-execjob; None if it could not be started at all (then the
    shim forks the Python child, which fails the same launch with the same message if it must)."""
    if any(not key or "=" in key for key in launch["env"]):
        return None  # (os.execve's own check says what is wrong with such a name)
    report = err_w if err_w != _REPORT_FD else os.dup(err_w)  # (a dup2 onto itself keeps close-on-exec)
    try:
        return os.posix_spawn(helper, [helper, *(str(a) for a in launch["argv"])], execjob_environment(launch),
                              file_actions=[(os.POSIX_SPAWN_DUP2, report, _REPORT_FD)], setsigmask=())
    except (OSError, ValueError, TypeError):  # E2BIG, ENOMEM; a NUL byte in an argument
        return None
    finally:
        if report != err_w:
            os.close(report)


def _claim(job_dir: str) -> tuple[int, dict[str, Any]] | None:
    """Open and lock launch.json; None when the launch was revoked or another shim holds it."""
    try:
        fd = os.open(os.path.join(job_dir, LAUNCH), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    # The daemon's liveness probe holds a shared lock for microseconds: wait that out, but never
    # queue behind another shim, which would hold it for its job's whole life.
    for _ in range(CLAIM_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(0.01)
    else:
        os.close(fd)
        return None
    if os.fstat(fd).st_nlink == 0:  # unlinked by a restarted daemon before we got the lock
        os.close(fd)
        return None
    with os.fdopen(os.dup(fd), "rb") as f:
        launch = json.loads(f.read())
    return fd, launch


def _report(message: dict[str, Any]) -> None:
    # If the daemon went away before reading, it finds shim.json / status.json on its next start.
    with contextlib.suppress(OSError):
        print(json.dumps(message), flush=True)


def close_descriptors(keep: int | None = None) -> None:
    """Close every descriptor from 3 up but `keep` (the fork server's children use this too)."""
    top = os.sysconf("SC_OPEN_MAX")
    if keep is None:
        os.closerange(3, top)
    else:
        os.closerange(3, keep)
        os.closerange(keep + 1, top)


def prepare() -> bool:
    """What a shim does before it knows its job (a spare shim does it ahead: forkserver.py); returns
    whether it became a subreaper. No ignored signal reaches the job (they are reset again in the
    child, after ours in `run`), but SIGPIPE, as Python has it: a daemon killed mid-launch leaves the
    report pipe without a reader, and the shim must outlive that write to record the job's end."""
    _reset_ignored_signals()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    return become_subreaper()


def run(job_dir: str, subreaper: bool | None = None, launched_fd: int | None = None) -> int:
    """Run the job of `job_dir` to its end; `subreaper`: what `prepare`, called ahead, returned;
    `launched_fd` (a spare's socketpair, close-on-exec) gets the job directory's name and is closed
    once the job has exec'd (the fork server's cue to prepare the next spare); the job never has it."""
    # Nothing of whoever started us reaches the job: no descriptor but 0-2 (a spawned shim inherits
    # the daemon's inheritable ones).
    close_descriptors(keep=launched_fd)
    if subreaper is None:
        subreaper = prepare()
    claimed = _claim(job_dir)
    if claimed is None:
        return EXIT_REVOKED
    lock_fd, launch = claimed  # held (CLOEXEC: the job never inherits it past exec) until we exit
    # The daemon signals the job's process group, never the shim; the shim must live to record.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = _spawn_child(EXECJOB, launch, err_w) if EXECJOB is not None else None
    if pid is None:  # (not built, or it could not be started: the child the slower way)
        pid = os.fork()
        if pid == 0:
            os.close(err_r)
            os.close(lock_fd)
            _child(launch, err_w)
    os.close(err_w)
    # Record and report the pid before the child execs: a child stopped (or slowed) between its
    # setuid and its exec is the job's user's to control, and the daemon must be able to kill it.
    # The record is visible to a restarted daemon at once; it is made durable (for a machine crash)
    # only after both reports, as its two fsyncs were half of an idle node's launch. A machine crash
    # ends the job either way, and its verdict does not depend on this: a RUNNING job without a
    # record ends LOST as one with a record does, and a STARTING one was requeued or LOST depending
    # on the crash's moment before too.
    record = os.path.join(job_dir, SHIM)
    write_atomic(record, {
        "shim_pid": os.getpid(), "shim_start": process_start_time(os.getpid()),
        "pid": pid, "pid_start": process_start_time(pid), "started_at": time.time(),
    }, durable=False)
    _report({"pid": pid})
    error = b""
    while chunk := os.read(err_r, 4096):  # EOF at exec (CLOEXEC) or when the child dies
        error += chunk
    os.close(err_r)
    _report({"exec": not error, "error": error.decode(errors="replace") or None})
    if launched_fd is not None:
        with contextlib.suppress(OSError):  # (a fork server gone meanwhile)
            os.write(launched_fd, os.path.basename(job_dir).encode())
        os.close(launched_fd)
    make_durable(record)
    null_fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null_fd, 1)
    # Wait without reaping, so the leader's pid (= its group and session id) stays reserved while
    # we kill what it left behind: nothing of a job outlives it onto devices given to others.
    _wait_for_leader(pid)
    kill_session(pid, subreaper)
    _, status = os.waitpid(pid, 0)
    exit_code = os.waitstatus_to_exitcode(status)
    write_atomic(os.path.join(job_dir, STATUS), {
        "pid": pid,
        # A program that was never executed has no exit code (the child's 127 is ours, not its).
        "exit_code": exit_code if exit_code >= 0 and not error else None,
        "signal": -exit_code if exit_code < 0 else None,
        "error": error.decode(errors="replace") or None,
        "ended_at": time.time(),
    })
    os.close(lock_fd)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
