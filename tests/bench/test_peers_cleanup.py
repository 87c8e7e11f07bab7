"""bench_peers stops what task-spooler leaves running: `tsp -K` ends its server but not the running
jobs, nor the tsp process that waits for each, and a blocker whose pid was never learnt (a run that
failed before) lived on for its hour after the test suite had passed."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture
def bench_peers(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("bench_peers")


def _sleeper(socket_path: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"], env={**os.environ, "TS_SOCKET": socket_path}, start_new_session=True)


@pytest.mark.timeout(30)
def test_kill_by_environ_kills_the_processes_with_that_entry_and_only_them(bench_peers: ModuleType) -> None:
    ours, other, prefix = _sleeper("/tmp/gbp-x/ts.sock"), _sleeper("/tmp/gbp-y/ts.sock"), _sleeper("/tmp/gbp-x")
    try:
        assert bench_peers.kill_by_environ("TS_SOCKET=/tmp/gbp-x/ts.sock") == 1
        assert ours.wait(10) == -9
        assert other.poll() is None and prefix.poll() is None  # another value, or a prefix of ours: not ours
        with pytest.raises(ValueError, match="not a NAME=value"):
            bench_peers.kill_by_environ("")  # it would match every process of ours
    finally:
        for proc in (ours, other, prefix):
            proc.kill()
            proc.wait(10)


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("tsp") is None, reason="task-spooler is not installed (apt-get install task-spooler)")
def test_stopping_task_spooler_leaves_none_of_its_processes(bench_peers: ModuleType) -> None:
    """Jobs started outside `block` (as a run that failed midway leaves them): stop() ends them too."""
    base = tempfile.mkdtemp(prefix="gbp-", dir="/tmp")
    peer = bench_peers.TaskSpooler("tsp", base)
    entry = ""
    try:
        peer.start()
        entry = f"TS_SOCKET={peer.env['TS_SOCKET']}"
        job = bench_peers.run([peer.binary, "sleep", "3600"], peer.env).strip()
        bench_peers.h.wait_until(lambda: "running" in bench_peers.run([peer.binary, "-s", job], peer.env),
                                 timeout=10, what="the job running")
        # tsp says "running" once its waiter has started, which may be before the job itself forked
        bench_peers.h.wait_until(lambda: len(bench_peers.processes_with_environ(entry)) >= 3, timeout=10,
                                 what="tsp's server, the job's waiter and the job itself")
    finally:
        peer.stop()
        shutil.rmtree(base, ignore_errors=True)
    bench_peers.h.wait_until(lambda: not bench_peers.processes_with_environ(entry), timeout=10,
                             what="tsp's processes gone after stop()")
