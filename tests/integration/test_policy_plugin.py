"""gpuschedd on a site's policy (docs/policies.md): the example plug-in runs jobs end to end, `show`
and `queue --order fairness` answer without the capabilities it lacks, a policy that does not load
stops the start (exit 2, naming scheduler.policy), and a reload cannot switch policies."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpusched.model import JobSpec, JobState, WholeRequest
from gpusched.policy import NO_EXPLANATION
from gpusched.protocol import (
    CancelRequest,
    CancelResult,
    QueueRequest,
    QueueResult,
    ShowRequest,
    ShowResult,
    SubmitRequest,
    SubmitResult,
    WaitRequest,
    WaitResult,
)
from tests.conftest import DaemonHandle, DaemonProcess, short_tmpdir, wait_until

EXAMPLES = str(Path(__file__).resolve().parents[2] / "docs" / "examples")
EXAMPLE = "smallest_first:SmallestFirst"


def _spec(*argv: str, gpus: int = 1) -> JobSpec:
    return JobSpec(argv=list(argv), cwd="/tmp", request=WholeRequest(gpus=gpus), env={"PATH": os.environ["PATH"]})


@pytest.fixture
def plugin_daemon(daemon_factory: Callable[..., DaemonHandle], monkeypatch: pytest.MonkeyPatch) -> DaemonHandle:
    monkeypatch.syspath_prepend(EXAMPLES)
    return daemon_factory("H100-80GB:2", scheduler={"policy": EXAMPLE, "policy_options": {"max_wait_s": 600.0}})


def test_the_example_policy_runs_jobs_and_show_and_queue_do_without_what_it_lacks(
        plugin_daemon: DaemonHandle) -> None:
    assert plugin_daemon.daemon is not None
    assert type(plugin_daemon.daemon.engine.scheduler).__name__ == "SmallestFirst"
    with plugin_daemon.client() as c:
        ids = [c.call(SubmitRequest(spec=_spec("sleep", "30")), SubmitResult).job_id for _ in range(2)]
        waiting = c.call(SubmitRequest(spec=_spec("true")), SubmitResult).job_id
        wait_until(lambda: all(c.call(ShowRequest(job_id=i), ShowResult).job.state is JobState.RUNNING for i in ids),
                   timeout=20, what="both sleepers running")
        shown = c.call(ShowRequest(job_id=waiting), ShowResult)
        assert shown.job.state is JobState.PENDING
        assert shown.waiting_reason is not None and NO_EXPLANATION in shown.waiting_reason, shown.waiting_reason
        assert shown.estimate is None  # the policy makes no estimates
        rows = c.call(QueueRequest(order="fairness"), QueueResult).jobs
        assert [r.id for r in rows] == sorted(r.id for r in rows) and waiting in [r.id for r in rows]
        c.call(CancelRequest(job_ids=ids), CancelResult)  # the waiting job gets a GPU
        done = c.call(WaitRequest(job_id=waiting, timeout_s=30), WaitResult)
        assert done.finished and (done.job.state, done.job.exit_code) == (JobState.COMPLETED, 0), done.job


def _start(policy_line: str, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    base = short_tmpdir()
    cfg = os.path.join(base, "g.toml")
    with open(cfg, "w") as f:
        f.write(f'cgroup_root = "off"\n[scheduler]\n{policy_line}\n')
    try:
        res = subprocess.run([sys.executable, "-m", "gpusched.daemon.main", "--config", cfg, "--sim", "H100-80GB:1",
                              "--socket", os.path.join(base, "g.sock"), "--state-dir", os.path.join(base, "st")],
                             capture_output=True, text=True, timeout=20, env={**os.environ, **(env or {})})
        return res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as exc:
        return None, str(exc.stdout or "") + str(exc.stderr or "")
    finally:
        subprocess.run(["rm", "-rf", base], check=False)


@pytest.mark.parametrize(("line", "problem"), [
    ('policy = "fifo"', "'fifo' is neither a built-in policy"),
    ('policy = "no_such_site_module_xyz:Policy"', "cannot import module 'no_such_site_module_xyz'"),
    ('policy = "smallest_first:Missing"', "module 'smallest_first' has no attribute 'Missing'"),
    ('policy = "fifo-whole"', "'fifo-whole' is a replay baseline only"),
    ('policy = "smallest_first:SmallestFirst"\npolicy_options = { max_wait_s = "soon" }',
     "could not be constructed: ValueError"),
])
def test_a_policy_that_does_not_load_stops_the_start(line: str, problem: str) -> None:
    rc, out = _start(line, {"PYTHONPATH": EXAMPLES})
    assert rc == 2, f"gpuschedd accepted it (rc={rc}): {out[-800:]}"
    assert "scheduler.policy" in out and problem in out and "Traceback" not in out, out[-800:]


def test_a_reload_checks_a_new_policy_and_keeps_the_running_one(
        daemon_process: Callable[..., DaemonProcess]) -> None:
    class WithExamples(DaemonProcess):
        def environment(self) -> dict[str, str] | None:
            return {**os.environ, "PYTHONPATH": EXAMPLES}

    proc = daemon_process("H100-80GB:1", cls=WithExamples)
    proc.extra_config = f'[scheduler]\npolicy = "{EXAMPLE}"\n'
    proc.start()
    gpusched = os.path.join(os.path.dirname(sys.executable), "gpusched")

    def reload() -> subprocess.CompletedProcess[str]:
        return subprocess.run([gpusched, "--socket", proc.socket, "admin", "reload"], capture_output=True,
                              text=True, timeout=20)

    proc.write_config('[scheduler]\npolicy = "no_such_site_module_xyz:Policy"\n')
    bad = reload()
    assert bad.returncode == 1 and "scheduler.policy: cannot import module" in bad.stderr, bad.stderr
    proc.write_config('[scheduler]\npolicy = "gpusched"\n')
    moved = reload()
    assert moved.returncode == 0 and "scheduler.policy" in moved.stdout + moved.stderr, moved.stdout
    job = subprocess.run([gpusched, "--socket", proc.socket, "submit", "--gpus", "1", "--wait", "--", "true"],
                         capture_output=True, text=True, timeout=30)
    assert job.returncode == 0, job.stderr  # still served, by the policy it started with
    assert "policy smallest-first" in proc.log()
