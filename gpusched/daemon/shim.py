"""The per-job supervisor: `python -m gpusched.daemon.shim JOB_DIR`.

The daemon starts one shim per job in a session of its own, so the job outlives a daemon crash or
`systemctl restart`. The shim forks the job (in a new session, as the submitting user), tells the
daemon the job's pid on stdout, waits for it, and writes the exit status durably to JOB_DIR, where
the daemon collects it whenever it is next running. Only the standard library is used: the shim
starts once per job, so it must be cheap.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

LAUNCH = "launch.json"
SHIM = "shim.json"
STATUS = "status.json"


def write_atomic(path: str, data: dict[str, Any]) -> None:
    """Write-then-rename with fsync, so a reader sees the old file or the whole new one."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(data).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def process_start_time(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks (field 22 of /proc/PID/stat); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None  # exited, not yet reaped: as good as gone
    return int(fields[19])


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
        elif launch.get("cpuset"):
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
        # Python ignores SIGPIPE and we ignore the others; ignored signals survive exec, so reset them.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        argv = launch["argv"]
        stage = f"exec {argv[0]}"
        os.execvpe(argv[0], argv, launch["env"])
    except OSError as exc:
        os.write(err_w, f"{stage}: {exc.strerror or exc}".encode())
    except BaseException as exc:
        os.write(err_w, f"{stage}: {exc}".encode())
    os._exit(127)


def run(job_dir: str) -> int:
    with open(os.path.join(job_dir, LAUNCH)) as f:
        launch = json.load(f)
    # The daemon signals the job's process group, never the shim; the shim must live to record.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(err_r)
        _child(launch, err_w)
    os.close(err_w)
    error = b""
    while chunk := os.read(err_r, 4096):  # EOF at exec (CLOEXEC) or when the child dies
        error += chunk
    os.close(err_r)
    write_atomic(os.path.join(job_dir, SHIM), {
        "shim_pid": os.getpid(), "shim_start": process_start_time(os.getpid()),
        "pid": pid, "pid_start": process_start_time(pid), "started_at": time.time(),
    })
    # If the daemon went away before reading, it finds shim.json on its next start instead.
    with contextlib.suppress(OSError):
        print(json.dumps({"pid": pid, "error": error.decode(errors="replace") or None}), flush=True)
    null_fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null_fd, 1)
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
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
