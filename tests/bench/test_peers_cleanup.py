"""bench_peers stops what task-spooler leaves running: `tsp -K` ends its server but not the running
jobs, nor the tsp process that waits for each, and a blocker whose pid was never learnt (a run that
failed before) lived on for its hour after the test suite had passed."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_peers() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))  # (bench_peers imports its neighbour harness as a top-level module)
    try:
        yield importlib.import_module("bench_peers")
    finally:
        sys.path.remove(str(BENCH))


def _sleeper(socket_path: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"], env={**os.environ, "TS_SOCKET": socket_path}, start_new_session=True)


@pytest.mark.timeout(30)
def test_kill_by_environ_kills_the_processes_with_that_entry_and_only_them(bench_peers: ModuleType) -> None:
    ours, other, prefix = _sleeper("/tmp/gbp-x/ts.sock"), _sleeper("/tmp/gbp-y/ts.sock"), _sleeper("/tmp/gbp-x")
    try:
        assert bench_peers.kill_by_environ("TS_SOCKET=/tmp/gbp-x/ts.sock") == 1
        assert ours.wait(10) == -9
        assert other.poll() is None and prefix.poll() is None  # another value, or a prefix of ours: not ours
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
    entry = b""
    try:
        peer.start()
        entry = f"TS_SOCKET={peer.env['TS_SOCKET']}".encode()
        job = bench_peers.run([peer.binary, "sleep", "3600"], peer.env).strip()
        bench_peers.h.wait_until(lambda: "running" in bench_peers.run([peer.binary, "-s", job], peer.env),
                                 timeout=10, what="the job running")
        assert len(_holding(entry)) >= 3, "tsp's server, the job's waiter and the job itself"
    finally:
        peer.stop()
        shutil.rmtree(base, ignore_errors=True)
    bench_peers.h.wait_until(lambda: not _holding(entry), timeout=10, what="tsp's processes gone after stop()")


def _holding(entry: bytes) -> list[int]:
    """Live processes whose environment holds `entry` (a process killed but not yet reaped is a zombie,
    whose environ reads empty)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found
