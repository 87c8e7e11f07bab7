"""gpuschedd run by an ordinary user with its default paths, from an audit (each test failed on
the code before): a socket directory another user made first was listened in (and the daemon's
own client refused it); a socket directory it could not write gave an error that named no path;
with no daemon, an ordinary user was told to start one on root's socket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import pytest

from gpusched.protocol import ROOT_SOCKET

VICTIM, ATTACKER = 4111, 4112
PLANTED_DIR = f"/tmp/gpusched-{VICTIM}"

# gpuschedd as VICTIM with its defaults (no --socket, no --state-dir). The venv's interpreter may
# live where VICTIM cannot go (under /root), so VICTIM runs the system python3 on this checkout and
# the venv's packages: only when it is the same version (the same ABI for pydantic-core).
SYSTEM_PYTHON = "/usr/bin/python3"
REPO = str(Path(__file__).resolve().parents[2])
PACKAGES = os.pathsep.join([REPO, os.path.join(REPO, "cli"), sysconfig.get_paths()["purelib"]])


def _same_python() -> bool:
    try:
        out = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except OSError:
        return False
    return out == str(sys.version_info[:2])


pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two other users"),
              pytest.mark.skipif(not _same_python(), reason=f"{SYSTEM_PYTHON} is not this Python's version")]


def _become_victim() -> None:
    os.setgroups([])
    os.setgid(VICTIM)
    os.setuid(VICTIM)


_CLIENT = textwrap.dedent("""
    import importlib, os, pkgutil, sys
    import gpusched_cli
    from gpusched_cli.main import cli
    for m in pkgutil.walk_packages(gpusched_cli.__path__, "gpusched_cli."):
        importlib.import_module(m.name)
    os.setgroups([]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))
    cli(["queue"])
""")


def _victim_cannot_import() -> str | None:
    """Why VICTIM cannot import the daemon from this checkout (None when it can): a clone in a
    directory only root may enter (`mktemp -d`, /root) is out of its reach, and so is the test."""
    proc = subprocess.run([SYSTEM_PYTHON, "-c", "import gpusched.daemon.main"], env={"PATH": "/usr/bin:/bin",
                          "PYTHONPATH": PACKAGES}, cwd="/", capture_output=True, text=True, timeout=60,
                          preexec_fn=_become_victim)
    return proc.stderr.strip().splitlines()[-1] if proc.returncode else None


@pytest.fixture
def victim_home():
    home = tempfile.mkdtemp(prefix="gs-home-", dir="/tmp")
    os.chown(home, VICTIM, VICTIM)
    shutil.rmtree(PLANTED_DIR, ignore_errors=True)
    yield home
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(PLANTED_DIR, ignore_errors=True)


def _env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "PYTHONPATH": os.pathsep.join(sys.path)}


def _run_daemon(home: str, seconds: float) -> tuple[int | None, str]:
    """Start VICTIM's daemon; return (exit code or None if still running after `seconds`, its output)."""
    if (why := _victim_cannot_import()) is not None:
        pytest.skip(f"uid {VICTIM} cannot import gpusched from {REPO} ({why}): needs a checkout other users can read")
    log = os.path.join(home, "daemon.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([SYSTEM_PYTHON, "-m", "gpusched.daemon.main", "--sim", "H100-80GB:1"],
                                env={**_env(home), "PYTHONPATH": PACKAGES}, cwd="/", stdout=out, stderr=out,
                                start_new_session=True, preexec_fn=_become_victim)
    try:
        code = proc.wait(seconds)
    except subprocess.TimeoutExpired:
        code = None
        proc.terminate()
        proc.wait(20)
    with open(log, errors="replace") as f:
        return code, f.read()


def test_personal_daemon_refuses_a_socket_directory_another_user_owns(victim_home: str) -> None:
    """The client refuses /tmp/gpusched-$UID when another user owns it (docs/cli.md "Which daemon"),
    so a daemon that listens there is unusable, and the owner of the directory can remove or move
    its socket (and, with HOME unset, its state directory). The daemon must refuse it at start too."""
    os.mkdir(PLANTED_DIR, 0o777)
    os.chmod(PLANTED_DIR, 0o777)
    os.chown(PLANTED_DIR, ATTACKER, ATTACKER)
    code, output = _run_daemon(victim_home, seconds=12)
    assert "listening on" not in output, output
    assert code not in (None, 0), output
    assert PLANTED_DIR in output and str(ATTACKER) in output, output


def test_unusable_socket_directory_is_named_in_the_error(victim_home: str) -> None:
    """Standard: a clear message naming the problem. Today: `gpuschedd: cannot start: [Errno 13]
    Permission denied`, with no path at all."""
    os.mkdir(PLANTED_DIR, 0o755)
    os.chown(PLANTED_DIR, ATTACKER, ATTACKER)
    code, output = _run_daemon(victim_home, seconds=20)
    assert code == 1, output
    assert PLANTED_DIR in output, output


def test_no_daemon_hint_for_an_ordinary_user_is_a_command_they_can_run(victim_home: str) -> None:
    """docs/cli.md: "If none answers, gpusched exits with code 3 and says which socket it tried and
    how to start a daemon". For an ordinary user the hint says
    `gpuschedd --sim H100-80GB:2 --socket /run/gpusched/gpusched.sock`, which fails for them
    (`cannot start: [Errno 13] Permission denied: '/run/gpusched'`)."""
    if os.path.exists(ROOT_SOCKET):
        pytest.skip(f"{ROOT_SOCKET} exists")
    result = subprocess.run([sys.executable, "-c", _CLIENT, str(VICTIM)], env=_env(victim_home), cwd="/",
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert f"--socket {ROOT_SOCKET}" not in result.stderr, result.stderr
