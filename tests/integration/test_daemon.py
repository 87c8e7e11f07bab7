"""The real daemon on a real socket, driven by the real client: the foundation's end-to-end paths."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from gpusched.model import JobSpec, JobState, MigRequest, WholeRequest
from gpusched.protocol import (
    MAX_FRAME,
    PROTOCOL_VERSION,
    CancelRequest,
    CancelResult,
    ErrorCode,
    GpusRequest,
    GpusResult,
    HelloRequest,
    LogsRequest,
    LogsResult,
    ProtocolError,
    QueueRequest,
    QueueResult,
    ShowRequest,
    ShowResult,
    SubmitRequest,
    SubmitResult,
    WaitRequest,
    WaitResult,
    decode_body,
    encode_frame,
)
from gpusched_cli.client import Client, DaemonUnavailable
from tests.conftest import DaemonHandle, DaemonProcess, wait_until


def spec(*argv: str, gpus: int = 1, **kw: object) -> JobSpec:
    return JobSpec(argv=list(argv), cwd=os.getcwd(), env={"PATH": os.environ["PATH"]},
                   request=WholeRequest(gpus=gpus), **kw)  # type: ignore[arg-type]


def submit(c: Client, s: JobSpec) -> int:
    return c.call(SubmitRequest(spec=s), SubmitResult).job_id


def wait_done(c: Client, job_id: int, timeout: float = 20.0) -> WaitResult:
    deadline = time.monotonic() + timeout
    while True:
        res = c.call(WaitRequest(job_id=job_id, timeout_s=min(5.0, max(0.1, deadline - time.monotonic()))),
                     WaitResult)
        if res.finished:
            return res
        assert time.monotonic() < deadline, f"job {job_id} still {res.job.state} after {timeout}s"


def state_of(c: Client, job_id: int) -> JobState:
    return c.call(ShowRequest(job_id=job_id), ShowResult).job.state


def test_job_runs_with_its_allocation_and_records_exit_code(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sh", "-c", 'echo "hi $GPUSCHED_JOB_ID $CUDA_VISIBLE_DEVICES"; echo err >&2; exit 3',
                                name="hello"))
        res = wait_done(c, job_id)
        assert res.job.state is JobState.FAILED
        assert res.job.exit_code == 3
        assert res.job.reason == "exit code 3"
        assert [t.state for t in res.job.history] == [
            JobState.PENDING, JobState.STARTING, JobState.RUNNING, JobState.FAILED]
        assert res.job.allocation is not None
        uuid = res.job.allocation.uuids[0]
        assert uuid.startswith("GPU-")
        out = c.call(LogsRequest(job_id=job_id), LogsResult)
        assert out.data == f"hi {job_id} {uuid}\nerr\n"
        assert out.eof


def test_successful_job_completes(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("true"))
        res = wait_done(c, job_id)
        assert (res.job.state, res.job.exit_code, res.job.reason) == (JobState.COMPLETED, 0, "exit code 0")


def test_job_that_cannot_start_fails_with_the_os_error(daemon: DaemonHandle, tmp_path: object) -> None:
    with daemon.client() as c:
        missing = submit(c, spec("/nonexistent/program"))
        bad_cwd = submit(c, spec("true").model_copy(update={"cwd": "/nonexistent-dir"}))
        res = wait_done(c, missing)
        assert res.job.state is JobState.FAILED
        assert "exec /nonexistent/program: No such file or directory" in res.job.reason
        res = wait_done(c, bad_cwd)
        assert res.job.state is JobState.FAILED
        assert "chdir /nonexistent-dir: No such file or directory" in res.job.reason


def test_jobs_queue_when_gpus_are_busy_and_run_in_order(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        blocker = submit(c, spec("sleep", "30", gpus=2))
        wait_until(lambda: state_of(c, blocker) is JobState.RUNNING, what="blocker running")
        queued = [submit(c, spec("true")) for _ in range(3)]
        rows = {r.id: r for r in c.call(QueueRequest(), QueueResult).jobs}
        assert [rows[j].state for j in queued] == [JobState.PENDING] * 3
        show = c.call(ShowRequest(job_id=queued[0]), ShowResult)
        assert show.waiting_reason
        c.call(CancelRequest(job_ids=[blocker]), CancelResult)
        ends = [wait_done(c, j).job for j in queued]
        assert all(j.state is JobState.COMPLETED for j in ends)
        assert wait_done(c, blocker).job.state is JobState.CANCELLED
        everything = {r.id: r.state for r in c.call(QueueRequest(all=True), QueueResult).jobs}
        assert everything[blocker] is JobState.CANCELLED
        assert not c.call(QueueRequest(), QueueResult).jobs  # nothing pending or running


def test_cancel_kills_a_job_that_ignores_sigterm(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done"))
        wait_until(lambda: c.call(LogsRequest(job_id=job_id), LogsResult).data == "ready\n", what="job ready")
        started = time.monotonic()
        assert c.call(CancelRequest(job_ids=[job_id]), CancelResult).cancelled == [job_id]
        res = wait_done(c, job_id)
        assert res.job.state is JobState.CANCELLED
        assert res.job.signal == 9
        assert time.monotonic() - started >= 1.5  # it got its grace period (2 s in tests) first


def test_cancel_pending_job_and_unknown_job(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        blocker = submit(c, spec("sleep", "30", gpus=2))
        pending = submit(c, spec("true"))
        res = c.call(CancelRequest(job_ids=[pending]), CancelResult)
        assert res.cancelled == [pending]
        assert state_of(c, pending) is JobState.CANCELLED
        assert c.call(CancelRequest(job_ids=[pending]), CancelResult).already_finished == [pending]
        with pytest.raises(ProtocolError) as err:
            c.call(CancelRequest(job_ids=[blocker, 999]), CancelResult)
        assert err.value.code is ErrorCode.NOT_FOUND
        assert state_of(c, blocker) is not JobState.CANCELLED  # all-or-nothing
        c.call(CancelRequest(job_ids=[blocker]), CancelResult)


def test_time_limit_ends_job_as_timeout(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "30", time_limit_s=0.5))
        res = wait_done(c, job_id)
        assert res.job.state is JobState.TIMEOUT
        assert "time limit" in res.job.reason


def test_unsatisfiable_requests_are_refused_with_what_the_node_has(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        with pytest.raises(ProtocolError) as err:
            submit(c, spec("true", gpus=3))
        assert err.value.code is ErrorCode.UNSATISFIABLE
        assert "2 GPU(s)" in err.value.message
        with pytest.raises(ProtocolError) as err:
            submit(c, spec("true").model_copy(update={"request": MigRequest(profile="3g.40gb")}))
        assert err.value.code is ErrorCode.UNSATISFIABLE
        assert "3g.40gb" in err.value.message
        assert c.call(QueueRequest(all=True), QueueResult).jobs == []  # nothing was stored


def test_gpus_lists_simulated_devices_and_who_runs_where(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        job_id = submit(c, spec("sleep", "30"))
        wait_until(lambda: state_of(c, job_id) is JobState.RUNNING, what="job running")
        res = c.call(GpusRequest(), GpusResult)
        assert res.backend == "sim"
        assert [g.model for g in res.gpus] == ["H100-80GB", "H100-80GB"]
        assert len({g.uuid for g in res.gpus}) == 2
        assert sorted(j for g in res.gpus for j in g.jobs) == [job_id]
        assert all(g.memory_total_mib > 80_000 and not g.mig_enabled for g in res.gpus)
        c.call(CancelRequest(job_ids=[job_id]), CancelResult)


def test_version_mismatch_names_both_versions(daemon: DaemonHandle) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        reply = _roundtrip(s, HelloRequest(version="99.0").model_dump())
    assert reply["ok"] is False
    assert reply["error"]["code"] == "version_mismatch"
    assert PROTOCOL_VERSION in reply["error"]["message"] and "99.0" in reply["error"]["message"]


def test_bad_frames_get_errors_and_the_daemon_keeps_serving(daemon: DaemonHandle) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        assert _roundtrip(s, {"op": "queue"})["error"]["code"] == "hello_required"
        assert _roundtrip(s, HelloRequest(version=PROTOCOL_VERSION).model_dump())["ok"] is True
        s.sendall(struct.pack(">I", 5) + b"\xff\xfe{}x")
        assert _read(s)["error"]["code"] == "bad_frame"
        s.sendall(struct.pack(">I", 2) + b"[]")
        assert "JSON object" in _read(s)["error"]["message"]
        reply = _roundtrip(s, {"op": "submit", "spec": {"argv": [], "cwd": "/", "request": {"kind": "whole"}}})
        assert reply["error"]["code"] == "bad_request"
        assert "spec.argv" in reply["error"]["message"] and "spec.request.gpus" in reply["error"]["message"]
        assert _roundtrip(s, {"op": "queue"})["ok"] is True  # same connection still usable
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        s.sendall(struct.pack(">I", MAX_FRAME + 1))
        assert _read(s)["error"]["code"] == "bad_frame"
        assert s.recv(1) == b""  # closed: the stream cannot be trusted after an oversize header
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        s.sendall(b"\x00\x00")  # a client that dies mid-header
    with daemon.client() as c:
        assert c.call(QueueRequest(), QueueResult).jobs == []


def test_client_reports_a_missing_daemon_with_the_socket_path(tmp_path: object) -> None:
    path = "/tmp/gpusched-test-no-such-daemon.sock"
    with pytest.raises(DaemonUnavailable) as err:
        Client(path).connect()
    assert path in err.value.message and "gpuschedd --sim" in err.value.hint


def test_second_daemon_on_same_socket_is_refused(daemon: DaemonHandle) -> None:
    import asyncio

    from gpusched.config import DaemonConfig
    from gpusched.daemon.main import StartupError, start

    config = DaemonConfig(socket=daemon.socket, state_dir=daemon.state_dir + "-2", sim="H100-80GB:1")
    with pytest.raises(StartupError, match="already listening"):
        asyncio.run(start(config))
    with daemon.client() as c:  # the first one is untouched
        assert c.call(QueueRequest(), QueueResult).jobs == []


def test_restart_keeps_pending_jobs_in_order_with_history(daemon: DaemonHandle) -> None:
    with daemon.client() as c:
        blocker = submit(c, spec("sleep", "60", gpus=2))
        wait_until(lambda: state_of(c, blocker) is JobState.RUNNING, what="blocker running")
        pending = [submit(c, spec("true", name=f"p{i}")) for i in range(3)]
    daemon.restart()
    with daemon.client() as c:
        rows = c.call(QueueRequest(), QueueResult).jobs
        assert [r.id for r in rows] == [blocker, *pending]
        assert rows[0].state is JobState.RUNNING  # re-adopted, still running under its shim
        show = c.call(ShowRequest(job_id=pending[0]), ShowResult).job
        assert [t.state for t in show.history] == [JobState.PENDING]
        c.call(CancelRequest(job_ids=[blocker]), CancelResult)
        assert wait_done(c, blocker).job.state is JobState.CANCELLED
        assert all(wait_done(c, j).job.state is JobState.COMPLETED for j in pending)


def test_kill_9_daemon_then_restart_recovers_everything(daemon_process: object) -> None:
    proc: DaemonProcess = daemon_process()  # type: ignore[operator]
    proc.start()
    with Client(proc.socket) as c:
        survivor = submit(c, spec("sh", "-c", "sleep 1.5; exit 7"))
        wait_until(lambda: state_of(c, survivor) is JobState.RUNNING, what="survivor running")
        finisher = submit(c, spec("sh", "-c", "exit 0"))
        wait_until(lambda: state_of(c, finisher) in (JobState.RUNNING, JobState.COMPLETED), what="finisher")
        pending = [submit(c, spec("true", gpus=2)) for _ in range(2)]
    proc.kill9()
    proc.start()
    with Client(proc.socket) as c:
        assert wait_done(c, survivor).job.exit_code == 7
        assert wait_done(c, survivor).job.state is JobState.FAILED
        assert wait_done(c, finisher).job.state is JobState.COMPLETED
        for job_id in pending:
            assert wait_done(c, job_id).job.state is JobState.COMPLETED
    assert proc.terminate() == 0


def _roundtrip(s: socket.socket, message: dict[str, object]) -> dict[str, object]:
    s.sendall(encode_frame(message))
    return _read(s)


def _read(s: socket.socket) -> dict:  # type: ignore[type-arg]
    header = _recv(s, 4)
    return decode_body(_recv(s, struct.unpack(">I", header)[0]))


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "connection closed"
        buf += chunk
    return buf


def test_jobs_are_handed_to_the_scheduler_in_the_order_they_started(daemon: DaemonHandle) -> None:
    """A job started after one with a higher id comes after it in the snapshot, and the scheduler
    keeps its placement view instead of building a new one (core/cluster_sync.py needs the jobs
    that stay in the order it applied them; listed by id, this start made it rebuild), also across
    inventory ticks that read the same GPUs again."""
    from gpusched.protocol import JobsChanged, ReleaseRequest

    engine = lambda: daemon.daemon.engine  # noqa: E731
    with daemon.client() as c:
        first = c.call(SubmitRequest(spec=spec("sleep", "600"), hold=True), SubmitResult).job_id
        second = submit(c, spec("sleep", "600"))
        wait_until(lambda: state_of(c, second) is JobState.RUNNING, what="the second job running")
        view = daemon.call_in_loop(lambda: engine().scheduler._live)
        c.call(ReleaseRequest(job_ids=[first]), JobsChanged)
        wait_until(lambda: state_of(c, first) is JobState.RUNNING, what="the first job running")
        assert daemon.call_in_loop(lambda: [j.id for j in engine().snapshot().active]) == [second, first]
        third = submit(c, spec("sleep", "600"))  # no GPU left: another pass over the same view
        ticks = daemon.call_in_loop(lambda: engine().passes)
        wait_until(lambda: daemon.call_in_loop(lambda: engine().passes) > ticks + 2, timeout=30,
                   what="passes after inventory ticks")
        assert daemon.call_in_loop(lambda: engine().scheduler._live) is view
        c.call(CancelRequest(job_ids=[first, second, third]), CancelResult)
