"""The client sends nothing to a socket another user could have planted (docs/security.md, "The client").

With no system daemon, `gpusched` falls back to /tmp/gpusched-$UID/gpusched.sock, a path any user
can create first. A fake daemon there would receive a submit carrying the whole environment. The
client must check who owns the socket and its directory, and who listens (SO_PEERCRED), first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from gpusched.protocol import ROOT_SOCKET

VICTIM, ATTACKER = 4101, 4102
PLANTED_DIR = f"/tmp/gpusched-{VICTIM}"
PLANTED = f"{PLANTED_DIR}/gpusched.sock"

_FAKES: list[subprocess.Popen[str]] = []
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two other users")

# The victim: an ordinary user who runs `gpusched submit` with a secret in the environment.
_VICTIM = textwrap.dedent("""
    import importlib, os, pkgutil, sys
    import gpusched_cli
    from gpusched_cli.main import cli
    # The CLI imports each command's modules on first use; load them all while root can still read
    # this checkout (a fresh clone under mktemp -d is 0700), as an installed copy is readable anyway.
    for module in pkgutil.walk_packages(gpusched_cli.__path__, "gpusched_cli."):
        importlib.import_module(module.name)
    os.setgroups([]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))
    cli(["submit", "--gpus", "1", "--", "true"])
""")

# The fake daemon, run as the attacker: accept connections and count every byte sent to it.
_FAKE = textwrap.dedent("""
    import os, socket, sys
    os.setgroups([]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sys.argv[2]); os.chmod(sys.argv[2], 0o666); srv.listen(8)
    print("ready", flush=True)
    srv.settimeout(float(sys.argv[3]))
    received = 0
    try:
        while True:
            conn, _ = srv.accept()
            conn.settimeout(2)
            try:
                while chunk := conn.recv(65536):
                    received += len(chunk)
            except OSError:
                pass
            conn.close()
    except socket.timeout:
        pass
    print(received, flush=True)
""")


@pytest.fixture
def planted_dir() -> Iterator[str]:
    if os.path.exists(ROOT_SOCKET):
        pytest.skip(f"{ROOT_SOCKET} exists: the client would use the system daemon")
    shutil.rmtree(PLANTED_DIR, ignore_errors=True)
    os.mkdir(PLANTED_DIR, 0o777)
    os.chmod(PLANTED_DIR, 0o777)
    yield PLANTED_DIR
    for fake in _FAKES:
        if fake.poll() is None:
            fake.kill()
            fake.wait(10)
        if fake.stdout is not None:
            fake.stdout.close()  # a test that failed before reading it must not leak the pipe
    _FAKES.clear()
    shutil.rmtree(PLANTED_DIR, ignore_errors=True)


def _fake_daemon(wait_s: float) -> subprocess.Popen[str]:
    fake = subprocess.Popen([sys.executable, "-c", _FAKE, str(ATTACKER), PLANTED, str(wait_s)],
                            stdout=subprocess.PIPE, text=True)
    _FAKES.append(fake)
    assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
    return fake


def _victim_submits() -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "SECRET_TOKEN": "hunter2",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", _VICTIM, str(VICTIM)], env=env, cwd="/tmp",
                          capture_output=True, text=True, timeout=60)


def _bytes_received(fake: subprocess.Popen[str]) -> int:
    out, _ = fake.communicate(timeout=30)
    return int(out.strip())


@pytest.mark.parametrize("owner", ["attacker owns the directory", "attacker owns the socket"])
def test_a_socket_planted_by_another_user_gets_nothing(planted_dir: str, owner: str) -> None:
    os.chown(planted_dir, ATTACKER if owner == "attacker owns the directory" else VICTIM, -1)
    fake = _fake_daemon(wait_s=3)
    result = _victim_submits()
    assert result.returncode == 3, result.stderr
    assert f"refusing to use {PLANTED}" in result.stderr and f"uid {ATTACKER}" in result.stderr
    assert _bytes_received(fake) == 0


def test_a_listener_running_as_another_user_gets_nothing(planted_dir: str) -> None:
    """The directory and the socket file look like the victim's, but the process behind it is not."""
    os.chown(planted_dir, VICTIM, -1)
    fake = _fake_daemon(wait_s=3)
    os.chown(PLANTED, VICTIM, VICTIM)
    result = _victim_submits()
    assert result.returncode == 3, result.stderr
    assert "the process listening on it belongs to uid 4102" in result.stderr
    assert _bytes_received(fake) == 0
