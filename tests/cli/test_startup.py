"""The everyday commands start without pydantic or the protocol's models (issue 13: a client that
starts fast); the job commands (submit, queue, show, cancel, ...) without click either, through the
fast path; every other command imports only its own command module.

Each case runs the real program as a process, as its console script does, against the real daemon,
and records `sys.modules` as the process exits: every module it imported from start to exit. No
timing is asserted: what is asserted is what got imported, which is what the time was spent on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from gpusched.model import JobState
from gpusched.protocol import ShowRequest, ShowResult
from tests.conftest import DaemonHandle, wait_until

# What the console script `gpusched` does (see pyproject.toml [project.scripts]), plus a record of
# sys.modules at exit, written to the file named by $GS_MODULES_OUT. CLICK_ONLY is the click program
# alone (`python -m gpusched_cli.main`), which the fast path hands every other command line to.
ENTRY = ("import atexit, os, sys\n"
         "def record():\n"
         "    with open(os.environ['GS_MODULES_OUT'], 'w') as f:\n"
         "        f.write('\\n'.join(sorted(sys.modules)))\n"
         "atexit.register(record)\n"
         "{body}")
CLI = "from gpusched_cli.fastpath import main; sys.argv[0] = 'gpusched'; sys.exit(main())"
CLICK_ONLY = "from gpusched_cli.main import cli; sys.argv[0] = 'gpusched'; sys.exit(cli())"

# Heavy or daemon-side packages the client must not load for these commands.
FORBIDDEN = ("pydantic", "pydantic_core", "gpusched.protocol", "gpusched.model", "gpusched.core",
             "gpusched.daemon", "gpusched.gpu", "gpusched.replay", "asyncio")


def imported(body: str, *args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run Python `body` with `args`; the process and the names of every module loaded when it exited."""
    with tempfile.NamedTemporaryFile("r", suffix=".modules") as out:
        proc = subprocess.run([sys.executable, "-c", ENTRY.format(body=body), *args], capture_output=True,
                              text=True, timeout=60, check=False, env={**os.environ, "GS_MODULES_OUT": out.name})
        names = set(out.read().split())
    assert names, f"the process did not record its modules: {proc.stderr[-2000:]}"
    return proc, names


def gpusched(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    return imported(CLI, *args)


def click_only(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    return imported(CLICK_ONLY, *args)


def heavy(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN))


def command_modules(names: set[str]) -> set[str]:
    """The command modules loaded; `declared`, which turns declarations into click options, is not one."""
    return {n.rsplit(".", 1)[1] for n in names if n.startswith("gpusched_cli.commands.")} - {"declared"}


def fast(names: set[str]) -> bool:
    """Did the run take the fast path: no click, and no click command module?"""
    return "click" not in names and not any(n.startswith("gpusched_cli.commands") for n in names)


def test_the_detector_sees_pydantic_when_it_is_imported() -> None:
    proc, names = imported("import gpusched.protocol")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"pydantic", "gpusched.model", "gpusched.protocol"} <= set(heavy(names))


@pytest.fixture
def node(daemon_factory: Callable[..., DaemonHandle]) -> DaemonHandle:
    return daemon_factory(allow_root_jobs=os.geteuid() == 0)


def test_submit_queue_show_cancel_import_no_pydantic(node: DaemonHandle) -> None:
    sock = ["--socket", node.socket]
    proc, names = gpusched(*sock, "submit", "--json", "--gpus", "1", "--", "sleep", "60")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert heavy(names) == [] and fast(names)
    running = json.loads(proc.stdout)["job_id"]

    def state() -> JobState:
        with node.client() as c:
            return c.call(ShowRequest(job_id=running), ShowResult).job.state

    wait_until(lambda: state() is JobState.RUNNING, timeout=20, what=f"job {running} to run")
    proc, names = gpusched(*sock, "submit", "--gpus", "2", "--name", "waits", "--", "true")
    assert proc.returncode == 0 and proc.stdout.startswith("Submitted job "), proc.stderr[-2000:]
    pending = int(proc.stdout.split()[-1])
    assert heavy(names) == [] and fast(names)

    cases: list[tuple[list[str], str]] = [  # args, something it must print
        (["queue"], "RUNNING"),  # a running job's devices: queue also asks for `gpus` (labels)
        (["queue", "--json"], '"jobs"'),
        (["show", str(running)], "History:"),
        (["show", "--json", str(pending)], '"waiting_reason"'),
        (["hold", str(pending)], f"Held job {pending}"),
        (["release", str(pending)], f"Released job {pending}"),
        (["cancel", str(pending)], f"Cancelled job {pending}"),
        (["cancel", str(running)], f"Cancelled job {running}"),
    ]
    for args, needle in cases:
        proc, names = gpusched(*sock, *args)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
        assert needle in proc.stdout, (args, proc.stdout[-2000:])
        assert heavy(names) == [], args
        assert fast(names), args


def test_the_click_program_imports_only_the_command_module_it_runs(node: DaemonHandle) -> None:
    """What the fast path hands on (help, other commands) still loads one command module, no pydantic."""
    sock = ["--socket", node.socket]
    for args, module in [(["submit", "--gpus", "1", "--", "true"], "submit"), (["queue"], "jobs"),
                         (["gpus"], "devices"), (["stats"], "node")]:
        proc, names = click_only(*sock, *args)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
        assert heavy(names) == [] and command_modules(names) == {module}, args
    proc, names = gpusched(*sock, "gpus")  # not a fast command: the fast path hands it to click
    assert proc.returncode == 0 and "click" in names and command_modules(names) == {"devices"}
    proc, names = gpusched(*sock, "submit", "--help")
    assert proc.returncode == 0 and "--gpu-mem SIZE" in proc.stdout and command_modules(names) == {"submit"}


def test_arrays_and_array_tasks_import_no_pydantic(node: DaemonHandle) -> None:
    """`--array` is checked, and ARRAY_TASK parsed, by gpusched.arrayspec (standard library only)."""
    sock = ["--socket", node.socket]
    proc, names = gpusched(*sock, "submit", "--hold", "--gpus", "1", "--array", "1-3", "--", "true")
    assert proc.returncode == 0 and proc.stdout.startswith("Submitted array job "), proc.stderr[-2000:]
    assert heavy(names) == [] and fast(names)
    assert "gpusched.arrayspec" in names  # the detector would see it: it is the module doing the work
    array_id = int(proc.stdout.split()[3])
    cases: list[tuple[list[str], str]] = [  # args, something it must print
        (["queue"], f"{array_id}_[1-3]"),
        (["queue", "--array-tasks"], f"{array_id}_2 "),
        (["show", f"{array_id}_2"], f"= {array_id}_2"),
        (["cancel", f"{array_id}_3"], "Cancelled job"),
        (["cancel", str(array_id)], f"Array {array_id}: its unfinished tasks are cancelled"),
    ]
    for args, needle in cases:
        proc, names = gpusched(*sock, *args)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
        assert needle in proc.stdout, (args, proc.stdout[-2000:])
        assert heavy(names) == [] and fast(names), args
    proc, names = gpusched(*sock, "submit", "--gpus", "1", "--array", "5-1", "--", "true")
    assert proc.returncode == 2 and "--array" in proc.stderr and heavy(names) == []
    proc, names = gpusched(*sock, "show", "12_x")
    assert proc.returncode == 2 and "ARRAY_TASK" in proc.stderr and heavy(names) == []


def test_errors_are_reported_without_pydantic_too(tmp_path: Path) -> None:
    """Exit 3 (no daemon), 4 (no such job) and 2 (bad flag) take the same light path."""
    proc, names = gpusched("--socket", str(tmp_path / "none.sock"), "queue")
    assert proc.returncode == 3 and "gpuschedd is not running" in proc.stderr
    assert heavy(names) == []
    proc, names = gpusched("--socket", str(tmp_path / "none.sock"), "submit", "--gpus", "0", "true")
    assert proc.returncode == 2 and "--gpus" in proc.stderr
    assert heavy(names) == []


def test_no_such_job_is_reported_without_pydantic(node: DaemonHandle) -> None:
    proc, names = gpusched("--socket", node.socket, "show", "999")
    assert proc.returncode == 4 and "error:" in proc.stderr, proc.stderr[-2000:]
    assert heavy(names) == []


def test_help_lists_every_command_without_pydantic() -> None:
    proc, names = gpusched("--help")
    assert proc.returncode == 0 and "submit" in proc.stdout and "replay" in proc.stdout
    assert heavy(names) == []
