"""The real CLI (click's CliRunner, or the program as a process) against the real daemon.

Every check goes through the socket and the protocol, as a user's would; waits poll with a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from click.testing import CliRunner, Result

from gpusched.model import TERMINAL_STATES, JobState
from gpusched.protocol import (
    PROTOCOL_VERSION,
    GpusResult,
    JobSummary,
    QueueRequest,
    QueueResult,
    ShowRequest,
    ShowResult,
    json_schema,
)
from gpusched_cli import client as client_module
from gpusched_cli.main import EXIT_JOB_CANCELLED, EXIT_JOB_TIMEOUT, cli
from tests.conftest import DaemonHandle, wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def node(daemon_factory: Callable[..., DaemonHandle]) -> DaemonHandle:
    """The real daemon on two simulated H100-80GB; root may submit (tests often run as root in CI)."""
    return daemon_factory(allow_root_jobs=os.geteuid() == 0)


def gs(node: DaemonHandle | str, *args: str, env: dict[str, str] | None = None) -> Result:
    path = node if isinstance(node, str) else node.socket
    return CliRunner().invoke(cli, ["--socket", path, *args], env=env, catch_exceptions=False)


def submit(node: DaemonHandle, *args: str) -> int:
    result = gs(node, "submit", "--json", *args)
    assert result.exit_code == 0, result.output
    return int(json.loads(result.stdout)["job_id"])


def state_of(node: DaemonHandle, job_id: int) -> JobState:
    with node.client() as c:
        return c.call(ShowRequest(job_id=job_id), ShowResult).job.state


def wait_state(node: DaemonHandle, job_id: int, states: set[JobState] | frozenset[JobState]) -> JobState:
    return wait_until(lambda: (s := state_of(node, job_id)) in states and s, timeout=20,
                      what=f"job {job_id} to reach one of {sorted(states)}")


def _schema_for(name: str) -> dict[str, Any]:
    schema = json_schema()
    return {**schema["results"][name], "$defs": schema["$defs"]}


# ---- no daemon needed ----------------------------------------------------------------------------


def test_daemon_not_running_exits_3_and_names_the_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "nothing.sock")
    result = gs(path, "queue")
    assert result.exit_code == 3
    assert f"error: gpuschedd is not running: socket {path} does not exist" in result.stderr
    assert "hint:" in result.stderr and f"gpuschedd --sim H100-80GB:2 --socket {path}" in result.stderr
    assert result.stdout == ""


def test_socket_comes_from_the_environment(tmp_path: Path) -> None:
    path = str(tmp_path / "env.sock")
    result = CliRunner().invoke(cli, ["gpus"], env={"GPUSCHED_SOCKET": path})
    assert result.exit_code == 3
    assert path in result.stderr


def test_stale_socket_exits_3() -> None:
    base = Path(os.path.join("/tmp", f"gs-stale-{os.getpid()}"))
    base.mkdir(exist_ok=True)
    path = str(base / "g.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)  # bound but never listening: what a crashed daemon leaves behind
        result = gs(path, "queue")
        assert result.exit_code == 3
        assert "stale socket" in result.stderr
    finally:
        sock.close()
        os.unlink(path)
        base.rmdir()


def test_version_and_help_document_exit_codes() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.startswith("gpusched ") and "(protocol 1." in result.stdout
    help_text = CliRunner().invoke(cli, ["--help"]).stdout
    for line in ("3  daemon not running", "4  no such job", "5  permission denied", "6  request can never",
                 "7  client and daemon protocol versions differ", "124    the job hit its time limit"):
        assert line in help_text


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "choose exactly one of --gpus N, --mig PROFILE or --share F --gpu-mem SIZE (got none)"),
        (["--gpus", "1", "--mig", "1g.10gb"], "(got --gpus and --mig)"),
        (["--share", "0.5"], "--share F needs --gpu-mem SIZE"),
        (["--gpus", "1", "--gpu-mem", "10G"], "--gpu-mem SIZE goes with --share F"),
        (["--share", "0.5", "--gpu-mem", "10X"], "'--gpu-mem': '10X' is not a size"),
        (["--share", "1.5", "--gpu-mem", "1G"], "'--share': '1.5' must be more than 0 and at most 1"),
        (["--share", "half", "--gpu-mem", "1G"], "'--share': 'half' is not a fraction"),
        (["--gpus", "0"], "'--gpus'"),
        (["--gpus", "1", "--time", "soon"], "'--time': 'soon' is not a time limit"),
        (["--gpus", "1", "--time", "366d"], "'--time': '366d' is longer than 365 days; leave --time out"),
        (["--gpus", "1", "--time", "99999999999999999999d"], "'--time': '99999999999999999999d' is longer than 365"),
        (["--mig", "3g"], "'--mig': '3g' is not a MIG profile"),
        (["--gpus", "1", "--nice", "20"], "'--nice'"),
        (["--gpus", "1", "--class", "urgent"], "'--class'"),
        (["--partition", "tpx"], "'--partition': 'tpx' is not one of 'spx', 'dpx', 'qpx', 'cpx'"),
        (["--partition", "cpx", "--mig", "1g.10gb"], "--partition MODE goes alone or with --gpus N (got it with"),
    ],
)
def test_submit_usage_errors_exit_2_and_name_the_flag(tmp_path: Path, args: list[str], needle: str) -> None:
    # The socket does not exist: a usage error must be reported before any attempt to connect.
    result = gs(str(tmp_path / "none.sock"), "submit", *args, "--", "true")
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.stderr.split()), result.stderr


def test_partition_flag_builds_a_partition_request_with_gpus_as_its_count() -> None:
    from gpusched_cli.commands.submit import build_request

    assert build_request(None, None, None, None, "cpx") == {"kind": "partition", "mode": "CPX", "gpus": 1}
    assert build_request(2, None, None, None, "QPX") == {"kind": "partition", "mode": "QPX", "gpus": 2}


def test_partition_request_on_an_nvidia_node_is_refused_with_the_reason(node: DaemonHandle) -> None:
    result = gs(node, "submit", "--partition", "cpx", "--", "true")
    assert result.exit_code == 6, result.output
    assert "no partitions on NVIDIA; use --mig" in " ".join(result.stderr.split())


def test_submit_needs_a_command(tmp_path: Path) -> None:
    result = gs(str(tmp_path / "none.sock"), "submit", "--gpus", "1")
    assert result.exit_code == 2
    assert "CMD" in result.stderr


# ---- against the daemon --------------------------------------------------------------------------


def test_submit_sends_argv_cwd_env_and_options(node: DaemonHandle, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    result = gs(node, "submit", "--gpus", "1", "--name", "probe", "--time", "1:30", "--class", "interactive",
                "--nice", "3", "--requeue", "--precision", "bf16", "true", "--not-an-option", "a b",
                env={"GS_MARKER": "42"})
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Submitted job ")
    job_id = int(result.stdout.split()[-1])
    shown = gs(node, "show", "--json", str(job_id))
    assert shown.exit_code == 0
    data = json.loads(shown.stdout)
    jsonschema.validate(data, _schema_for("show"))
    spec = ShowResult.model_validate(data).job.spec
    assert spec.argv == ["true", "--not-an-option", "a b"]
    assert spec.cwd == str(tmp_path)
    assert spec.env["GS_MARKER"] == "42"
    assert spec.name == "probe"
    assert spec.time_limit_s == 90
    assert (spec.job_class, spec.nice, spec.requeue, spec.precision) == ("interactive", 3, True, "bf16")


def test_submit_json_queue_and_show(node: DaemonHandle) -> None:
    result = gs(node, "submit", "--json", "--gpus", "2", "--name", "big", "--", "sleep", "30")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"job_id": 1, "state": "PENDING"}
    wait_state(node, 1, {JobState.RUNNING})

    queue_json = gs(node, "queue", "--json")
    assert queue_json.exit_code == 0
    data = json.loads(queue_json.stdout)
    jsonschema.validate(data, _schema_for("queue"))
    assert list(data) == ["jobs", "total"] and data["total"] == 1  # `arrays` only when there are some
    (row,) = data["jobs"]
    assert set(row) == set(JobSummary.model_fields) - {"array_id", "array_task"}  # those only on array tasks
    assert (row["id"], row["name"], row["state"], row["request"]) == (1, "big", "RUNNING", "gpus=2")
    assert len(row["devices"]) == 2

    table = gs(node, "queue").stdout.splitlines()
    assert table[0].split() == ["ID", "NAME", "USER", "STATE", "REQUEST", "DEVICES", "WAIT/RUNTIME", "REASON"]
    assert table[1].split()[:6] == ["1", "big", row["user"], "RUNNING", "gpus=2", "gpu0,gpu1"]

    shown = gs(node, "show", "1")
    assert shown.exit_code == 0
    text = shown.stdout
    assert text.startswith("Job 1 (big)  RUNNING")
    assert "command     sleep 30" in text
    assert "request     gpus=2" in text
    assert "(GPU 0)" in text and "(GPU 1)" in text
    assert "History:" in text and "PENDING" in text and "submitted" in text

    gs(node, "cancel", "1")
    wait_state(node, 1, TERMINAL_STATES)
    assert gs(node, "queue").stdout.strip() == "No jobs."
    assert "CANCELLED" in gs(node, "queue", "--all").stdout
    assert gs(node, "queue", "--all", "--user", "no-such-user").stdout.strip() == "No jobs."


def test_pending_job_shows_why_it_waits(node: DaemonHandle) -> None:
    first = submit(node, "--gpus", "2", "--", "sleep", "30")
    wait_state(node, first, {JobState.RUNNING})
    second = submit(node, "--gpus", "1", "--", "true")
    shown = json.loads(gs(node, "show", "--json", str(second)).stdout)
    assert shown["job"]["state"] == "PENDING"
    assert shown["waiting_reason"]
    assert f"waiting for  {shown['waiting_reason']}" in gs(node, "show", str(second)).stdout
    result = gs(node, "cancel", str(first), str(second))
    assert result.exit_code == 0
    assert result.stdout.strip() == f"Cancelled jobs {first}, {second}"


def test_unknown_job_exits_4(node: DaemonHandle) -> None:
    for args in (["show", "99"], ["logs", "99"], ["cancel", "99"], ["logs", "-f", "99"]):
        result = gs(node, *args)
        assert result.exit_code == 4, (args, result.output)
        assert "error: no job 99" in result.stderr
        assert "hint:" in result.stderr


def test_cancel_reports_already_finished_and_is_all_or_nothing(node: DaemonHandle) -> None:
    done = submit(node, "--gpus", "1", "--", "true")
    wait_state(node, done, TERMINAL_STATES)
    running = submit(node, "--gpus", "1", "--", "sleep", "30")
    wait_state(node, running, {JobState.RUNNING})
    assert gs(node, "cancel", str(running), "999").exit_code == 4
    assert state_of(node, running) is JobState.RUNNING  # nothing was cancelled
    result = gs(node, "cancel", str(running), str(done))
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [f"Cancelled job {running}", f"Job {done} had already finished"]
    wait_state(node, running, {JobState.CANCELLED})


def test_unsatisfiable_request_exits_6_and_says_what_the_node_has(node: DaemonHandle) -> None:
    result = gs(node, "submit", "--gpus", "3", "--", "true")
    assert result.exit_code == 6
    assert result.stderr.startswith("error: request can never be satisfied")
    assert "3" in result.stderr and "has 2 GPU(s)" in result.stderr
    assert result.stdout == ""


def test_gpus_human_and_json(node: DaemonHandle) -> None:
    job = submit(node, "--gpus", "1", "--", "sleep", "30")
    wait_state(node, job, {JobState.RUNNING})
    result = gs(node, "gpus", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    jsonschema.validate(data, _schema_for("gpus"))
    gpus = GpusResult.model_validate(data)
    assert [g.index for g in gpus.gpus] == [0, 1]
    assert {g.model for g in gpus.gpus} == {"H100-80GB"}
    assert sorted(j for g in gpus.gpus for j in g.jobs) == [job]

    text = gs(node, "gpus").stdout
    assert "GPU 0  H100-80GB" in text and "GPU 1  H100-80GB" in text
    assert gpus.gpus[0].uuid in text
    assert "MIG off" in text and "health ok" in text
    assert f"jobs: {job} (" in text and "jobs: idle" in text


def test_logs_are_verbatim(node: DaemonHandle) -> None:
    script = r"printf 'plain\n\033[31mred\033[0m\nzürich 训练\n'; echo to-stderr >&2"
    job = submit(node, "--gpus", "1", "--", "sh", "-c", script)
    wait_state(node, job, TERMINAL_STATES)
    result = gs(node, "logs", str(job))
    assert result.exit_code == 0
    out = result.stdout_bytes
    assert b"plain\n\x1b[31mred\x1b[0m\nz\xc3\xbcrich \xe8\xae\xad\xe7\xbb\x83\n" in out
    assert b"to-stderr\n" in out


def test_logs_follow_until_the_job_ends(node: DaemonHandle) -> None:
    job = submit(node, "--gpus", "1", "--", "sh", "-c", "echo one; sleep 1; echo two")
    result = gs(node, "logs", "-f", str(job))  # returns only once the job has ended
    assert result.exit_code == 0
    assert result.stdout == "one\ntwo\n"
    assert state_of(node, job) in TERMINAL_STATES


def test_logs_of_a_running_job_without_follow_returns_at_once(node: DaemonHandle) -> None:
    job = submit(node, "--gpus", "1", "--", "sh", "-c", "echo started; sleep 30")
    wait_until(lambda: gs(node, "logs", str(job)).stdout == "started\n", timeout=20, what="the first log line")
    assert state_of(node, job) not in TERMINAL_STATES  # STARTING or RUNNING: it printed, it has not ended
    gs(node, "cancel", str(job))


@pytest.mark.parametrize(
    ("script", "status"),
    [("exit 0", 0), ("exit 3", 3), ("exit 255", 255), ("kill -9 $$", 137), ("kill -TERM $$", 143)],
)
def test_submit_wait_exits_with_the_jobs_status(node: DaemonHandle, script: str, status: int) -> None:
    result = gs(node, "submit", "--wait", "--gpus", "1", "--", "sh", "-c", script)
    assert result.exit_code == status, result.output
    assert result.stdout.startswith("Submitted job ")
    assert result.stderr.startswith("Job ")


def test_submit_wait_json(node: DaemonHandle) -> None:
    result = gs(node, "submit", "--wait", "--json", "--gpus", "1", "--", "sh", "-c", "exit 4")
    assert result.exit_code == 4
    first, last = (json.loads(line) for line in result.stdout.splitlines())
    assert first == {"job_id": first["job_id"], "state": "PENDING"}
    assert last == {"job_id": first["job_id"], "state": "FAILED", "exit_code": 4, "signal": None, "exit_status": 4}


def test_submit_wait_time_limit_exits_124(node: DaemonHandle) -> None:
    result = gs(node, "submit", "--wait", "--time", "1s", "--gpus", "1", "--", "sleep", "30")
    assert result.exit_code == EXIT_JOB_TIMEOUT, result.output
    assert "TIMEOUT" in result.stderr


# The CLI as a terminal starts it: with SIGINT at its default. pytest-xdist's workers ignore SIGINT,
# an ignored signal stays ignored across exec, and Python then installs no KeyboardInterrupt handler;
# so it is set back to the default before the CLI's exec (not in a preexec_fn: the test process has
# threads).
_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _cli_process(node: DaemonHandle, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _SIGINT_DEFAULT, "-m", "gpusched_cli.main", "--socket", node.socket, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )


def test_submit_wait_of_a_cancelled_job_exits_122(node: DaemonHandle) -> None:
    proc = _cli_process(node, "submit", "--wait", "--gpus", "1", "--", "sleep", "30")
    try:
        def running_job() -> int | None:
            with node.client() as c:
                jobs = c.call(QueueRequest(), QueueResult).jobs
            return next((j.id for j in jobs if j.state is JobState.RUNNING), None)

        job = wait_until(running_job, timeout=20, what="the waited-for job to run")
        assert gs(node, "cancel", str(job)).exit_code == 0
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == EXIT_JOB_CANCELLED, err
        assert out == f"Submitted job {job}\n"
        assert f"Job {job} CANCELLED" in err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_ctrl_c_while_waiting_leaves_the_job_running(node: DaemonHandle) -> None:
    proc = _cli_process(node, "submit", "--wait", "--gpus", "1", "--", "sleep", "30")
    try:
        assert proc.stdout is not None
        job = int(proc.stdout.readline().split()[-1])
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 130
        assert f"job {job} keeps running" in err
        assert state_of(node, job) not in TERMINAL_STATES
        gs(node, "cancel", str(job))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_version_mismatch_exits_7(node: DaemonHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "PROTOCOL_VERSION", "99.0")
    result = gs(node, "queue")
    assert result.exit_code == 7
    assert "protocol version mismatch" in result.stderr
    assert "99.0" in result.stderr and PROTOCOL_VERSION in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_other_users_job_is_permission_denied(node: DaemonHandle) -> None:
    job = submit(node, "--gpus", "1", "--", "sleep", "30")
    os.chmod(os.path.dirname(node.socket), 0o755)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gpusched_cli.main", "--socket", node.socket, "cancel", str(job)],
            capture_output=True, text=True, cwd="/", user=65534, group=65534, check=False, timeout=60,
            env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'cli'}"},
        )
    except PermissionError as exc:
        gs(node, "cancel", str(job))
        pytest.skip(f"user 65534 cannot run this checkout's Python: {exc}")
    if "ModuleNotFoundError" in proc.stderr or "Permission denied: '" in proc.stderr:
        gs(node, "cancel", str(job))
        pytest.skip(f"user 65534 cannot run the client from this checkout: {proc.stderr[-300:]}")
    assert proc.returncode == 5, proc.stderr
    assert "error:" in proc.stderr and f"job {job}" in proc.stderr
    assert state_of(node, job) is not JobState.CANCELLED
    gs(node, "cancel", str(job))


def test_shutdown_stops_the_daemon(node: DaemonHandle) -> None:
    result = gs(node, "shutdown")
    assert result.exit_code == 0
    assert result.stdout.strip() == "gpuschedd is stopping"
    wait_until(lambda: gs(node, "queue").exit_code == 3, timeout=20, what="the daemon to stop")


def test_hold_release_and_submit_held(node: DaemonHandle) -> None:
    result = gs(node, "submit", "--json", "--hold", "--gpus", "1", "--", "true")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["state"] == "HELD"
    job = data["job_id"]
    released = gs(node, "release", str(job))
    assert released.exit_code == 0
    assert released.stdout.strip() == f"Released job {job}"
    wait_state(node, job, {JobState.COMPLETED})

    blocker = submit(node, "--gpus", "2", "--", "sleep", "30")
    wait_state(node, blocker, {JobState.RUNNING})
    waiting = submit(node, "--gpus", "1", "--", "true")
    held = gs(node, "hold", str(waiting), str(blocker))
    assert held.exit_code == 0
    lines = held.stdout.splitlines()
    assert lines[0] == f"Held job {waiting}"
    assert lines[1].startswith(f"Job {blocker} unchanged: ")
    assert state_of(node, waiting) is JobState.HELD
    assert gs(node, "hold", "999").exit_code == 4
    gs(node, "cancel", str(blocker), str(waiting))


def test_suspend_and_resume(node: DaemonHandle) -> None:
    job = submit(node, "--gpus", "1", "--", "sleep", "30")
    wait_state(node, job, {JobState.RUNNING})
    result = gs(node, "suspend", str(job))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"Suspended job {job}"
    assert state_of(node, job) is JobState.SUSPENDED
    result = gs(node, "resume", str(job))
    assert result.stdout.strip() == f"Resumed job {job}"
    assert state_of(node, job) is JobState.RUNNING
    gs(node, "cancel", str(job))


def test_after_dependency_and_host_limits(node: DaemonHandle) -> None:
    first = submit(node, "--gpus", "1", "--", "sh", "-c", "exit 1")
    second = submit(node, "--gpus", "1", "--after", f"{first}:any", "--cpus", "2", "--mem", "1G", "--", "true")
    spec = ShowResult.model_validate(json.loads(gs(node, "show", "--json", str(second)).stdout)).job.spec
    assert [(d.job_id, d.condition) for d in spec.after] == [(first, "any")]
    assert (spec.cpus, spec.mem_mib) == (2, 1024)
    wait_state(node, second, {JobState.COMPLETED})
    bad = gs(node, "submit", "--gpus", "1", "--after", "soon", "--", "true")
    assert bad.exit_code == 2 and "'--after': 'soon' is not a dependency" in bad.stderr


def test_submit_export_list_sends_only_those_variables(node: DaemonHandle) -> None:
    env = {"KEEP": "yes", "DROP": "no", "PATH": os.environ["PATH"]}
    result = CliRunner().invoke(cli, ["--socket", node.socket, "submit", "--gpus", "1", "--export", "KEEP,EXTRA=1",
                                      "--json", "--", "sh", "-c", "echo ${KEEP}:${DROP}:${EXTRA}"], env=env)
    job_id = int(json.loads(result.stdout)["job_id"])
    wait_state(node, job_id, {JobState.COMPLETED})
    assert gs(node, "logs", str(job_id)).stdout == "yes::1\n"
    with node.client() as c:
        assert c.call(ShowRequest(job_id=job_id), ShowResult).job.spec.env == {"KEEP": "yes", "EXTRA": "1"}
    bad = gs(node, "submit", "--gpus", "1", "--export", "A-B", "--", "true")
    assert bad.exit_code == 2 and "--export" in bad.stderr


def test_queue_order_fairness_lists_pending_jobs_as_the_scheduler_would_start_them(node: DaemonHandle) -> None:
    """The table keeps the daemon's order (it used to re-sort by id): a nice 19 job submitted first
    comes after a nice 0 one, as in --json."""
    blocker = submit(node, "--gpus", "2", "--", "sleep", "60")
    wait_until(lambda: state_of(node, blocker) is JobState.RUNNING, what="blocker running")
    late = submit(node, "--gpus", "1", "--nice", "19", "--", "true")
    early = submit(node, "--gpus", "1", "--", "true")
    ordered = [row["id"] for row in json.loads(gs(node, "queue", "--order", "fairness", "--json").stdout)["jobs"]]
    assert ordered.index(early) < ordered.index(late)
    table = gs(node, "queue", "--order", "fairness").stdout.splitlines()[1:]
    listed = [int(line.split()[0]) for line in table if line.split()[0].isdigit()]
    assert listed == ordered
    assert gs(node, "cancel", str(blocker), str(late), str(early)).exit_code == 0


def test_queue_all_with_a_limit_counts_the_finished_rows_it_leaves_out(node: DaemonHandle) -> None:
    """`total` counts every row that matched, finished ones included, and the table says how many
    were left out (it counted only the finished rows it had fetched, so nothing seemed left out)."""
    done = [submit(node, "--gpus", "1", "--", "true") for _ in range(3)]
    for job_id in done:
        wait_state(node, job_id, TERMINAL_STATES)
    active = [submit(node, "--gpus", "2", "--", "sleep", "60"), submit(node, "--gpus", "2", "--", "true")]
    listing = json.loads(gs(node, "queue", "--all", "--limit", "3", "--json").stdout)
    assert len(listing["jobs"]) == 3 and listing["total"] == 5
    assert "... 2 more not shown" in gs(node, "queue", "--all", "--limit", "3").stdout
    assert gs(node, "cancel", *map(str, active)).exit_code == 0


def test_stats_since_past_the_daemons_bound_names_the_flag(node: DaemonHandle) -> None:
    from gpusched.protocol import StatsRequest
    from gpusched_cli.commands.node import MAX_STATS_WINDOW_S

    bound = StatsRequest.model_fields["since_s"].metadata
    assert any(getattr(m, "le", None) == MAX_STATS_WINDOW_S for m in bound)  # the CLI says the daemon's bound
    result = gs(node, "stats", "--since", "400d")
    assert result.exit_code == 2 and "--since" in result.stderr and "366 days" in result.stderr
    assert gs(node, "stats", "--since", "366d").exit_code == 0


def test_a_value_the_job_model_refuses_is_named_by_its_flag(node: DaemonHandle) -> None:
    too_long = gs(node, "submit", "--gpus", "1", "--name", "n" * 129, "--", "true")
    assert too_long.exit_code == 2 and "'--name'" in too_long.stderr and "128 characters" in too_long.stderr
    huge = gs(node, "submit", "--gpus", "1", "--after", "9" * 20, "--", "true")
    assert huge.exit_code == 2 and "'--after'" in huge.stderr and "is not a job id" in huge.stderr
    assert "pydantic" not in huge.stderr and "validation error" not in huge.stderr


def test_an_empty_program_is_refused_before_it_waits_for_a_gpu(node: DaemonHandle) -> None:
    for empty in ("", "  "):
        result = gs(node, "submit", "--gpus", "1", "--", empty)
        assert result.exit_code == 2 and "the program to run is empty" in result.stderr
