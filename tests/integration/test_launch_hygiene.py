"""What a job starts with and leaves behind, from an audit of the launch path as root: nothing of
the job outlives it (the shim is a child subreaper and kills its children until none is left), no
signal starts ignored, and no descriptor of whoever started the daemon reaches it. Each test
failed on the code before (the forking one 6 times in 6); needs root."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from gpusched.daemon.procfs import session_members
from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.protocol import LogsRequest, LogsResult
from tests.conftest import DaemonHandle, DaemonProcess
from tests.integration.test_daemon import submit, wait_done
from tests.integration.test_identity import as_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


# A job whose background process moves to a process group of its own (NOT a new session: setpgid,
# not setsid) and keeps changing its pid for 3 s (fork, parent exits), then sleeps. The leader exits
# after 1 s.
FORKER = textwrap.dedent("""
    import os, time
    if os.fork() == 0:
        os.setpgid(0, 0)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            if os.fork() != 0:
                os._exit(0)
            time.sleep(0.0005)
        time.sleep(60)
        os._exit(0)
    time.sleep(1.0)
""")



@pytest.mark.parametrize("launcher", ["forkserver", "spawn"])
def test_a_forking_process_in_the_jobs_session_does_not_outlive_the_job(
        daemon_factory: Callable[..., DaemonHandle], tmp_path: Path, launcher: str) -> None:
    """A process in a group of its own that keeps changing its pid (fork, parent exits) survived
    the job: one scan of /proc sees such a process already dead, every time."""
    daemon = daemon_factory(launcher=launcher)
    with daemon.client() as c:
        job_id = submit(c, JobSpec(argv=[sys.executable, "-c", FORKER], cwd=str(tmp_path),
                                   env={"PATH": os.environ["PATH"]}, request=WholeRequest(gpus=1)))
        job = wait_done(c, job_id).job
        assert job.state is JobState.COMPLETED, job.reason
        assert job.pid
        left = session_members(job.pid)  # (a survivor hops on for 3 s, then sleeps for 60)
        try:
            assert left == [], f"{len(left)} process(es) of job {job_id}'s session outlived it: {left}"
        finally:
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _ignored(sig_ign_line: str) -> set[int]:
    mask = int(sig_ign_line.split()[1], 16)
    return {n for n in range(1, 65) if mask & (1 << (n - 1))}


@pytest.mark.parametrize("launcher", ["forkserver", "spawn"])
def test_a_job_starts_with_no_signal_ignored(daemon_factory: Callable[..., DaemonHandle], tmp_path: Path,
                                             launcher: str) -> None:
    """Python ignores SIGXFSZ (and SIGPIPE), and exec keeps SIG_IGN: every job started with SIGXFSZ
    ignored, so one over its `ulimit -f` got EFBIG instead of being killed. glibc's own signals 32
    and 33, which posix_spawn leaves ignored, cannot be reset from Python (docs/security.md)."""
    daemon = daemon_factory(launcher=launcher)
    with daemon.client() as c:
        job_id = submit(c, JobSpec(argv=["grep", "^SigIgn", "/proc/self/status"], cwd=str(tmp_path),
                                   env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1)))
        assert wait_done(c, job_id).job.state is JobState.COMPLETED
        line = c.call(LogsRequest(job_id=job_id), LogsResult).data
    ignored = _ignored(line)
    assert signal.SIGXFSZ not in ignored, f"job starts with {sorted(ignored)} ignored ({line.strip()})"
    assert ignored <= {32, 33}, f"job starts with {sorted(ignored)} ignored ({line.strip()})"


class _WrappedDaemon(DaemonProcess):
    """gpuschedd started by a wrapper shell: `exec 7</etc/shadow` leaves an inheritable root-only
    descriptor open, as any start-up script, sudo -C, or a supervisor's leaked fd would; and
    `trap '' QUIT` as a non-interactive shell's `gpuschedd &` does for SIGQUIT."""

    def program(self) -> list[str]:
        return ["sh", "-c", "trap '' QUIT; exec 7</etc/shadow; exec \"$@\"", "sh",
                sys.executable, "-m", "gpusched.daemon.main"]


@pytest.mark.parametrize("launcher", ["forkserver", "spawn"])
def test_a_job_inherits_no_descriptor_of_the_daemon(daemon_process: Callable[..., DaemonProcess],
                                                    launcher: str) -> None:
    """With launcher = "spawn" the shim was posix_spawned with the daemon's inheritable descriptors
    and forked the job without closing any: an unprivileged user's job read the root-only file the
    daemon was started with."""
    d = daemon_process(cls=_WrappedDaemon)
    d.extra_config = f'launcher = "{launcher}"\n'
    d.start()
    os.chmod(os.path.dirname(d.socket), 0o755)
    msg = {"op": "submit", "spec": JobSpec(
        argv=["sh", "-c", "ls /proc/self/fd; head -c 5 <&7 && echo LEAKED"], cwd="/tmp",
        env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1)).model_dump(mode="json")}
    [reply] = as_user(12345, d.socket, msg)
    assert reply["ok"], reply
    job_id = reply["result"]["job_id"]
    from gpusched_cli.client import Client
    with Client(d.socket) as c:
        wait_done(c, job_id)
        out = c.call(LogsRequest(job_id=job_id), LogsResult).data
    assert "LEAKED" not in out, f"a job of uid 12345 read /etc/shadow through an inherited descriptor:\n{out}"
    fds = sorted(int(x) for x in out.split() if x.isdigit())
    assert fds == [0, 1, 2, 3], f"the job inherited descriptors {fds} (3 is ls's own)"


@pytest.mark.parametrize("launcher", ["forkserver", "spawn"])
def test_a_signal_the_daemon_was_started_with_ignored_is_not_ignored_in_jobs(
        daemon_process: Callable[..., DaemonProcess], tmp_path: Path, launcher: str) -> None:
    """The same reset: SIGQUIT ignored by whatever started the daemon stays ignored in every job."""
    d = daemon_process(cls=_WrappedDaemon)
    d.extra_config = f'launcher = "{launcher}"\n'
    d.start()
    from gpusched_cli.client import Client
    with Client(d.socket) as c:
        job_id = submit(c, JobSpec(argv=["grep", "^SigIgn", "/proc/self/status"], cwd=str(tmp_path),
                                   env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1)))
        wait_done(c, job_id)
        line = c.call(LogsRequest(job_id=job_id), LogsResult).data
    assert signal.SIGQUIT not in _ignored(line), f"SIGQUIT is ignored in the job ({line.strip()})"


@pytest.mark.parametrize("launcher", ["forkserver", "spawn"])
def test_a_process_that_left_the_session_does_not_outlive_the_job(
        daemon_factory: Callable[..., DaemonHandle], tmp_path: Path, launcher: str) -> None:
    """`setsid` was the documented escape without cgroups; below a subreaper shim it is one no more."""
    pid_file = tmp_path / "escaped"
    daemon = daemon_factory(launcher=launcher)
    with daemon.client() as c:
        job_id = submit(c, JobSpec(argv=["sh", "-c", f"setsid sleep 60 & echo $! > {pid_file}"], cwd=str(tmp_path),
                                   env={"PATH": "/usr/bin:/bin"}, request=WholeRequest(gpus=1)))
        assert wait_done(c, job_id).job.state is JobState.COMPLETED
    escaped = int(pid_file.read_text())
    try:
        with open(f"/proc/{escaped}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return
    try:
        assert state in ("Z", "X"), f"the setsid'd process {escaped} outlived its job (state {state})"
    finally:
        with contextlib.suppress(OSError):
            os.kill(escaped, signal.SIGKILL)
