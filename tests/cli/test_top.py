"""`gpusched top`: the pushed `watch` stream, `--once`, rendering, and the live screen under tmux."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from gpusched.config import GpuConfig
from gpusched.model import JobState
from gpusched.protocol import PROTOCOL_VERSION, HelloRequest, TopSnapshot, WatchRequest, encode_frame
from tests.cli.terminal import TMUX, terminal_env
from tests.cli.test_commands import gs, submit, wait_state
from tests.conftest import DaemonHandle, wait_until
from tests.integration.test_daemon import _read


def test_watch_pushes_a_new_snapshot_when_something_changes(daemon: DaemonHandle) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        s.sendall(encode_frame(HelloRequest(version=PROTOCOL_VERSION).model_dump()))
        assert _read(s)["ok"] is True
        s.sendall(encode_frame(WatchRequest(max_rate_hz=20).model_dump()))
        first = TopSnapshot.model_validate(_read(s)["result"])
        assert first.seq == 1 and first.running == [] and first.pending_total == 0
        started = time.monotonic()
        job_id = submit(daemon, "--gpus", "1", "--", "sleep", "30")
        while True:  # frames arrive because the daemon pushes them; the first one with our job wins
            snap = TopSnapshot.model_validate(_read(s)["result"])
            if any(j.id == job_id for j in snap.running + snap.pending):
                break
        assert time.monotonic() - started < 2.0  # well before the 2 s heartbeat would have sent it
        assert snap.users[0].user == "root"
    gs(daemon, "cancel", str(job_id))


def test_top_once_draws_gpus_mig_slices_jobs_and_queue(daemon_factory: Callable[..., DaemonHandle]) -> None:
    node = daemon_factory(gpus={"1": GpuConfig(mig=["3g.40gb", "2g.20gb"])})
    running = submit(node, "--mig", "3g.40gb", "--", "sleep", "30")
    blocker = submit(node, "--gpus", "1", "--", "sleep", "30")
    wait_state(node, running, {JobState.RUNNING})
    wait_state(node, blocker, {JobState.RUNNING})
    queued = submit(node, "--gpus", "1", "--", "true")
    gs(node, "sim", "inject-xid", "1", "13")
    out = wait_until(lambda: (r := gs(node, "top", "--once")).exit_code == 0 and "app_error" in r.stdout and r,
                     what="top shows the event").stdout
    assert "2 GPUs  2 running  1 pending" in out
    assert "GPU 1 H100-80GB" in out and "MIG" in out
    strip = next(line for line in out.splitlines() if "[3g.40gb" in line)
    assert f"[3g.40gb #{running} root" in strip and "[2g.20gb idle" in strip
    assert f"{blocker}   root" in out or f"{blocker}  root" in out
    assert "Queue by user (1 pending)" in out
    assert any(line.split()[:1] == ["root"] and line.split()[-1] == str(queued) for line in out.splitlines())
    assert "app_error: XID 13" in out
    gs(node, "cancel", str(running), str(blocker), str(queued))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_top_in_a_terminal_responds_to_keys(daemon: DaemonHandle) -> None:
    session = f"gstop{os.getpid()}"
    job_id = 0
    env = terminal_env(daemon.socket)
    cmd = f"{sys.executable} -m gpusched_cli.main top"
    subprocess.run([*TMUX, "new-session", "-d", "-s", session, "-x", "120", "-y", "40", cmd], env=env, check=True)
    try:
        def screen() -> str:
            return subprocess.run([*TMUX, "capture-pane", "-p", "-t", session], capture_output=True,
                                  text=True).stdout

        wait_until(lambda: "gpusched top" in screen(), timeout=15, what="top on screen")
        job_id = submit(daemon, "--gpus", "1", "--", "sleep", "30")
        wait_until(lambda: f"{job_id}" in screen() and "1 running" in screen(), timeout=10, what="job pushed")
        subprocess.run([*TMUX, "send-keys", "-t", session, "s"], check=True)
        wait_until(lambda: "sort=user" in screen(), timeout=5, what="sort key")
        subprocess.run([*TMUX, "send-keys", "-t", session, "p"], check=True)
        wait_until(lambda: "[PAUSED]" in screen(), timeout=5, what="pause key")
        subprocess.run([*TMUX, "send-keys", "-t", session, "q"], check=True)
        wait_until(lambda: subprocess.run([*TMUX, "has-session", "-t", session],
                                          capture_output=True).returncode != 0, timeout=5, what="top quit")
    finally:
        subprocess.run([*TMUX, "kill-session", "-t", session], capture_output=True)
        if job_id:
            gs(daemon, "cancel", str(job_id))
