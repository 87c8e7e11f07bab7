"""The rows of issue #15: behaviour the real driver has that the simulator lacked, and how NvmlBackend
copes with it. Sources are cited next to each test (nvml.h as vendored in NVIDIA/go-nvml, NVIDIA/DCGM
issues, NVIDIA/go-nvlib commit e85aa94)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpusched.gpu.backend import GpuBusyError, GpuInvalidArgumentError, GpuPermissionError, XidEvent
from gpusched.gpu.holders import instance_holders
from gpusched.gpu.nvml import GI_REFUSED_HOLDOFF_S, NvmlBackend
from gpusched.gpu.profiles import MODELS
from gpusched.gpu.simnvml import SimNVML

HOPPER = [k for k, m in MODELS.items() if m.hopper]
AMPERE = [k for k, m in MODELS.items() if not m.hopper]


def _sim(spec: str, **kw: Any) -> SimNVML:
    s = SimNVML.from_spec(spec, seed=3, **kw)
    s.nvmlInit()
    return s


def _rev2_gi(s: SimNVML, h: Any) -> Any:
    """A 1-slice REV2 GI (1g.20gb / 1g.35gb ...) at start 0, created by 'another tool'."""
    info = s.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2)
    p = pynvml.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = 0, 2
    return s.nvmlDeviceCreateGpuInstanceWithPlacement(h, info.id, ctypes.byref(p))


# ------------------------------------------------------------------ simulator rows


def test_max_mig_device_count_is_zero_with_mig_off(sim: SimNVML) -> None:
    h = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlDeviceGetMaxMigDeviceCount(h) == 0  # nvml.h: "Returns zero if MIG is not ... enabled"
    sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert sim.nvmlDeviceGetMaxMigDeviceCount(h) == 7


def test_get_index_on_a_mig_handle_is_its_mig_index(mig_sim: SimNVML) -> None:
    h = mig_sim.nvmlDeviceGetHandleByIndex(0)
    for _ in range(3):
        gi = mig_sim.nvmlDeviceCreateGpuInstance(h, 19)
        mig_sim.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    seen = []
    for i in range(mig_sim.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            mig = mig_sim.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except pynvml.NVMLError_NotFound:
            continue
        assert mig_sim.nvmlDeviceGetIndex(mig) == i  # nvml.h: indices for GetMigDeviceHandleByIndex
        seen.append(i)
    assert len(seen) == 3
    assert mig_sim.nvmlDeviceGetIndex(h) == 0


@pytest.mark.parametrize("model", HOPPER)
def test_hopper_accepts_ci_rev1_on_rev2_gis(model: str) -> None:
    s = _sim(model)
    h = s.nvmlDeviceGetHandleByIndex(0)
    s.nvmlDeviceSetMigMode(h, 1)
    gi = _rev2_gi(s, h)
    rev1 = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1
    info = s.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, rev1, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    assert info.id == rev1 and info.sliceCount == 1
    ci = s.nvmlGpuInstanceCreateComputeInstance(gi, rev1)
    assert s.nvmlComputeInstanceGetInfo(ci).profileId == rev1
    # ... but not on an ordinary 1g GI (go-nvlib e85aa94 pairs REV1 with REV2 GIs only)
    gi19 = s.nvmlDeviceCreateGpuInstance(h, 19)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        s.nvmlGpuInstanceCreateComputeInstance(gi19, rev1)


@pytest.mark.parametrize("model", AMPERE)
def test_ampere_refuses_ci_rev1(model: str) -> None:
    s = _sim(model)
    h = s.nvmlDeviceGetHandleByIndex(0)
    s.nvmlDeviceSetMigMode(h, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        s.nvmlGpuInstanceCreateComputeInstance(_rev2_gi(s, h), pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1)


def test_handle_holder_refuses_destroy_without_processes() -> None:
    s = _sim("H200")
    h = s.nvmlDeviceGetHandleByIndex(0)
    s.nvmlDeviceSetMigMode(h, 1)
    gi = s.nvmlDeviceCreateGpuInstance(h, 9)
    ci = s.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    uuid = s.nvmlDeviceGetUUID(s.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
    s.hold_instance(uuid, level="ci")
    assert s.nvmlDeviceGetComputeRunningProcesses(h) == []
    with pytest.raises(pynvml.NVMLError_InUse):
        s.nvmlComputeInstanceDestroy(ci)
    s.release_instance(uuid)
    s.hold_instance(uuid, level="gi")
    s.nvmlComputeInstanceDestroy(ci)  # DCGM #276: GIs too can be the one refused
    with pytest.raises(pynvml.NVMLError_InUse):
        s.nvmlGpuInstanceDestroy(gi)


def test_privileged_reads_need_root() -> None:
    """nvml.h: these reads 'Require privileged user'; identity reads and MIG handles do not."""
    root = _sim("H100-80GB")
    h = root.nvmlDeviceGetHandleByIndex(0)
    root.nvmlDeviceSetMigMode(h, 1)
    gi = root.nvmlDeviceCreateGpuInstance(h, 19)
    root.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    root.set_privileged(False)
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
    gis = (pynvml.c_nvmlGpuInstance_t * 8)()
    cis = (pynvml.c_nvmlComputeInstance_t * 8)()
    n = ctypes.c_uint(0)
    calls = [
        lambda: root.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, arr, ctypes.byref(n)),
        lambda: root.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19),
        lambda: root.nvmlDeviceGetGpuInstances(h, 19, gis, ctypes.byref(n)),
        lambda: root.nvmlDeviceGetGpuInstanceById(h, 1),
        lambda: root.nvmlGpuInstanceGetComputeInstances(gi, 0, cis, ctypes.byref(n)),
        lambda: root.nvmlGpuInstanceGetComputeInstanceById(gi, 0),
        lambda: root.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0),
    ]
    for call in calls:
        with pytest.raises(pynvml.NVMLError_NoPermission):
            call()
    assert root.nvmlDeviceGetGpuInstanceProfileInfo(h, 0).id == 19
    mig = root.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert root.nvmlDeviceGetUUID(mig).startswith("MIG-")


def test_unprivileged_waits_hear_whole_device_events_only() -> None:
    """nvml.h nvmlEventSetWait: without privileges only events affecting the whole device are reported."""
    s = _sim("H100-80GB", privileged=False)
    b = NvmlBackend(s)
    assert b.wait_event(0) is None
    s.inject_xid(0, 13, gi=1, ci=0)
    s.inject_xid(0, 48)
    assert b.wait_event(200) == XidEvent(gpu_index=0, xid=48)
    assert b.wait_event(20) is None
    b.close()


# ------------------------------------------------------------------ NvmlBackend


def test_foreign_ci_rev1_is_schedulable() -> None:
    """A CI created elsewhere with 0x7 on a 1g.20gb no longer takes the whole GPU away."""
    s = SimNVML.from_spec("H100-80GB", seed=5)
    b = NvmlBackend(s)
    b.set_mig_mode(0, True)
    own = b.create_instance(0, "3g.40gb", 4)
    h = s.nvmlDeviceGetHandleByIndex(0)
    s.nvmlGpuInstanceCreateComputeInstance(_rev2_gi(s, h), pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1)
    inv = b.inventory()
    assert inv.errors == {}
    (gpu,) = inv.gpus
    foreign = next(i for i in gpu.instances if i.uuid != own.uuid)
    assert (foreign.profile, foreign.start, foreign.size, foreign.sm_count) == ("1g.20gb", 0, 2, 26)
    b.destroy_instance(foreign.uuid)  # and gpusched can remove it like its own
    assert [i.uuid for i in b.inventory().gpus[0].instances] == [own.uuid]
    b.close()


def test_partial_foreign_ci_is_schedulable_with_its_own_sm_count() -> None:
    s = SimNVML.from_spec("A100-40GB", seed=5)
    b = NvmlBackend(s)
    b.set_mig_mode(0, True)
    h = s.nvmlDeviceGetHandleByIndex(0)
    gi = s.nvmlDeviceCreateGpuInstance(h, 9)
    s.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)  # 1c.3g.20gb
    (inst,) = b.inventory().gpus[0].instances
    assert (inst.profile, inst.sm_count) == ("3g.20gb", 14)
    s.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    inv = b.inventory()  # two CIs in one GI: which one a job would get is undefined, so not schedulable
    assert inv.gpus == () and "2 compute instances" in inv.errors[0]
    b.close()


def _fake_proc(tmp_path: Path, holder_pid: int, comm: str, minor: int) -> Path:
    """A directory laid out like /proc: mig-minors plus one process with a cap file open."""
    caps = tmp_path / "driver" / "nvidia-caps"
    caps.mkdir(parents=True)
    (caps / "mig-minors").write_text(
        f"config 1\nmonitor 2\ngpu0/gi1/access 10\ngpu0/gi1/ci0/access 11\ngpu0/gi2/access {minor}\n"
    )
    fd = tmp_path / str(holder_pid) / "fd"
    fd.mkdir(parents=True)
    os.symlink(f"/dev/nvidia-caps/nvidia-cap{minor}", fd / "3")
    (tmp_path / str(holder_pid) / "comm").write_text(comm + "\n")
    other = tmp_path / "99" / "fd"
    other.mkdir(parents=True)
    os.symlink("/dev/null", other / "0")
    (tmp_path / "self").mkdir()
    return tmp_path


def test_holders_found_from_proc(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, 812, "nv-hostengine", 20)
    assert [(h.pid, h.command) for h in instance_holders(0, 2, None, proc_root=str(proc))] == [(812, "nv-hostengine")]
    assert instance_holders(0, 1, 0, proc_root=str(proc)) == []
    assert instance_holders(0, 2, None, proc_root=str(tmp_path / "absent")) == []


def _held_instance(tmp_path: Path, level: str, **kw: Any) -> tuple[NvmlBackend, SimNVML, Any]:
    s = SimNVML.from_spec("H200", seed=11)
    b = NvmlBackend(s, proc_root=str(tmp_path), **kw)
    b.set_mig_mode(0, True)
    inst = b.create_instance(0, "3g.71gb", 0)
    minor = 20 + inst.gi_id
    caps = tmp_path / "driver" / "nvidia-caps"
    caps.mkdir(parents=True)
    (caps / "mig-minors").write_text(f"gpu0/gi{inst.gi_id}/access {minor}\n"
                                     f"gpu0/gi{inst.gi_id}/ci{inst.ci_id}/access {minor + 100}\n")
    fd = tmp_path / "812" / "fd"
    fd.mkdir(parents=True)
    os.symlink(f"/dev/nvidia-caps/nvidia-cap{minor if level == 'gi' else minor + 100}", fd / "7")
    (tmp_path / "812" / "comm").write_text("nv-hostengine\n")
    s.hold_instance(inst.uuid, level=level)
    return b, s, inst


def test_destroy_refused_at_ci_names_holder_and_destroys_nothing(tmp_path: Path) -> None:
    b, s, inst = _held_instance(tmp_path, "ci")
    with pytest.raises(GpuBusyError, match=r"nv-hostengine \(pid 812\).*nothing was destroyed"):
        b.destroy_instance(inst.uuid)
    assert b.inventory().gpus[0].instances == (inst,)
    s.release_instance(inst.uuid)
    b.destroy_instance(inst.uuid)
    assert b.inventory().gpus[0].instances == ()
    b.close()


def test_destroy_refused_at_gi_leaves_a_whole_instance(tmp_path: Path) -> None:
    """Never "CI destroyed, GI left behind": the CI is re-created and the new UUID reported. Retries
    within the hold-off are refused without touching the driver (no new UUID every planning pass)."""
    now_s = [1000.0]
    b, s, inst = _held_instance(tmp_path, "gi", clock=lambda: now_s[0])
    with pytest.raises(GpuBusyError, match=r"nv-hostengine \(pid 812\).*whole again as MIG-") as err:
        b.destroy_instance(inst.uuid)
    (now,) = b.inventory().gpus[0].instances
    assert (now.profile, now.start, now.gi_id, now.sm_count) == (inst.profile, inst.start, inst.gi_id, inst.sm_count)
    assert now.uuid in err.value.message and now.uuid != inst.uuid
    now_s[0] += GI_REFUSED_HOLDOFF_S - 1
    s.release_instance(now.uuid)
    with pytest.raises(GpuBusyError, match=r"refused to be destroyed 59 s ago \(held by nv-hostengine"):
        b.destroy_instance(now.uuid)
    assert b.inventory().gpus[0].instances == (now,)  # untouched: same UUID
    now_s[0] += 1
    b.destroy_instance(now.uuid)
    assert b.inventory().gpus[0].instances == ()
    b.close()


def test_destroy_refused_without_known_holder_says_so(tmp_path: Path) -> None:
    s = SimNVML.from_spec("H100-80GB", seed=2)
    b = NvmlBackend(s, proc_root=str(tmp_path))  # an empty /proc: nobody found
    b.set_mig_mode(0, True)
    inst = b.create_instance(0, "1g.10gb", 6)
    s.hold_instance(inst.uuid)
    with pytest.raises(GpuBusyError, match="another NVML client"):
        b.destroy_instance(inst.uuid)
    b.close()


def test_unprivileged_backend() -> None:
    """Whole GPUs work; a MIG GPU's layout cannot be read, so that GPU is reported with the reason."""
    s = SimNVML.from_spec("H100-80GB:2", seed=4)
    s.nvmlInit()
    h = s.nvmlDeviceGetHandleByIndex(1)
    s.nvmlDeviceSetMigMode(h, 1)
    s.set_privileged(False)
    b = NvmlBackend(s)
    inv = b.inventory()
    assert [g.index for g in inv.gpus] == [0] and not inv.gpus[0].mig_enabled
    assert "gpu_no_permission" in inv.errors[1] and "NoPermission" in inv.errors[1]
    with pytest.raises(GpuPermissionError) as err:
        b.create_instance(1, "1g.10gb", 0)
    assert "root" in err.value.hint
    s.nvmlShutdown()
    b.close()


def test_query_is_read_only() -> None:
    b = NvmlBackend(SimNVML.from_spec("A100-40GB"))
    assert b.query("nvmlDeviceGetCount") == 1
    for fn in ("nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance", "nvmlGpuInstanceDestroy",
               "nvmlDeviceSetComputeMode", "nvmlShutdown"):
        with pytest.raises(GpuInvalidArgumentError, match="not a read-only"):
            b.query(fn, None)
    b.close()
