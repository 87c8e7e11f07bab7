"""MPS control against gpusched/gpu/simmps.py (the simulated control program): real processes."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusched.gpu.backend import GpuBusyError, GpuError
from gpusched.gpu.mps import PID_FILE, MpsDaemon, _pid_alive, mps_client_env
from gpusched.gpu.mps_manager import MpsManager

FAKE = str(Path(__file__).resolve().parents[2] / "gpusched" / "gpu" / "simmps.py")
DEV_A = "MIG-0b8c1e55-2b0e-4d7a-9d59-8b1f4f0c2a11"
DEV_B = "GPU-e1080000-1111-2222-3333-444455556666"


def _alive(pid: int) -> bool:
    return _pid_alive(pid)


def _wait_dead(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def base() -> Iterator[Path]:
    """A short base dir (Unix socket paths are limited to 108 bytes); daemons killed if a test leaks them."""
    path = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))
    yield path
    for pid_file in path.glob(f"*/pipe/{PID_FILE}"):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            _wait_dead(pid)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def manager(base: Path) -> Iterator[MpsManager]:
    m = MpsManager(base, control_binary=FAKE, timeout_s=10)
    yield m
    assert m.stop_all() == []


def test_client_env() -> None:
    env = mps_client_env("/run/mps/x/pipe", 25, 10240)
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/run/mps/x/pipe",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
    }
    assert mps_client_env("/p", None, None) == {"CUDA_MPS_PIPE_DIRECTORY": "/p"}
    with pytest.raises(ValueError):
        mps_client_env("/p", 0, None)
    with pytest.raises(ValueError):
        mps_client_env("/p", 50, 0)


def test_start_defaults_servers_and_quit(manager: MpsManager) -> None:
    d = manager.ensure(DEV_A, default_thread_percentage=50, pinned_mem_limit_mib=4096)
    pid = d.pid()
    assert pid is not None and d.running()
    assert (d.pipe_dir / PID_FILE).exists()
    assert d.command("get_default_active_thread_percentage") == "50.0"
    assert d.command(f"get_default_device_pinned_mem_limit {DEV_A}") == "4096M"
    assert d.server_list() == []
    server = int(d.command("start_server -uid 1000"))
    assert d.server_list() == [server] and _alive(server)
    d.terminate_client(server, 12345)
    assert d.client_env(30, 2048)["CUDA_MPS_PIPE_DIRECTORY"] == str(d.pipe_dir)
    assert "set_default_active_thread_percentage 50" in d.control_log.read_text()
    manager.ensure(DEV_A)  # already running: no second daemon
    assert d.pid() == pid
    manager.stop(DEV_A)
    assert not d.running() and _wait_dead(server)


def test_one_daemon_per_device_with_own_dirs(manager: MpsManager) -> None:
    a = manager.ensure(DEV_A)
    b = manager.ensure(DEV_B, default_thread_percentage=20)
    assert a.pid() != b.pid() and a.pipe_dir != b.pipe_dir and a.log_dir != b.log_dir
    assert a.command("get_default_active_thread_percentage") == "100.0"
    assert b.command("get_default_active_thread_percentage") == "20.0"
    assert sorted(manager.devices()) == sorted([DEV_A, DEV_B])


def test_errors_carry_the_log_path(manager: MpsManager) -> None:
    d = manager.ensure(DEV_A)
    with pytest.raises(GpuError) as err:
        d.terminate_client(999999, 1)
    assert str(d.control_log) in err.value.hint
    with pytest.raises(GpuError, match="unknown command"):
        d.command("frobnicate")
    with pytest.raises(ValueError):
        d.set_default_active_thread_percentage(0)


def test_command_without_daemon_fails(base: Path) -> None:
    d = MpsDaemon(DEV_B, base, control_binary=FAKE, timeout_s=5)
    with pytest.raises(GpuError) as err:
        d.server_list()
    assert "control.log" in err.value.hint
    d.stop()  # not running: nothing to do


def test_missing_binary(base: Path) -> None:
    d = MpsDaemon(DEV_B, base, control_binary="/nonexistent/nvidia-cuda-mps-control")
    with pytest.raises(GpuError, match="not found"):
        d.start()


def test_timeout_becomes_gpu_error(base: Path, tmp_path: Path) -> None:
    slow = tmp_path / "slow-control"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    d = MpsDaemon(DEV_B, base, control_binary=str(slow), timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(GpuError, match="timed out") as err:
        d.command("get_server_list")
    assert time.monotonic() - t0 < 5 and str(d.control_log) in err.value.hint


def test_owner_uid_one_at_a_time(base: Path) -> None:
    d = MpsDaemon(DEV_A, base, control_binary=FAKE)
    assert d.can_serve(1000) and d.owner_uid is None
    d.acquire(1000, 11)
    d.acquire(1000, 12)
    assert not d.can_serve(1001)
    with pytest.raises(GpuBusyError, match="uid 1000"):
        d.acquire(1001, 13)
    d.release(11)
    assert d.owner_uid == 1000
    d.release(12)
    assert d.owner_uid is None and d.can_serve(1001)
    d.acquire(1001, 13)
    assert d.clients() == {13: 1001}


def test_caps_are_the_defaults_and_each_running_servers_limits(manager: MpsManager) -> None:
    """A client can only lower what its daemon gives: the caps must be the daemon's defaults (for a
    server yet to start) and its running server's own limits (for clients yet to connect)."""
    caps = [(30, 2048)]
    d = manager.ensure(DEV_A, 1000, caps=lambda: caps[0])
    assert d.command("get_default_active_thread_percentage") == "30.0"
    assert d.command(f"get_default_device_pinned_mem_limit {DEV_A}") == "2048M"
    server = int(d.command("start_server -uid 1000"))  # a server takes the defaults of its start
    assert d.command(f"get_active_thread_percentage {server}") == "30.0"
    caps[0] = (55, 3072)
    manager.update_caps(DEV_A, 1000, lambda: caps[0])
    assert d.command("get_default_active_thread_percentage") == "55.0"
    assert d.command(f"get_active_thread_percentage {server}") == "55.0"
    assert d.command(f"get_device_pinned_mem_limit {server} {DEV_A}") == "3072M"
    manager.update_caps(DEV_A, 1000, lambda: (40, None))  # no memory cap known: memory left as it is
    assert d.command(f"get_active_thread_percentage {server}") == "40.0"
    assert d.command(f"get_device_pinned_mem_limit {server} {DEV_A}") == "3072M"
    manager.update_caps(DEV_A, 1000, lambda: None)  # no share left: nothing to set
    assert d.command("get_default_active_thread_percentage") == "40.0"
    manager.update_caps(DEV_B, 1000, lambda: (10, 10))  # no daemon there: nothing started
    assert not manager.daemon(DEV_B, 1000).running()
    with pytest.raises(ValueError):
        d.set_caps(0, 1)
    with pytest.raises(ValueError):
        d.set_caps(10, 0)


def test_commands_fail_on_any_error_reply(manager: MpsManager) -> None:
    d = manager.ensure(DEV_A)
    with pytest.raises(GpuError, match="no server with pid 424242"):
        d.commands(["set_default_active_thread_percentage 20", "set_active_thread_percentage 424242 20"])
    with pytest.raises(ValueError):
        d.commands(["get_server_list\nquit"])


def test_quit_strays_quits_only_daemons_nobody_registered(base: Path) -> None:
    """A restarted gpuschedd registers the daemons of the shares it re-adopts, then quits the rest:
    their shares ended while it was down, and nothing else would ever quit them."""
    before = MpsManager(base, control_binary=FAKE, timeout_s=5)
    kept, stray = before.ensure(DEV_A, 1000), before.ensure(DEV_B, 1001)
    (base / "not-a-daemon").mkdir()
    after = MpsManager(base, control_binary=FAKE, timeout_s=5)  # the next gpuschedd
    after.daemon(DEV_A, 1000)
    stray_pid = stray.pid()
    assert stray_pid is not None
    assert after.quit_strays() == 1
    assert _wait_dead(stray_pid) and kept.running()
    assert after.quit_strays() == 0
    after.stop_all()
