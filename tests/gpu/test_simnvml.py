"""SimNVML semantics, per model: the driver rules from reference/nvml-mig-mps.md."""

from __future__ import annotations

import ctypes
import re
import threading
import time
from typing import Any

import pynvml
import pytest

from gpusched.gpu.profiles import MODEL_KEYS, MODELS, profiles_for
from gpusched.gpu.simnvml import NO_ID, SimNVML

MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def dev(s: SimNVML, index: int = 0) -> Any:
    return s.nvmlDeviceGetHandleByIndex(index)


def lgip(s: SimNVML, enum: int) -> int:
    """The `-lgip` id for an enum, read the only correct way: from the info struct."""
    return int(s.nvmlDeviceGetGpuInstanceProfileInfo(dev(s), enum).id)


def create(s: SimNVML, enum: int, start: int | None = None) -> Any:
    pid = lgip(s, enum)
    if start is None:
        return s.nvmlDeviceCreateGpuInstance(dev(s), pid)
    size = next(p.memory_slices for p in profiles_for(model_of(s)) if p.enum == enum)
    pl = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    return s.nvmlDeviceCreateGpuInstanceWithPlacement(dev(s), pid, ctypes.byref(pl))


def model_of(s: SimNVML) -> str:
    name = s.nvmlDeviceGetName(dev(s))
    return next(k for k, m in MODELS.items() if m.driver_name == name)


def start_of(s: SimNVML, gi: Any) -> int:
    return int(s.nvmlGpuInstanceGetInfo(gi).placement.start)


def full_ci(s: SimNVML, gi: Any) -> Any:
    info = s.nvmlDeviceGetGpuInstanceProfileInfoById(dev(s), s.nvmlGpuInstanceGetInfo(gi).profileId)
    enum = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[info.sliceCount]
    shared = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    ci_info = s.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, enum, shared)
    return s.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)


def mig_uuid(s: SimNVML, ci: Any) -> str:
    info = s.nvmlComputeInstanceGetInfo(ci)
    gi_id = s.nvmlGpuInstanceGetInfo(info.gpuInstance).id
    for i in range(s.nvmlDeviceGetMaxMigDeviceCount(dev(s))):
        try:
            h = s.nvmlDeviceGetMigDeviceHandleByIndex(dev(s), i)
        except pynvml.NVMLError_NotFound:
            continue
        if (s.nvmlDeviceGetGpuInstanceId(h), s.nvmlDeviceGetComputeInstanceId(h)) == (gi_id, info.id):
            return str(s.nvmlDeviceGetUUID(h))
    raise AssertionError("no MIG device for CI")


# ---------------------------------------------------------------- init, spec, identity


def test_calls_before_init_and_after_shutdown_raise_uninitialized() -> None:
    s = SimNVML.from_spec("H100-80GB")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        s.nvmlDeviceGetCount()
    s.nvmlInit()
    s.nvmlInit()
    s.nvmlShutdown()
    assert s.nvmlDeviceGetCount() == 1  # init is reference counted, like the library
    s.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        s.nvmlDeviceGetHandleByIndex(0)


def test_from_spec_parses_and_rejects() -> None:
    s = SimNVML.from_spec("A100-40GB:2, H100-80GB:1,H200")
    s.nvmlInit()
    names = [s.nvmlDeviceGetName(dev(s, i)) for i in range(s.nvmlDeviceGetCount())]
    assert names == ["NVIDIA A100-SXM4-40GB"] * 2 + ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    for bad, part in [("V100:2", "V100:2"), ("H100-80GB:x", "H100-80GB:x"), ("H200:0", "H200:0"), ("", "")]:
        with pytest.raises(ValueError, match="valid models" if part in ("V100:2", "") else re.escape(part)):
            SimNVML.from_spec(bad)
    with pytest.raises(ValueError, match=re.escape(", ".join(MODEL_KEYS))):
        SimNVML.from_spec("B200")


def test_identity_and_memory(sim: SimNVML, model: str) -> None:
    h = dev(sim)
    assert GPU_UUID.match(sim.nvmlDeviceGetUUID(h))
    assert sim.nvmlDeviceGetHandleByUUID(sim.nvmlDeviceGetUUID(h)) is not None
    assert sim.nvmlDeviceGetName(h) == MODELS[model].driver_name
    mem = sim.nvmlDeviceGetMemoryInfo(h)
    assert mem.total == MODELS[model].memory_mib * 1024 * 1024 and mem.used == 0 and mem.free == mem.total
    assert sim.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).reserved == 0
    assert sim.nvmlSystemGetDriverVersion() == "550.90.07"
    assert sim.nvmlDeviceIsMigDeviceHandle(h).value == 0
    assert isinstance(sim.nvmlDeviceIsMigDeviceHandle(h), ctypes.c_uint)
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetHandleByIndex(5)


def test_exposes_pynvml_constants_structs_and_errors(sim: SimNVML) -> None:
    assert sim.NVML_ERROR_IN_USE == pynvml.NVML_ERROR_IN_USE
    assert sim.c_nvmlGpuInstancePlacement_t is pynvml.c_nvmlGpuInstancePlacement_t
    assert sim.NVMLError_InUse is pynvml.NVMLError_InUse
    with pytest.raises(AttributeError, match="does not simulate"):
        sim.nvmlDeviceGetTemperature  # noqa: B018 - an unsimulated NVML function must not reach a driver


def test_gpu_uuids_are_stable_per_spec() -> None:
    a, b = SimNVML.from_spec("H200:2", seed=1), SimNVML.from_spec("H200:2", seed=2)
    a.nvmlInit()
    b.nvmlInit()
    assert [a.nvmlDeviceGetUUID(dev(a, i)) for i in range(2)] == [b.nvmlDeviceGetUUID(dev(b, i)) for i in range(2)]


# ---------------------------------------------------------------- profiles and placements


def test_profile_calls_need_mig(sim: SimNVML) -> None:
    h = dev(sim)
    assert sim.nvmlDeviceGetMigMode(h) == [0, 0]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceCreateGpuInstance(h, 19)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)


def test_possible_placements_work_with_mig_off(sim: SimNVML, model: str) -> None:
    h = dev(sim)
    for p in profiles_for(model):
        count = ctypes.c_uint(0)
        sim.nvmlDeviceGetGpuInstancePossiblePlacements(h, p.profile_id, None, ctypes.byref(count))
        assert count.value == len(p.starts)
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        assert sim.nvmlDeviceGetGpuInstancePossiblePlacements(h, p.profile_id, arr, ctypes.byref(count)) == 0
        assert [(arr[i].start, arr[i].size) for i in range(count.value)] == list(p.placements)
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        sim.nvmlDeviceGetGpuInstancePossiblePlacements(
            h, 19, (pynvml.c_nvmlGpuInstancePlacement_t * 2)(), ctypes.byref(ctypes.c_uint())
        )


def test_two_profile_id_spaces(mig_sim: SimNVML, model: str) -> None:
    s, h = mig_sim, dev(mig_sim)
    for p in profiles_for(model):
        info = s.nvmlDeviceGetGpuInstanceProfileInfo(h, p.enum)
        assert (info.id, info.sliceCount, info.instanceCount, info.memorySizeMB) == (
            p.profile_id, p.slices, p.max_instances, p.memory_mib
        )
        assert info.multiprocessorCount == p.sm_count and info.name == f"MIG {p.name}"
        assert s.nvmlDeviceGetGpuInstanceProfileInfoV(h, p.enum).id == p.profile_id
        assert s.nvmlDeviceGetGpuInstanceProfileInfoById(h, p.profile_id).sliceCount == p.slices
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a valid enum this GPU does not offer
        s.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        s.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
    # The classic bug: passing the enum where the id belongs.
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        s.nvmlDeviceCreateGpuInstance(h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)  # "2" is no -lgip id
    gi = s.nvmlDeviceCreateGpuInstance(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)  # "0" is the 7g id!
    assert s.nvmlGpuInstanceGetInfo(gi).profileId == 0
    assert s.nvmlGpuInstanceGetInfo(gi).placement.size == 8


def test_default_placement_heuristic(mig_sim: SimNVML) -> None:
    s = mig_sim
    starts = [start_of(s, create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)) for _ in range(7)]
    assert starts == [6, 4, 5, 0, 1, 2, 3]
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)


def test_cgi_19_19_14_9_fails_on_the_3g(mig_sim: SimNVML) -> None:
    s = mig_sim
    e1, e2, e3 = (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE,
                  pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    create(s, e1)
    create(s, e1)
    create(s, e2)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(s, e3)


def test_cgi_9_19_14_19_placements(mig_sim: SimNVML) -> None:
    s = mig_sim
    order = [pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE,
             pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE]
    assert [start_of(s, create(s, e)) for e in order] == [4, 0, 2, 1]


def test_cgi_14_then_1g(mig_sim: SimNVML) -> None:
    s = mig_sim
    assert start_of(s, create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE)) == 4
    starts = [start_of(s, create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)) for _ in range(5)]
    assert starts == [6, 0, 1, 2, 3]


def test_placement_rules(mig_sim: SimNVML) -> None:
    s, h = mig_sim, dev(mig_sim)
    e3 = pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        create(s, e3, start=2)  # 3g only starts at 0 or 4
    bad_size = pynvml.c_nvmlGpuInstancePlacement_t(0, 3)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        s.nvmlDeviceCreateGpuInstanceWithPlacement(h, lgip(s, e3), ctypes.byref(bad_size))
    create(s, e3, start=4)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # overlap
        create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, start=4)
    create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, start=0)
    assert s.nvmlDeviceGetGpuInstanceRemainingCapacity(h, lgip(s, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE)) == 1
    assert s.nvmlDeviceGetGpuInstanceRemainingCapacity(h, lgip(s, e3)) == 0
    # a placement passed as the struct itself or as pointer() is accepted as well as byref()
    p1 = pynvml.c_nvmlGpuInstancePlacement_t(2, 1)
    s.nvmlDeviceCreateGpuInstanceWithPlacement(h, lgip(s, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE), ctypes.pointer(p1))


def test_instance_count_cap(mig_sim: SimNVML) -> None:
    s, h = mig_sim, dev(mig_sim)
    me = pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1
    create(s, me, start=0)
    assert s.nvmlDeviceGetGpuInstanceRemainingCapacity(h, lgip(s, me)) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(s, me, start=3)  # free slices, but +me is 1 per GPU


def test_get_gpu_instances_and_by_id(mig_sim: SimNVML) -> None:
    s, h = mig_sim, dev(mig_sim)
    e1 = pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
    made = [create(s, e1, start=st) for st in (0, 3)]
    arr = (pynvml.c_nvmlGpuInstance_t * 7)()
    count = ctypes.c_uint()
    s.nvmlDeviceGetGpuInstances(h, lgip(s, e1), arr, ctypes.byref(count))
    assert count.value == 2
    ids = sorted(s.nvmlGpuInstanceGetInfo(arr[i]).id for i in range(count.value))
    assert ids == sorted(s.nvmlGpuInstanceGetInfo(g).id for g in made)
    for gi_id in ids:
        assert s.nvmlGpuInstanceGetInfo(s.nvmlDeviceGetGpuInstanceById(h, gi_id)).id == gi_id
    with pytest.raises(pynvml.NVMLError_NotFound):
        s.nvmlDeviceGetGpuInstanceById(h, next(i for i in range(1, 15) if i not in ids))


def test_gi_ids_are_driver_assigned_not_predictable(model: str) -> None:
    first_ids = set()
    for seed in range(8):
        s = SimNVML([model], seed=seed)
        s.nvmlInit()
        s.nvmlDeviceSetMigMode(dev(s), 1)
        first_ids.add(s.nvmlGpuInstanceGetInfo(create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)).id)
    assert len(first_ids) > 1


# ---------------------------------------------------------------- compute instances and MIG devices


def test_ci_lifecycle_and_mig_devices(mig_sim: SimNVML, model: str) -> None:
    s, h = mig_sim, dev(mig_sim)
    gi = create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, start=0)
    prof = next(p for p in profiles_for(model) if p.enum == pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    ci_info = s.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 2, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    assert (ci_info.id, ci_info.sliceCount, ci_info.multiprocessorCount) == (2, 3, prof.sm_count)
    assert s.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, 0).name == f"MIG 1c.{prof.name}"
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a 4-slice CI does not fit a 3g GI
        s.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 3, 0)
    ci = s.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        s.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    info = s.nvmlComputeInstanceGetInfo(ci)
    assert info.profileId == 2 and s.nvmlGpuInstanceGetInfo(info.gpuInstance).id == s.nvmlGpuInstanceGetInfo(gi).id
    uuid = mig_uuid(s, ci)
    assert MIG_UUID.match(uuid)
    mig = s.nvmlDeviceGetHandleByUUID(uuid)
    assert s.nvmlDeviceIsMigDeviceHandle(mig).value == 1
    assert s.nvmlDeviceGetUUID(s.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)) == s.nvmlDeviceGetUUID(h)
    assert s.nvmlDeviceGetMemoryInfo(mig).total == prof.memory_mib * 1024 * 1024
    assert s.nvmlDeviceGetName(mig).endswith(f"MIG {prof.name}")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        s.nvmlDeviceGetGpuInstanceId(h)  # not a MIG handle
    arr = (pynvml.c_nvmlComputeInstance_t * 4)()
    count = ctypes.c_uint()
    s.nvmlGpuInstanceGetComputeInstances(gi, 2, arr, ctypes.byref(count))
    assert count.value == 1 and s.nvmlComputeInstanceGetInfo(arr[0]).id == info.id
    assert s.nvmlComputeInstanceGetInfo(s.nvmlGpuInstanceGetComputeInstanceById(gi, info.id)).id == info.id


def test_split_gi_into_small_cis(mig_sim: SimNVML) -> None:
    s = mig_sim
    gi = create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    assert s.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0) == 7
    cis = [s.nvmlGpuInstanceCreateComputeInstance(gi, 0) for _ in range(7)]
    assert len({s.nvmlComputeInstanceGetInfo(c).id for c in cis}) == 7
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        s.nvmlGpuInstanceCreateComputeInstance(gi, 0)


def test_destroy_order_busy_and_stale_handles(mig_sim: SimNVML) -> None:
    s, h = mig_sim, dev(mig_sim)
    gi = create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, start=2)
    ci = full_ci(s, gi)
    uuid = mig_uuid(s, ci)
    mig = s.nvmlDeviceGetHandleByUUID(uuid)
    with pytest.raises(pynvml.NVMLError_InUse):
        s.nvmlGpuInstanceDestroy(gi)  # it still has a CI
    s.add_process(uuid, 777, 1 << 30)
    with pytest.raises(pynvml.NVMLError_InUse):
        s.nvmlComputeInstanceDestroy(ci)  # a process runs on it
    s.remove_process(777)
    assert s.nvmlComputeInstanceDestroy(ci) == 0
    assert s.nvmlGpuInstanceDestroy(gi) == 0
    stale = [(s.nvmlComputeInstanceGetInfo, ci), (s.nvmlGpuInstanceGetInfo, gi), (s.nvmlDeviceGetUUID, mig)]
    for call, handle in stale:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            call(handle)
    with pytest.raises(pynvml.NVMLError_NotFound):
        s.nvmlDeviceGetHandleByUUID(uuid)
    assert s.nvmlDeviceGetGpuInstanceRemainingCapacity(h, lgip(s, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)) == 1


def test_mig_device_index_gaps(mig_sim: SimNVML) -> None:
    s, h = mig_sim, dev(mig_sim)
    cis = [full_ci(s, create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, start=st)) for st in (0, 1, 2)]
    uuids = [mig_uuid(s, c) for c in cis]
    s.nvmlComputeInstanceDestroy(cis[1])
    found, missing = [], []
    for i in range(s.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            found.append(s.nvmlDeviceGetUUID(s.nvmlDeviceGetMigDeviceHandleByIndex(h, i)))
        except pynvml.NVMLError_NotFound:
            missing.append(i)
    assert sorted(found) == sorted([uuids[0], uuids[2]])
    assert missing and min(missing) < max(i for i in range(7) if i not in missing)  # a real gap, not a tail


# ---------------------------------------------------------------- MIG mode


def test_set_mig_mode_pending_while_busy(sim: SimNVML) -> None:
    h = dev(sim)
    uuid = sim.nvmlDeviceGetUUID(h)
    sim.add_process(uuid, 4242, 1 << 20)
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_IN_USE
    assert sim.nvmlDeviceGetMigMode(h) == [0, 1]
    sim.remove_process(4242)
    assert sim.nvmlDeviceGetMigMode(h) == [0, 1]  # still pending until retried (or reset)
    assert sim.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert sim.nvmlDeviceGetMigMode(h) == [1, 1]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceSetMigMode(h, 7)


def test_reset_applies_pending_and_clears_mig_config(mig_sim: SimNVML) -> None:
    s, h = mig_sim, dev(mig_sim)
    ci = full_ci(s, create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE))
    uuid = mig_uuid(s, ci)
    s.add_process(uuid, 99, None)
    assert s.nvmlDeviceSetMigMode(h, 0) == pynvml.NVML_ERROR_IN_USE
    with pytest.raises(pynvml.NVMLError_InUse):
        s.reset_gpu(0)
    s.remove_process(99)
    s.reset_gpu(0)
    assert s.nvmlDeviceGetMigMode(h) == [0, 0]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        s.nvmlComputeInstanceGetInfo(ci)


def test_no_permission_for_unprivileged() -> None:
    s = SimNVML(["A100-80GB"], privileged=False)
    s.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NoPermission):
        s.nvmlDeviceSetMigMode(dev(s), 1)


def test_fail_next_injects_an_error(mig_sim: SimNVML) -> None:
    mig_sim.fail_next("nvmlDeviceCreateGpuInstance", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(pynvml.NVMLError_Unknown):
        create(mig_sim, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    create(mig_sim, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)


# ---------------------------------------------------------------- processes and telemetry


def test_processes_mig_off(sim: SimNVML) -> None:
    h = dev(sim)
    sim.add_process(sim.nvmlDeviceGetUUID(h), 10, 2 << 30)
    sim.add_process(sim.nvmlDeviceGetUUID(h), 11, None)
    procs = sim.nvmlDeviceGetComputeRunningProcesses(h)
    assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in procs] == [
        (10, 2 << 30, NO_ID, NO_ID), (11, None, NO_ID, NO_ID)
    ]
    assert sim.nvmlDeviceGetMemoryInfo(h).used == 2 << 30
    with pytest.raises(ValueError, match="already"):
        sim.add_process(sim.nvmlDeviceGetUUID(h), 10, 1)
    with pytest.raises(ValueError, match="out of memory"):
        sim.add_process(sim.nvmlDeviceGetUUID(h), 12, 1 << 50)
    sim.set_utilization(0, 73, 20)
    assert sim.nvmlDeviceGetUtilizationRates(h).gpu == 73


def test_processes_mig_on(mig_sim: SimNVML) -> None:
    s, h = mig_sim, dev(mig_sim)
    ci = full_ci(s, create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, start=0))
    uuid = mig_uuid(s, ci)
    with pytest.raises(ValueError, match="MIG mode"):
        s.add_process(s.nvmlDeviceGetUUID(h), 5, 1)
    s.add_process(uuid, 5, 1 << 20)
    mig = s.nvmlDeviceGetHandleByUUID(uuid)
    (p,) = s.nvmlDeviceGetComputeRunningProcesses(mig)
    assert (p.pid, p.gpuInstanceId, p.computeInstanceId) == (
        5, s.nvmlDeviceGetGpuInstanceId(mig), s.nvmlDeviceGetComputeInstanceId(mig)
    )
    assert [q.pid for q in s.nvmlDeviceGetComputeRunningProcesses(h)] == [5]
    for handle in (h, mig):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            s.nvmlDeviceGetUtilizationRates(handle)


def test_affinity_and_numa(model: str) -> None:
    s = SimNVML([model] * 4, host_cpus=64, numa_nodes=2)
    s.nvmlInit()
    first = s.nvmlDeviceGetCpuAffinity(dev(s, 0), 1)
    last = s.nvmlDeviceGetCpuAffinityWithinScope(dev(s, 3), 2, pynvml.NVML_AFFINITY_SCOPE_NODE)
    assert first[0] == (1 << 32) - 1 and last[0] == ((1 << 32) - 1) << 32 and last[1] == 0
    assert s.nvmlDeviceGetMemoryAffinity(dev(s, 3), 1, pynvml.NVML_AFFINITY_SCOPE_NODE)[0] == 0b10
    with pytest.raises(pynvml.NVMLError_NotSupported):
        s.nvmlDeviceGetNumaNodeId(dev(s, 0))


# ---------------------------------------------------------------- events, loss, threads


def _xid_set(s: SimNVML, index: int = 0) -> Any:
    es = s.nvmlEventSetCreate()
    h = dev(s, index)
    mask = pynvml.nvmlEventTypeXidCriticalError & s.nvmlDeviceGetSupportedEventTypes(h)
    s.nvmlDeviceRegisterEvents(h, mask, es)
    return es


def test_event_wait_blocks_then_times_out(sim: SimNVML) -> None:
    es = _xid_set(sim)
    t0 = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        sim.nvmlEventSetWait(es, 50)
    assert time.monotonic() - t0 >= 0.045
    sim.nvmlEventSetFree(es)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlEventSetWait(es, 0)


def test_xid_delivered_once_to_each_set(mig_sim: SimNVML) -> None:
    s = mig_sim
    a, b = _xid_set(s), _xid_set(s)
    s.inject_xid(0, 79)
    s.inject_xid(0, 31, gi=3, ci=0)
    for es in (a, b):
        first = s.nvmlEventSetWait_v2(es, 0)
        assert (first.eventType, first.eventData, first.gpuInstanceId, first.computeInstanceId) == (
            pynvml.nvmlEventTypeXidCriticalError, 79, NO_ID, NO_ID
        )
        assert s.nvmlDeviceGetUUID(first.device) == s.nvmlDeviceGetUUID(dev(s))
        second = s.nvmlEventSetWait(es, 0)
        assert (second.eventData, second.gpuInstanceId, second.computeInstanceId) == (31, 3, 0)
        with pytest.raises(pynvml.NVMLError_Timeout):
            s.nvmlEventSetWait(es, 0)


def test_events_need_parent_handle_and_supported_types(mig_sim: SimNVML) -> None:
    s = mig_sim
    uuid = mig_uuid(s, full_ci(s, create(s, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)))
    es = s.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        s.nvmlDeviceRegisterEvents(s.nvmlDeviceGetHandleByUUID(uuid), pynvml.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        s.nvmlDeviceRegisterEvents(dev(s), pynvml.nvmlEventTypeClock, es)
    s.inject_xid(0, 48)  # not registered: not recorded
    with pytest.raises(pynvml.NVMLError_Timeout):
        s.nvmlEventSetWait(es, 0)


def test_wait_in_thread_is_woken_by_inject_and_does_not_block_other_calls(sim: SimNVML) -> None:
    es = _xid_set(sim)
    got: list[int] = []

    def waiter() -> None:
        got.append(int(sim.nvmlEventSetWait(es, 5000).eventData))

    t = threading.Thread(target=waiter)
    t0 = time.monotonic()
    t.start()
    for _ in range(20):  # the API stays usable while a thread waits
        sim.nvmlDeviceGetMemoryInfo(dev(sim))
    sim.inject_xid(0, 94)
    t.join(timeout=5)
    assert got == [94] and time.monotonic() - t0 < 2


def test_lost_gpu(mig_sim: SimNVML) -> None:
    s = SimNVML(["H100-80GB", "H200"], seed=3)
    s.nvmlInit()
    h1 = dev(s, 1)
    es = _xid_set(s, 1)
    s.lose_gpu(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        s.nvmlEventSetWait(es, 1000)
    with pytest.raises(pynvml.NVMLError_Timeout):
        s.nvmlEventSetWait(es, 0)  # reported once
    for call in (s.nvmlDeviceGetName, s.nvmlDeviceGetMemoryInfo, s.nvmlDeviceGetMigMode):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(h1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        s.nvmlDeviceGetHandleByIndex(1)
    assert s.nvmlDeviceGetName(dev(s, 0)) == "NVIDIA H100 80GB HBM3"
