"""systemd/gpusched.service: systemd accepts it without a warning, it agrees with the daemon's defaults,
and the daemon speaks sd_notify (READY, STATUS, WATCHDOG, STOPPING) as Type=notify + WatchdogSec expect."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusched.config import default_paths
from gpusched.protocol import ROOT_SOCKET
from tests.conftest import kill_job_processes, short_tmpdir

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "gpusched.service"
INSTALL_HINT = "apt-get install -y --no-install-recommends systemd"


def unit_settings(text: str) -> dict[str, list[str]]:
    """KEY -> values, over all sections (our unit uses each key in one section only)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def systemd_version(tool: str) -> int:
    first = subprocess.run([tool, "--version"], capture_output=True, text=True, check=True).stdout.split()
    return int(first[1]) if len(first) > 1 and first[1].isdigit() else 0


def gpuschedd_path() -> str:
    """The gpuschedd of the Python running the tests (the venv's), for ExecStart."""
    beside = Path(sys.executable).parent / "gpuschedd"
    found = str(beside) if beside.exists() else shutil.which("gpuschedd")
    if found is None:
        pytest.fail("gpuschedd is not installed next to the test interpreter; run `pip install -e .`")
    return os.path.abspath(found)


def test_systemd_analyze_verify_has_nothing_to_say_about_our_unit(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail(f"systemd-analyze is missing in CI; .ci/run must install it ({INSTALL_HINT})")
        pytest.skip(f"systemd-analyze is not installed (Debian/Ubuntu: {INSTALL_HINT})")
    text = UNIT.read_text(encoding="utf-8")
    assert text.count("\nExecStart=/usr/bin/gpuschedd ") == 1
    # verify checks that ExecStart's program exists: point it at ours, keep everything else.
    unit = tmp_path / "gpusched.service"
    unit.write_text(text.replace("\nExecStart=/usr/bin/gpuschedd ", f"\nExecStart={gpuschedd_path()} "),
                    encoding="utf-8")
    proc = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""})
    output = proc.stdout + proc.stderr
    about_us = [line for line in output.splitlines() if "gpusched.service" in line]
    if systemd_version(tool) < 254:  # DelegateSubgroup= is newer; older systemd ignores it, by design
        about_us = [line for line in about_us if "Unknown key 'DelegateSubgroup'" not in line
                    and "Unknown key name 'DelegateSubgroup'" not in line]
    assert proc.returncode == 0 and not about_us, f"systemd-analyze verify {unit}:\n{output}"


def test_unit_matches_what_the_daemon_and_client_expect() -> None:
    s = unit_settings(UNIT.read_text(encoding="utf-8"))
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["ExecStart"] == ["/usr/bin/gpuschedd --config /etc/gpusched/gpusched.toml"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["KillMode"] == ["process"], "jobs must survive `systemctl restart gpusched`"
    assert s["Delegate"] == ["yes"] and s["DelegateSubgroup"] == ["daemon"]  # daemon/cgroups.py's leaf name
    assert s["OOMPolicy"] == ["continue"] and s["TasksMax"] == ["infinity"]
    assert s["Restart"] == ["on-failure"] and s["WatchdogSec"] == ["30"]
    root = default_paths(0, {})
    assert f"/run/{s['RuntimeDirectory'][0]}/gpusched.sock" == ROOT_SOCKET == root["socket"]
    assert f"/var/lib/{s['StateDirectory'][0]}" == root["state_dir"]
    assert s["LogsDirectory"] == ["gpusched"] and s["StateDirectoryMode"] == ["0711"]
    # Jobs inherit the daemon's sandbox: nothing that hides homes, /tmp or devices, or blocks setuid.
    for key in ("ProtectHome", "PrivateTmp", "PrivateDevices", "NoNewPrivileges", "ProtectControlGroups",
                "ProtectKernelTunables", "ProtectKernelModules", "ProtectClock", "MemoryDenyWriteExecute",
                "RestrictNamespaces", "ProtectHostname", "RestrictSUIDSGID", "PrivateNetwork"):
        assert s.get(key, ["no"]) == ["no"], f"{key} would break jobs"
    for key in ("DeviceAllow", "CapabilityBoundingSet", "SystemCallFilter", "RestrictAddressFamilies",
                "OOMScoreAdjust", "PrivateUsers", "DynamicUser", "User"):
        assert key not in s, f"{key} is inherited by every job"


def test_daemon_speaks_sd_notify_with_watchdog() -> None:
    """The real gpuschedd, told it runs under systemd: READY, STATUS, WATCHDOG pings, STOPPING."""
    base = short_tmpdir()
    notify_path = os.path.join(base, "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(0.2)
    config = os.path.join(base, "gpusched.toml")
    with open(config, "w") as f:
        f.write('allow_root_jobs = true\ncgroup_root = "off"\ntick_s = 0.2\n')
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    log_path = os.path.join(base, "daemon.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpusched.daemon.main", "--config", config, "--sim", "H100-80GB:1",
             "--socket", os.path.join(base, "g.sock"), "--state-dir", os.path.join(base, "state")],
            env=env, stdout=log, stderr=log, start_new_session=True,
        )
    messages: list[str] = []

    def receive_until(done: str | None = None, pings: int = 0, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ((done is None or any(done in m for m in messages))
                   and sum("WATCHDOG=1" in m for m in messages) >= pings):
            if time.monotonic() > deadline:
                raise AssertionError(f"waited for {done!r} and {pings} pings from gpuschedd; got {messages}")
            try:
                messages.append(listener.recv(4096).decode())
            except TimeoutError:
                assert proc.poll() is None, f"gpuschedd exited: {Path(log_path).read_text(errors='replace')}"

    try:
        receive_until("READY=1")
        assert any("STATUS=serving" in m for m in messages)
        receive_until("0 running, 0 pending on 1 GPUs")
        receive_until(pings=4)  # they keep coming, at half of WATCHDOG_USEC
        assert messages[0].startswith("STATUS=starting")
        first_ping = next(i for i, m in enumerate(messages) if "WATCHDOG=1" in m)
        assert first_ping > next(i for i, m in enumerate(messages) if "READY=1" in m)  # no ping before READY
        proc.send_signal(signal.SIGTERM)
        receive_until("STOPPING=1")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        listener.close()
        kill_job_processes(os.path.join(base, "state"))
        shutil.rmtree(base, ignore_errors=True)

