"""What a job sees, from an audit of the job environment and limits (each test failed on the code
before): a submitter's own MPS and array variables reached jobs that are neither; specs execve can
never run, and a --mem memory.max cannot hold, were accepted to fail at launch; a C-locale client
added LC_CTYPE; a uid without a passwd entry got no SHELL; an oversize spec's error was pydantic's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.daemon.test_cgroups import fake_cgroupfs
from tests.integration.test_identity import as_user

CLI_PATH = os.pathsep.join(p for p in sys.path if p)

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "LOST"}


def spec(argv: list[str], env: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    s = {"argv": argv, "cwd": "/tmp", "env": env or {}, "request": {"kind": "whole", "gpus": 1}}
    s.update(kw)
    return s


def submit_raw(d: Any, s: dict[str, Any]) -> dict[str, Any]:
    with d.client() as c:
        return c.raw_call({"op": "submit", "spec": s, "hold": False})


def finished(d: Any, job_id: int) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        with d.client() as c:
            job = c.raw_call({"op": "show", "job_id": job_id})["result"]["job"]
        return job if job["state"] in FINAL else None
    return wait_until(done, timeout=20, what=f"job {job_id} ends")


def log_of(d: Any, job_id: int) -> str:
    with d.client() as c:
        return c.raw_call({"op": "logs", "job_id": job_id})["result"]["data"]


def job_env(d: Any, job_id: int) -> dict[str, str]:
    job = finished(d, job_id)
    assert job["state"] == "COMPLETED", job["reason"]
    out = {}
    for line in log_of(d, job_id).splitlines():
        k, _, v = line.partition("=")
        out[k] = v
    return out


def cli(d: Any, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = CLI_PATH
    return subprocess.run([sys.executable, "-m", "gpusched_cli.main", "--socket", d.socket, *args],
                          env=e, capture_output=True, text=True, timeout=60, cwd="/tmp")


# 1 ------------------------------------------------------------------------------------------------
def test_mps_and_array_variables_of_the_submitter_do_not_reach_a_whole_gpu_job(daemon_factory: Any) -> None:
    """A job submitted from inside an MPS share (or an array task) carried that job's CUDA_MPS_* and
    GPUSCHED_ARRAY_*: the inner whole-GPU job's CUDA would reach another GPU's MPS server."""
    d = daemon_factory()
    inherited = {
        "PATH": "/usr/bin:/bin",
        "CUDA_MPS_PIPE_DIRECTORY": "/var/lib/gpusched/mps/abc/pipe",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
        "GPUSCHED_ARRAY_JOB_ID": "12", "GPUSCHED_ARRAY_TASK_ID": "3", "GPUSCHED_ARRAY_TASK_COUNT": "2",
    }
    r = submit_raw(d, spec(["env"], inherited))
    env = job_env(d, r["result"]["job_id"])
    leaked = sorted(k for k in env if k.startswith(("CUDA_MPS_", "GPUSCHED_ARRAY_")))
    assert leaked == [], f"a whole-GPU, non-array job got {leaked}"


# 2 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    {"env": {"A=B": "x"}},
    {"env": {"": "x"}},
    {"env": {"X": "a\x00b"}},
    {"env": {"X": "x" * 140_000}},                      # one string over MAX_ARG_STRLEN (128 KiB)
    {"argv": ["/bin/sh", "-c", "true", "sh", "z" * 140_000]},
])
def test_a_spec_that_execve_cannot_take_is_refused_at_submit(daemon_factory: Any, bad: dict[str, Any]) -> None:
    """Accepted (ok, PENDING), such a job waited its turn, then ended FAILED 'could not start: exec
    ...: embedded null byte / illegal environment variable name / Argument list too long'."""
    d = daemon_factory()
    s = spec(["/bin/sh", "-c", "true"], {"PATH": "/usr/bin:/bin"})
    s.update(bad)
    r = submit_raw(d, s)
    if r["ok"]:
        job = finished(d, r["result"]["job_id"])
        pytest.fail(f"accepted, then ended {job['state']}: {job['reason']}")
    assert r["error"]["code"] == "bad_request"


# 3 ------------------------------------------------------------------------------------------------
def test_mem_beyond_what_memory_max_can_hold_is_refused_at_submit(daemon_factory: Any, tmp_path: Path) -> None:
    """`--mem 9000000T` was accepted (exit 0), and with cgroups the job failed at its launch."""
    root = fake_cgroupfs(tmp_path / "svc")
    d = daemon_factory(sim="H100-80GB:1", cgroup_root=str(root))
    out = cli(d, "submit", "--gpus", "1", "--mem", "9000000T", "--", "true")
    if out.returncode == 0:
        job_id = int(out.stdout.split()[-1])
        job = finished(d, job_id)
        pytest.fail(f"accepted, then {job['state']}: {job['reason']}")
    assert out.returncode == 2 and "--mem" in out.stderr


# 5 ------------------------------------------------------------------------------------------------
def test_a_c_locale_submitter_does_not_hand_the_job_an_lc_ctype_it_never_had(daemon_factory: Any) -> None:
    """`env -i PATH=... gpusched submit`: Python's locale coercion (PEP 538) puts LC_CTYPE=C.UTF-8 into
    the client's os.environ, and submit sent it as if it were the user's."""
    d = daemon_factory()
    out = cli(d, "submit", "--gpus", "1", "--wait", "--", "env", env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    job_id = int(out.stdout.split()[-1])
    env = dict(line.partition("=")[::2] for line in log_of(d, job_id).splitlines())
    assert "LC_CTYPE" not in env, f"job got LC_CTYPE={env.get('LC_CTYPE')}"


def test_a_submitter_whose_lc_ctype_python_coerced_passes_on_its_own_value(daemon_factory: Any) -> None:
    """PEP 538 also coerces an LC_CTYPE naming no locale (`0`), writing C.UTF-8 over it: the job gets
    the submitter's `0`, as the C front sends it (found by tests/cli/test_front.py's property)."""
    d = daemon_factory()
    out = cli(d, "submit", "--gpus", "1", "--wait", "--", "env", env={"PATH": "/usr/bin:/bin", "LC_CTYPE": "0"})
    assert out.returncode == 0, out.stderr
    job_id = int(out.stdout.split()[-1])
    env = dict(line.partition("=")[::2] for line in log_of(d, job_id).splitlines())
    assert env.get("LC_CTYPE") == "0"


# 6 ------------------------------------------------------------------------------------------------
def test_a_uid_without_passwd_entry_still_gets_all_five_login_defaults(daemon_factory: Any) -> None:
    """cli.md: with --export NONE 'the daemon still sets HOME, USER, LOGNAME, SHELL and PATH'; a uid
    with no passwd entry got no SHELL."""
    d = daemon_factory()
    [r] = as_user(54321, d.socket, {"op": "submit", "spec": spec(["env"], {}), "hold": False})
    assert r["ok"], r
    env = job_env(d, r["result"]["job_id"])
    assert {"PATH", "HOME", "USER", "LOGNAME", "SHELL"} <= set(env), sorted(env)


# 7 ------------------------------------------------------------------------------------------------
def test_an_oversize_spec_is_a_clear_error_naming_what_to_shrink(daemon_factory: Any) -> None:
    """`gpusched submit -- echo <20,000 args>` printed 'Error: (message): Value error, argv, environment,
    ...': pydantic's wording instead of what to shrink."""
    d = daemon_factory()
    out = cli(d, "submit", "--gpus", "1", "--", "/bin/echo", *map(str, range(20000)))
    assert out.returncode == 2
    assert "(message)" not in out.stderr and "Value error" not in out.stderr, out.stderr
    assert "--export" in out.stderr and "CMD" in out.stderr, out.stderr
