"""The job's child two ways: gpusched-execjob (execjob.c, started with posix_spawn) where it is built,
and the forked Python child (shim._child) where it is not. Each case runs the real shim
(`python -I shim.py JOB_DIR`, as the daemon does) both ways and asks for the same job: the same
user, groups, session, signals, descriptors, directory, environment, cgroup and CPUs, and the same
words when it cannot start."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusched.daemon import execjob_build, shim

BUILT = shim.EXECJOB is not None
NOT_BUILT = pytest.mark.skipif(not BUILT, reason="gpusched-execjob not built: make native")
WAYS = [pytest.param(True, id="execjob", marks=NOT_BUILT), pytest.param(False, id="python-child")]
ROOT = os.geteuid() == 0
GLIBC_SIGNALS = 1 << 31 | 1 << 32  # SigIgn's bits of signals 32 and 33
NOBODY = 65534

# What the job reports about itself: its ids, session, ignored and blocked signals and CPUs (through a
# command it runs, which has them from it: the shell blocks every signal for a moment around each
# fork), open descriptors, working directory and environment (the shell's own, $$).
PROBE = ("id -u; id -g; id -G; ps -o sid= -p $$; grep -E '^(SigIgn|SigBlk|Cpus_allowed_list)' /proc/self/status;"
         " ls /proc/$$/fd; pwd; env | sort")


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory anyone may enter (the job may run as nobody): its cwd, log and job directory."""
    base = Path(tempfile.mkdtemp(prefix="gsx-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _launch(place: Path, argv: list[str], **overrides: Any) -> dict[str, Any]:
    log = place / "job.log"
    log.touch()
    launch: dict[str, Any] = {
        "argv": argv, "env": {"PATH": "/usr/bin:/bin", "GREETING": "hello world", "EMPTY": ""},
        "cwd": str(place), "log_path": str(log), "cgroup": None, "cpuset": [],
        "uid": os.getuid(), "gid": os.getgid(), "groups": [], "drop_privileges": False,
    }
    if ROOT:  # as the daemon runs jobs: the submitter's ids and groups
        os.chown(log, NOBODY, NOBODY)
        launch.update(uid=NOBODY, gid=NOBODY, groups=[NOBODY, 100], drop_privileges=True)
    launch.update(overrides)
    return launch


def _run(place: Path, launch: dict[str, Any], helper: bool) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """(the shim's reports, status.json, the job's log) for one launch, the given way."""
    job_dir = Path(tempfile.mkdtemp(prefix="job-execjob-" if helper else "job-python-", dir=place))
    log = Path(launch["log_path"])
    if log.parent.exists():
        log.write_text("")  # (the last case's output gone; its owner stays)
    (job_dir / shim.LAUNCH).write_text(json.dumps(launch))
    env = {"PATH": "/usr/bin:/bin"} | ({} if helper else {shim.EXECJOB_ENV: "0"})
    done = subprocess.run([sys.executable, "-I", shim.__file__, str(job_dir)], stdin=subprocess.DEVNULL,
                          capture_output=True, env=env, start_new_session=True, timeout=60)
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    status = json.loads((job_dir / shim.STATUS).read_text())
    return reports, status, log.read_text() if log.exists() else ""


def _both(place: Path, launch: dict[str, Any]) -> list[tuple[list[dict[str, Any]], dict[str, Any], str]]:
    return [_run(place, launch, helper) for helper in ([True, False] if BUILT else [False])]


def _comparable(reports: list[dict[str, Any]], status: dict[str, Any], log: str) -> tuple[Any, ...]:
    """What must not differ between the two ways (pids and times do: the probe's session is its pid)."""
    pid = str(status["pid"])
    return ([{k: v for k, v in r.items() if k != "pid"} for r in reports],
            {k: status[k] for k in ("exit_code", "signal", "error")},
            [_masked(line) if line.strip() != pid else "PID" for line in log.splitlines()])


def _masked(line: str) -> str:
    """SigIgn without glibc's own two signals, which only the helper can reset (above)."""
    name, _, value = line.partition(":\t")
    return line if name != "SigIgn" else f"{name}:\t{int(value, 16) & ~GLIBC_SIGNALS:016x}"


@pytest.mark.parametrize("helper", WAYS)
def test_the_job_is_the_same_process_either_way(place: Path, helper: bool) -> None:
    reports, status, log = _run(place, _launch(place, ["sh", "-c", PROBE]), helper)
    assert reports[1] == {"exec": True, "error": None} and status["exit_code"] == 0, (status, log)
    lines = log.splitlines()
    pid = reports[0]["pid"]
    ids = (NOBODY, NOBODY, f"{NOBODY} 100") if ROOT else (os.getuid(), os.getgid(), None)
    assert (int(lines[0]), int(lines[1])) == ids[:2]
    if ids[2] is not None:
        assert lines[2] == ids[2]
    assert int(lines[3]) == pid  # a session of its own
    assert lines[4] == "SigBlk:\t0000000000000000"
    ignored = int(lines[5].removeprefix("SigIgn:\t"), 16)
    # None ignored. glibc's own two (32, 33) are ignored in a process posix_spawn started from a
    # threaded one (make's children, CI's pytest): Python cannot reset them, the helper does.
    assert ignored == 0 if helper else ignored & ~GLIBC_SIGNALS == 0, lines[5]
    assert lines[7:10] == ["0", "1", "2"] and lines[10] == str(place)  # nothing but 0-2 open
    assert lines[11:] == ["EMPTY=", "GREETING=hello world", "PATH=/usr/bin:/bin", f"PWD={place}"]


def test_both_ways_give_the_same_job_and_the_same_failures(place: Path) -> None:
    if not BUILT:
        pytest.skip("gpusched-execjob not built: make native")
    noexec = place / "noexec"
    noexec.mkdir(mode=0o755)
    (noexec / "true").write_text("#!/bin/sh\n")  # found first on PATH, not executable: skipped
    (noexec / "only-here").write_text("#!/bin/sh\n")
    for path in (noexec, noexec / "true", noexec / "only-here"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    cases = [
        _launch(place, ["sh", "-c", PROBE]),
        _launch(place, ["sh", "-c", "exit 7"]),
        _launch(place, ["/no/such/program"]),
        _launch(place, ["no-such-program"]),
        _launch(place, ["true"], env={"PATH": f"{noexec}:/usr/bin:/bin"}),
        _launch(place, ["only-here"], env={"PATH": f"{noexec}:/usr/bin"}),
        _launch(place, ["true"], cwd=str(place / "missing")),
        _launch(place, ["true"], log_path=str(place / "no-dir" / "job.log")),
    ]
    if ROOT:
        private = place / "private"
        private.mkdir(mode=0o700)
        cases.append(_launch(place, ["true"], cwd=str(private)))  # root may enter it; the job's user may not
    for launch in cases:
        execjob, python = (_comparable(*result) for result in _both(place, launch))
        assert execjob == python, launch
    *_, (_, status, _) = _both(place, cases[5])
    assert status["error"] == "exec only-here: Permission denied"
    *_, (_, status, _) = _both(place, cases[2])
    assert status["error"] == "exec /no/such/program: No such file or directory"


@pytest.mark.parametrize("helper", WAYS)
def test_the_job_joins_its_cgroup_and_cpus_before_it_runs(place: Path, helper: bool) -> None:
    cgroup = place / "cgroup"  # laid out like cgroupfs: the kernel's file is written, not created
    cgroup.mkdir()
    (cgroup / "cgroup.procs").write_text("")
    launch = _launch(place, ["sh", "-c", "grep Cpus_allowed_list /proc/self/status"], cgroup=str(cgroup), cpuset=[0])
    reports, status, log = _run(place, launch, helper)
    assert status["exit_code"] == 0, status
    assert (cgroup / "cgroup.procs").read_text() == str(reports[0]["pid"])
    assert log == "Cpus_allowed_list:\t0\n"


@pytest.mark.skipif(not (BUILT and ROOT and shutil.which("cc")), reason="needs gpusched-execjob, root and cc")
def test_a_submitters_ld_preload_never_runs_as_root(place: Path) -> None:
    """The helper runs as root until it takes the job's user: the job's environment is handed to
    the job's execve only, never the helper's own, where the loader would honour LD_PRELOAD."""
    marks = place / "marks"
    marks.touch()
    marks.chmod(0o666)
    source = place / "preload.c"
    source.write_text('#include <stdio.h>\n#include <unistd.h>\n'
                      '__attribute__((constructor)) static void mark(void) {'
                      f' FILE *f = fopen("{marks}", "a");'
                      ' if (f) { fprintf(f, "%d\\n", (int)geteuid()); fclose(f); } }\n')
    library = place / "preload.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    library.chmod(0o755)
    launch = _launch(place, ["true"], env={"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(library)})
    _, status, _ = _run(place, launch, True)
    assert status["exit_code"] == 0
    assert marks.read_text().split() == [str(NOBODY)]  # the job's own exec, as the job's user; nothing as root


def test_a_helper_that_cannot_start_leaves_the_python_child_to_do_it(place: Path) -> None:
    """posix_spawn failing (a missing or unrunnable binary, E2BIG) is no failure of the launch."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        assert shim._spawn_child(str(place / "no-such-helper"), _launch(place, ["true"]), write_fd) is None
        assert shim._spawn_child("/bin/true", _launch(place, ["true"], env={"A=B": "x"}), write_fd) is None
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_the_helper_is_named_by_its_source_so_an_older_build_never_runs(tmp_path: Path) -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    source = tmp_path / "execjob.c"
    shutil.copy(shim.EXECJOB_SOURCE, source)
    out = tmp_path / "out"
    built = execjob_build.build(str(source), str(out))
    assert built == shim.execjob_path(str(source), str(out)) and os.stat(built).st_mode & stat.S_IXUSR
    source.write_text(source.read_text() + "\n/* edited */\n")
    assert shim.execjob_path(str(source), str(out)) != built  # the old binary is not the edited source's
    rebuilt = execjob_build.build(str(source), str(out))
    assert os.listdir(out) == [os.path.basename(rebuilt)]  # and the old one is gone
    source.write_text("this is not C\n")
    with pytest.raises(RuntimeError, match="failed"):
        execjob_build.build(str(source), str(out))
    assert os.listdir(out) == [os.path.basename(rebuilt)]  # nothing half-built left behind


def test_a_daemon_started_with_gpusched_execjob_0_gives_its_shims_the_python_child(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusched.daemon.shimstart import shim_env

    monkeypatch.delenv(shim.EXECJOB_ENV, raising=False)
    assert shim_env() == {"PATH": "/usr/bin:/bin"}  # nothing else of the daemon's environment
    monkeypatch.setenv(shim.EXECJOB_ENV, "0")
    assert shim_env() == {"PATH": "/usr/bin:/bin", shim.EXECJOB_ENV: "0"}


def test_the_jobs_environment_reaches_the_helper_under_names_the_loader_ignores_and_never_in_argv(
        place: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/PID/cmdline is anyone's to read (a secret in the environment must not show there), and
    the helper's own environment is read by the loader, as root (LD_PRELOAD, GLIBC_TUNABLES...)."""
    seen: dict[str, Any] = {}

    def spawn(path: str, argv: list[str], env: dict[str, str], **kwargs: Any) -> int:
        seen.update(path=path, argv=argv, env=env)
        return 4242

    monkeypatch.setattr(os, "posix_spawn", spawn)
    env = {"PATH": "/usr/bin", "LD_PRELOAD": "/home/eve/evil.so", "GLIBC_TUNABLES": "x", "TOKEN": "s3cret"}
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        assert shim._spawn_child("/helper", _launch(place, ["run", "--fast"], env=env), write_fd) == 4242
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert seen["argv"] == ["/helper", "run", "--fast"]
    assert not [name for name in seen["env"] if not (name.startswith("GPUSCHED_X_") or name[0] == "E")]
    assert [v for k, v in seen["env"].items() if k[0] == "E"] == [f"{k}={v}" for k, v in env.items()]
    assert not any("s3cret" in a for a in seen["argv"])
