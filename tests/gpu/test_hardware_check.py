"""tools/hardware_check against the simulator: no difference when the 'driver' is the simulator,
every difference printed when it is not, and never a write to the driver."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from typing import Any

import pynvml
import pytest

from gpusched.gpu.simnvml import SimNVML
from gpusched.tools import hardware_check

_WRITES = ("nvmlDeviceSet", "nvmlDeviceCreate", "nvmlGpuInstanceCreate", "nvmlGpuInstanceDestroy",
           "nvmlComputeInstanceDestroy", "nvmlDeviceReset", "nvmlDeviceClear")


class Recording:
    """The 'driver': a SimNVML behind a proxy that records every NVML function called on it."""

    def __init__(self, sim: SimNVML) -> None:
        self.sim = sim
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.sim, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):
            self.calls.append(name)
        return value


class H200WithOldTables(SimNVML):
    """A 'driver' that answers what the simulator used to answer for H200 1g.18gb (17664 MiB)."""

    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        info = super().nvmlDeviceGetGpuInstanceProfileInfo(device, profile, version)
        if info.id == 19:
            info.memorySizeMB = 17664
        return info


def _layout(sim: SimNVML) -> None:
    """MIG on GPU 1 with a 3g, a 1g.20gb holding a REV1 CI (as another tool may make it), a bare GI."""
    sim.nvmlInit()
    h = sim.nvmlDeviceGetHandleByIndex(1)
    sim.nvmlDeviceSetMigMode(h, 1)
    for pid, start, size, ci in ((9, 4, 4, 2), (15, 0, 2, 7), (19, 2, 1, -1)):
        p = pynvml.c_nvmlGpuInstancePlacement_t()
        p.start, p.size = start, size
        gi = sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, ctypes.byref(p))
        if ci >= 0:
            sim.nvmlGpuInstanceCreateComputeInstance(gi, ci)
    sim.nvmlShutdown()


def _state(sim: SimNVML) -> tuple[Any, ...]:
    sim.nvmlInit()
    out = []
    for i in range(sim.nvmlDeviceGetCount()):
        h = sim.nvmlDeviceGetHandleByIndex(i)
        mig = tuple(sim.nvmlDeviceGetMigMode(h))
        uuids = []
        for k in range(sim.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                uuids.append(sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetMigDeviceHandleByIndex(h, k)))
            except pynvml.NVMLError_NotFound:
                continue
        out.append((mig, tuple(uuids)))
    sim.nvmlShutdown()
    return tuple(out)


def test_identical_driver_has_no_difference_and_is_never_written(capsys: pytest.CaptureFixture[str]) -> None:
    sim = SimNVML.from_spec("A100-40GB,H100-80GB,GH200-144GB", seed=9)
    sim_h100 = SimNVML.from_spec("H100-80GB:2", seed=9)
    _layout(sim_h100)
    for driver_sim in (sim, sim_h100):
        before = _state(driver_sim)
        rec = Recording(driver_sim)
        assert hardware_check.main([], driver_module=rec) == 0
        out = capsys.readouterr().out
        assert " 0 differ, 0 problems" in out
        assert rec.calls and not [c for c in rec.calls if c.startswith(_WRITES)]
        assert _state(driver_sim) == before


def test_differences_are_printed() -> None:
    driver = H200WithOldTables(["H200", "A100-80GB"], seed=1)
    driver.nvmlInit()
    driver.nvmlDeviceSetMigMode(driver.nvmlDeviceGetHandleByIndex(0), 1)
    driver.nvmlShutdown()
    result = hardware_check.compare(_backend(driver), privileged=True)
    assert result["differences"] == [
        {"fact": "gpu0.profile[1g.18gb].memorySizeMB", "driver": 17664, "simulator": 16384}
    ]


def _backend(sim: SimNVML) -> Any:
    from gpusched.gpu.nvml import NvmlBackend

    return NvmlBackend(sim)


def test_exit_code_and_json_on_difference(capsys: pytest.CaptureFixture[str]) -> None:
    driver = H200WithOldTables(["H200"], seed=1)
    driver.nvmlInit()
    driver.nvmlDeviceSetMigMode(driver.nvmlDeviceGetHandleByIndex(0), 1)
    driver.nvmlShutdown()
    assert hardware_check.main(["--json"], driver_module=driver) == 1
    data = json.loads(capsys.readouterr().out)
    assert [d["fact"] for d in data["differences"]] == ["gpu0.profile[1g.18gb].memorySizeMB"]
    assert data["driver"]["gpu0.model"] == "H200" and data["compared"] > 50


def test_unknown_model_is_a_problem(capsys: pytest.CaptureFixture[str]) -> None:
    class Renamed(SimNVML):
        def nvmlDeviceGetName(self, handle: Any) -> str:
            return "NVIDIA B200"

    assert hardware_check.main([], driver_module=Renamed(["H100-80GB"])) == 1
    assert "PROBLEM gpu0: no simulator table for 'NVIDIA B200'" in capsys.readouterr().out


def test_unprivileged_run_compares_what_an_unprivileged_daemon_sees(capsys: pytest.CaptureFixture[str]) -> None:
    driver = SimNVML.from_spec("H100-80GB:2", seed=9)
    _layout(driver)
    driver.set_privileged(False)
    assert hardware_check.main([], driver_module=driver) == 0
    out = capsys.readouterr().out
    assert " 0 differ" in out and "NOTE not root" in out


def test_runs_as_a_script() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpusched.tools.hardware_check", "--driver-sim", "H200:2,GH200-96GB"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "0 differ, 0 problems" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "gpusched.tools.hardware_check", "--driver-sim", "B200"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert bad.returncode == 2 and "unknown model 'B200'" in bad.stderr
