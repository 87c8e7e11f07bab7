"""`gpusched doctor` against the real daemon: checks, hints, exit codes, and a foreign process."""

from __future__ import annotations

import json
import os
import subprocess

import gpusched.core
from gpusched.daemon import shim
from gpusched.daemon.devices import simulator_of
from gpusched.daemon.doctor import compiled_parts
from tests.cli.test_commands import gs
from tests.conftest import DaemonHandle, wait_until


def test_doctor_reports_each_check_with_hints(daemon: DaemonHandle) -> None:
    result = gs(daemon, "doctor")
    assert result.exit_code == 0, result.output  # WARNs (no cgroups here) do not fail
    names = {line.split()[1] for line in result.stdout.splitlines()[:-1] if not line.startswith(" ")}
    assert {"nvml", "gpu0.mig", "gpu1.mig", "processes", "numa", "cgroups", "socket", "state_dir"} <= names
    assert "WARN  cgroups" in result.stdout and "fix: run gpuschedd as the systemd service" in result.stdout
    assert result.stdout.splitlines()[-1].endswith("0 failed")
    checks = {c["name"]: c for c in json.loads(gs(daemon, "doctor", "--json").stdout)["checks"]}
    assert checks["processes"]["status"] == "PASS"
    assert checks["socket"]["detail"].endswith("mode 0666")


def test_doctor_names_cuda_processes_that_gpusched_did_not_start(daemon: DaemonHandle) -> None:
    outsider = subprocess.Popen(["sleep", "30"])
    try:
        assert daemon.daemon is not None
        sim = simulator_of(daemon.daemon.engine.backend)
        assert sim is not None
        gpu_uuid = daemon.daemon.engine.inventory.gpus[0].uuid
        sim.add_process(gpu_uuid, outsider.pid, 1 << 30)
        checks = {c["name"]: c for c in json.loads(gs(daemon, "doctor", "--json").stdout)["checks"]}
        assert checks["processes"]["status"] == "WARN"
        assert f"pid {outsider.pid} (root: sleep 30) on GPU 0" in checks["processes"]["detail"]
    finally:
        outsider.kill()
        outsider.wait()


def test_doctor_fails_on_a_socket_others_cannot_use(daemon: DaemonHandle) -> None:
    os.chmod(daemon.socket, 0o600)
    result = gs(daemon, "doctor")
    assert result.exit_code == 1
    assert "FAIL  socket" in result.stdout and f"chmod 0666 {daemon.socket}" in result.stdout


def test_doctor_warns_of_drained_gpus_and_fails_when_none_is_left(daemon: DaemonHandle) -> None:
    """Every GPU drained (one by an XID, one by hand) and doctor said all passed (operator audit)."""
    from gpusched.protocol import SimInjectXidRequest, SimResult

    with daemon.client() as c:
        c.call(SimInjectXidRequest(gpu=0, xid=48), SimResult)
    # the XID reaches the engine through the device watcher: the drain follows, not at once
    wait_until(lambda: "health drained" in gs(daemon, "gpus").stdout, what="GPU 0 drained by the XID")
    result = gs(daemon, "doctor")
    assert result.exit_code == 0 and "WARN  gpu0.health  drained:" in result.stdout, result.stdout
    assert gs(daemon, "gpus", "drain", "1", "--reason", "fan").exit_code == 0
    result = gs(daemon, "doctor")
    assert result.exit_code == 1, result.stdout
    assert "drained by root: fan" in result.stdout and "FAIL  schedulable" in result.stdout


def test_doctor_says_whether_the_compiled_parts_are_in_use(daemon: DaemonHandle) -> None:
    """An operator must see when a daemon runs without the compiled core or the job's child in C
    (a wheel installed without building them, a build after the start): the same jobs, slower."""
    checks = {c["name"]: c for c in json.loads(gs(daemon, "doctor", "--json").stdout)["checks"]}
    assert checks["native"]["status"] == ("PASS" if gpusched.core.NATIVE else "WARN"), checks["native"]
    assert checks["execjob"]["status"] == ("PASS" if shim.EXECJOB else "WARN"), checks["execjob"]
    if shim.EXECJOB:
        assert checks["execjob"]["detail"].endswith(shim.EXECJOB)


def test_each_state_of_the_compiled_parts_has_its_own_words_and_fix() -> None:
    def one(**kw: object) -> list[tuple[str, str, str, str]]:
        args = {"native_in_use": True, "native_why_not": None, "execjob_in_use": "/x/gpusched-execjob-1-2",
                "execjob_now": "/x/gpusched-execjob-1-2", "execjob_env": "", **kw}
        return [(c.name, c.status, c.detail, c.hint) for c in compiled_parts(**args)]  # type: ignore[arg-type]

    assert [status for _, status, _, _ in one()] == ["PASS", "PASS"]
    native = one(native_in_use=False, native_why_not="not built (python -m gpusched.native build)")[0]
    assert native[1] == "WARN" and "not built" in native[2] and native[3].startswith("python -m gpusched.native build")
    native = one(native_in_use=False)[0]  # usable now, not when the daemon started
    assert native[1] == "WARN" and "since gpuschedd started" in native[2] and native[3] == "restart gpuschedd to use it"
    execjob = one(execjob_in_use=None, execjob_env="0", execjob_now=None)[1]
    assert execjob[1] == "WARN" and "GPUSCHED_EXECJOB=0" in execjob[2] and "unset GPUSCHED_EXECJOB" in execjob[3]
    execjob = one(execjob_in_use=None)[1]
    assert execjob[1] == "WARN" and "built after gpuschedd started" in execjob[2] and "restart" in execjob[3]
    execjob = one(execjob_in_use=None, execjob_now=None)[1]
    assert execjob[1] == "WARN" and "not built" in execjob[2]
    assert execjob[3].startswith("python -m gpusched.daemon.execjob_build")
