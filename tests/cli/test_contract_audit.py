"""Promises of docs/cli.md that an audit of the CLI found broken; each test failed on the code before
its fix (a traceback, a wrong exit code, a reply too large to send, an order the doc does not give)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

from gpusched.core.accounting import user_stats
from gpusched.model import Job, JobSpec, JobState, Transition, WholeRequest
from gpusched_cli import messages
from gpusched_cli.client import resolve_socket
from tests.conftest import DaemonHandle, short_tmpdir, wait_until

GPUSCHED = os.path.join(os.path.dirname(sys.executable), "gpusched")


def run(sock: str, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUSCHED, "--socket", sock, *args], capture_output=True, text=True, timeout=60,
                          **kwargs)  # type: ignore[call-overload]


# ---- sockets that are not a daemon's: exit 3 with the socket named, never a traceback -------------------


def test_paths_that_cannot_be_a_daemons_socket_exit_3_naming_it(tmp_path: object) -> None:
    base = short_tmpdir()
    try:
        regular = os.path.join(base, "file")
        open(regular, "w").close()
        datagram = os.path.join(base, "dg.sock")
        dg = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        dg.bind(datagram)
        try:
            cases = {
                os.path.join(regular, "g.sock"): "cannot be used: Not a directory",
                "/tmp/" + "a" * 120 + ".sock": "cannot be used",
                datagram: "is not a stream socket",
                regular: "is not a socket",
            }
            for path, said in cases.items():
                result = run(path, "queue")
                assert result.returncode == 3, (path, result.stderr)
                assert "Traceback" not in result.stderr
                assert said in result.stderr and path in result.stderr, result.stderr
        finally:
            dg.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---- what JSON cannot carry: a usage error naming it, before anything is sent ------------------------------


def test_text_that_is_not_utf8_is_a_usage_error_naming_it(tmp_path: object) -> None:
    nowhere = "/tmp/gpusched-nowhere.sock"  # a usage error must come before any attempt to connect
    env = {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}
    env[b"LATIN1_DIR"] = b"/home/caf\xe9"
    out = subprocess.run([os.fsencode(GPUSCHED), b"--socket", nowhere.encode(), b"submit", b"--gpus", b"1", b"true"],
                         capture_output=True, env=env, timeout=60)
    assert out.returncode == 2 and b"Traceback" not in out.stderr, out.stderr
    assert b"the environment variable 'LATIN1_DIR' is not UTF-8 text" in out.stderr
    assert run(nowhere, "submit", "--export", "NONE", "--gpus", "1", "true",
               env={**os.environ, "LATIN1_DIR": "x"}).returncode == 3  # a clean one is sent (nobody listens)

    out = subprocess.run([os.fsencode(GPUSCHED), b"--socket", nowhere.encode(), b"submit", b"--gpus", b"1", b"--",
                          b"echo", b"\xff"], capture_output=True, timeout=60)
    assert out.returncode == 2 and b"argument 1" in out.stderr and b"Traceback" not in out.stderr, out.stderr

    gone = tempfile.mkdtemp()
    out2 = subprocess.run(["sh", "-c", f"cd {gone} && rmdir {gone} && exec {GPUSCHED} --socket {nowhere} "
                           "submit --gpus 1 true"], capture_output=True, text=True, timeout=60)
    assert out2.returncode == 2 and "the current directory cannot be read" in out2.stderr, out2.stderr


def test_a_share_below_one_percent_is_refused(daemon: DaemonHandle) -> None:
    """MPS caps in whole percent: 1e-9 ran with 1 % of the SMs and was charged almost nothing."""
    result = run(daemon.socket, "submit", "--share", "1e-9", "--gpu-mem", "1", "true")
    assert result.returncode == 2 and "is below 0.01" in result.stderr, result.stderr
    spec = messages.job_spec(argv=["true"], cwd="/tmp", env={}, request=messages.share(0.001, 1), name=None,
                             time_limit_s=None, job_class="batch", nice=0, requeue=False, precision=None, after=[],
                             cpus=None, mem_mib=None)
    with daemon.client() as c:  # the daemon refuses it too, whatever the client
        reply = c.raw_call(messages.submit(spec, False))
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    assert "request.fraction 0.001 is below 0.01" in reply["error"]["message"], reply


# ---- output ----------------------------------------------------------------------------------------------


def test_a_closed_stdout_is_not_a_lost_daemon(daemon: DaemonHandle) -> None:
    for _ in range(3):
        assert run(daemon.socket, "submit", "--gpus", "1", "--hold", "true").returncode == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away: `gpusched queue | head -0`
    try:
        out = subprocess.run([GPUSCHED, "--socket", daemon.socket, "queue"], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert out.returncode == 141, out.stderr
    assert out.stderr == "", out.stderr
    with open("/dev/full", "w") as full:
        out = subprocess.run([GPUSCHED, "--socket", daemon.socket, "queue"], stdout=full, stderr=subprocess.PIPE,
                             text=True, timeout=60)
    assert out.returncode == 1 and "cannot write the output: No space left on device" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_gpus_drain_of_an_empty_device_is_a_usage_error(daemon: DaemonHandle) -> None:
    result = run(daemon.socket, "gpus", "drain", " ")
    assert result.returncode == 2 and "is empty" in result.stderr, result.stderr


# ---- queue -----------------------------------------------------------------------------------------------


def _spec() -> dict[str, object]:
    return messages.job_spec(argv=["true"], cwd="/tmp", env={}, request=messages.whole(1), name=None,
                             time_limit_s=None, job_class="batch", nice=0, requeue=False, precision=None, after=[],
                             cpus=None, mem_mib=None)


def test_array_rows_count_against_the_limit_and_the_reply_size(daemon: DaemonHandle,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every array became a row whatever --limit said: one user's 6,500 arrays made the reply too
    large to send, for everyone. The reply budget is made small here to get there with 40."""
    from gpusched.daemon import handlers_jobs

    with daemon.client() as c:
        for _ in range(3):
            c.request(messages.submit(_spec(), True))
        for _ in range(40):
            c.request(messages.submit(_spec(), True, array="1-2"))
    result = json.loads(run(daemon.socket, "queue", "--limit", "5", "--json").stdout)
    assert len(result["jobs"]) == 3 and len(result["arrays"]) == 2 and result["arrays_total"] == 40
    text = run(daemon.socket, "queue", "--limit", "5").stdout
    assert "... 38 more not shown" in text, text

    monkeypatch.setattr(handlers_jobs, "REPLY_BUDGET", 4000)  # about a dozen array rows
    result = json.loads(run(daemon.socket, "queue", "--json").stdout)
    assert len(result["jobs"]) == 3 and 0 < len(result["arrays"]) < 40 and result["arrays_total"] == 40
    assert len(json.dumps(result, separators=(",", ":"))) < 4000 + 100  # the rows within it, plus the envelope


def test_order_fairness_lists_held_and_waiting_jobs_after_those_the_scheduler_will_start(
    daemon: DaemonHandle,
) -> None:
    def submit(*args: str) -> int:
        result = run(daemon.socket, "submit", "--json", *args)
        assert result.returncode == 0, result.stderr
        return int(json.loads(result.stdout)["job_id"])

    running = submit("--gpus", "2", "sleep", "60")
    wait_until(lambda: json.loads(run(daemon.socket, "show", str(running), "--json").stdout)["job"]["state"]
               == "RUNNING", what="the 2-GPU job to run")
    held = submit("--gpus", "1", "--hold", "true")
    dependent = submit("--gpus", "1", "--after", str(running), "true")
    following = submit("--gpus", "1", "true")  # the one the scheduler starts next
    ids = [j["id"] for j in json.loads(run(daemon.socket, "queue", "--order", "fairness", "--json").stdout)["jobs"]]
    run(daemon.socket, "cancel", str(running), str(following), str(held), str(dependent))
    assert ids == [running, following, held, dependent], ids


# ---- which daemon, and a submit across a restart --------------------------------------------------------


def test_a_stale_default_socket_does_not_hide_a_live_one(tmp_path: object) -> None:
    if os.path.exists("/run/gpusched/gpusched.sock"):
        pytest.skip("this machine runs a system gpuschedd: the first default socket is taken")
    uid = 400000 + os.getpid() % 100000  # nobody's: the fallback /tmp/gpusched-UID is ours to make
    runtime = short_tmpdir()
    fallback_dir = f"/tmp/gpusched-{uid}"
    os.makedirs(os.path.join(runtime, "gpusched"))
    os.makedirs(fallback_dir)
    stale_path = os.path.join(runtime, "gpusched", "gpusched.sock")
    live_path = os.path.join(fallback_dir, "gpusched.sock")
    stale, live = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    try:
        stale.bind(stale_path)  # bound, never listening: what a killed daemon leaves
        live.bind(live_path)
        live.listen()
        env = {"XDG_RUNTIME_DIR": runtime}
        assert resolve_socket(None, env, uid) == live_path
        live.close()
        assert resolve_socket(None, env, uid) == stale_path  # none answers: the first that exists is named
    finally:
        stale.close()
        live.close()
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(fallback_dir, ignore_errors=True)


PYTHON_PROGRAM = [sys.executable, "-P", "-c", "from gpusched_cli.fastpath import main; main()"]


@pytest.mark.parametrize("program", [[GPUSCHED], PYTHON_PROGRAM], ids=["installed", "python"])
@pytest.mark.parametrize("read_hello", [False, True], ids=["reset", "eof"])
def test_submit_retries_a_connection_that_breaks_during_the_hello(program: list[str], read_hello: bool) -> None:
    """The retry covered a request whose answer was lost, not a daemon killed during the hello; and
    the C front (the installed `gpusched` where a compiler was found) ran the Python program afresh
    after a broken hello, which took the socket its daemon was restarting on for one never there.

    The daemon is gone before it can answer: closing with the hello unread (the client sees a reset
    or a broken pipe), or after reading it (a plain end of file); its socket is missing until the
    new daemon binds it, as in a restart."""
    base = short_tmpdir()
    path = os.path.join(base, "g.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    handle = DaemonHandle(socket=path, state_dir=os.path.join(base, "state"), sim="H100-80GB:1",
                          overrides={"allow_root_jobs": True, "cgroup_root": "off", "tick_s": 0.2})

    def break_then_serve() -> None:
        conn, _ = listener.accept()
        if read_hello:
            header = conn.recv(4, socket.MSG_WAITALL)
            conn.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL)
        conn.close()
        listener.close()
        os.unlink(path)
        handle.start()

    server = threading.Thread(target=break_then_serve)
    server.start()
    try:
        result = subprocess.run([*program, "--socket", path, "submit", "--gpus", "1", "--hold", "--json", "true"],
                                capture_output=True, text=True, timeout=60)
        server.join(30)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["state"] == "HELD"
        assert len(json.loads(run(path, "queue", "--json").stdout)["jobs"]) == 1  # queued once
    finally:
        server.join(30)
        handle.stop()
        shutil.rmtree(base, ignore_errors=True)


# ---- stats ------------------------------------------------------------------------------------------------


def test_a_user_whose_jobs_were_only_held_has_no_entitled_share() -> None:
    def job(job_id: int, user: str, history: list[tuple[JobState, float]], alloc: bool = False) -> Job:
        spec = JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1))
        return Job(id=job_id, uid=1000 + job_id, gid=1000, user=user, spec=spec, state=history[-1][0],
                   submitted_at=history[0][1], history=[Transition(state=s, at=t, reason="") for s, t in history])

    held_only = job(1, "bob", [(JobState.PENDING, 100.0), (JobState.HELD, 100.0), (JobState.CANCELLED, 200.0)])
    waited = job(2, "carol", [(JobState.PENDING, 100.0), (JobState.HELD, 150.0), (JobState.CANCELLED, 200.0)])
    stats = {s.user: s for s in user_stats([held_only, waited], 0.0, 1000.0, lambda _u: 100.0)}
    assert set(stats) == {"carol"}  # carol's job was runnable for 50 s; bob's never was
