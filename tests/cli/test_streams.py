"""Long-running client commands (logs -f, top), from an audit: each test failed on the code before
its fix (a busy-polling follow, U+FFFD in valid output, tracebacks and a wrong exit code from top)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gpusched.model import JobState
from gpusched.protocol import LogsRequest, LogsResult
from tests.cli.terminal import TMUX, terminal_env
from tests.cli.test_commands import gs, submit, wait_state
from tests.conftest import DaemonHandle, wait_until

PY = sys.executable


def test_logs_follow_does_not_busy_poll_on_a_trailing_partial_utf8_byte(daemon: DaemonHandle) -> None:
    # The job writes "abc" + the first byte of "é" and then stays silent for a while.
    code = "import sys,time; o=sys.stdout.buffer; o.write(b'abc\\xc3'); o.flush(); time.sleep(8); o.write(b'\\xa9\\n')"
    job = submit(daemon, "--gpus", "1", "--", PY, "-c", code)
    wait_state(daemon, job, {JobState.RUNNING})
    log = os.path.join(daemon.state_dir, "logs", f"{job}.log")
    wait_until(lambda: os.path.exists(log) and os.path.getsize(log) == 4, what="4 bytes in the log")
    with daemon.client() as c:
        first = c.call(LogsRequest(job_id=job, offset=0, wait_s=10.0), LogsResult)
        assert first.data == "abc" and first.next_offset == 3
        started = time.monotonic()
        second = c.call(LogsRequest(job_id=job, offset=3, wait_s=5.0), LogsResult)
        took = time.monotonic() - started
    # docs/protocol.md: "With wait_s > 0 the daemon holds the request until there is new output, the
    # job ends, or wait_s passes: that is how `gpusched logs -f` follows a job without busy-polling."
    # The reply came back at once, empty and at the same offset, so `logs -f` spun (about half a
    # core in the daemon and in the client for as long as the job stayed quiet).
    assert second.next_offset > 3 or took > 4.0, f"empty reply after {took:.3f}s at offset {second.next_offset}"
    gs(daemon, "cancel", str(job))


def test_logs_of_a_finished_job_keeps_multibyte_characters_at_chunk_boundaries(daemon: DaemonHandle) -> None:
    # 400,000 x "€" (3 bytes each): 262144 % 3 != 0, so every 256 KiB reply ends inside a character.
    job = submit(daemon, "--gpus", "1", "--", PY, "-c", "import sys; sys.stdout.write('\u20ac' * 400000 + '\\n')")
    wait_state(daemon, job, {JobState.COMPLETED})
    with open(os.path.join(daemon.state_dir, "logs", f"{job}.log"), "rb") as f:
        on_disk = f.read()
    result = gs(daemon, "logs", str(job))
    assert result.exit_code == 0
    # docs/cli.md: "The job's stdout and stderr, interleaved as written, printed verbatim".
    assert "\ufffd".encode() not in result.stdout_bytes
    assert result.stdout_bytes == on_disk


def _tmux(session: str, cmd: str, width: int, height: int, env: dict[str, str]) -> None:
    subprocess.run([*TMUX, "new-session", "-d", "-s", session, "-x", str(width), "-y", str(height), cmd],
                   env=env, check=True)


def _screen(session: str) -> str:
    return subprocess.run([*TMUX, "capture-pane", "-p", "-J", "-S", "-200", "-t", session],
                          capture_output=True, text=True).stdout


@contextlib.contextmanager
def _top_in_tmux(daemon: DaemonHandle, name: str, width: int, height: int) -> Iterator[str]:
    """`gpusched top` live in a tmux session of that size, on screen; then `EXIT=<code>` when it ends."""
    session = f"{name}{os.getpid()}"
    env = terminal_env(daemon.socket)
    _tmux(session, f"{PY} -m gpusched_cli.main top; echo EXIT=$?; sleep 60", width, height, env)
    try:
        try:
            wait_until(lambda: "gpusched top" in _screen(session), timeout=15, what="top on screen")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the screen:\n{_screen(session)}") from None
        yield session
    finally:
        subprocess.run([*TMUX, "kill-session", "-t", session], capture_output=True)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_top_user_filter_prompt_in_a_narrow_terminal_does_not_crash(daemon: DaemonHandle) -> None:
    with _top_in_tmux(daemon, "narrow", 30, 10) as session:
        subprocess.run([*TMUX, "send-keys", "-t", session, "u"], check=True)
        # a 30-column window gets the short prompt (it crashed with a traceback instead)
        wait_until(lambda: "user: " in _screen(session), timeout=15, what="the user prompt")
        screen = _screen(session)
        assert "Traceback" not in screen and "EXIT=" not in screen, screen


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_top_exits_3_when_the_daemon_goes_away(daemon: DaemonHandle) -> None:
    with _top_in_tmux(daemon, "gone", 120, 40) as session:
        daemon.stop()
        wait_until(lambda: "EXIT=" in _screen(session), timeout=15, what="top to exit")
        # docs/cli.md exit codes: "3 | daemon not running or unreachable, or shutting down"
        assert "EXIT=3" in _screen(session), _screen(session)


def test_top_without_a_terminal_says_so_instead_of_a_traceback(daemon: DaemonHandle) -> None:
    env = {**os.environ, "GPUSCHED_SOCKET": daemon.socket, "TERM": "xterm"}
    proc = subprocess.run([PY, "-m", "gpusched_cli.main", "top"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, timeout=20)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-400:]
