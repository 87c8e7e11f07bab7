"""The simulated driver's init/system calls, device queries (identity, memory, utilization,
affinity, NUMA) and compute-process listings."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

from gpusched.gpu.simnvml_state import (
    NO_ID,
    MiB,
    SimCore,
    _api,
    _ci_name,
    _Gpu,
    _MigDevice,
)


class DeviceMixin(SimCore):
    """The simulated driver's init/system calls, device queries (identity, memory, utilization,."""

    # ------------------------------------------------------------------ init / system

    def nvmlInit(self) -> None:
        with self._lock:
            self._init_count += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    @_api
    def nvmlShutdown(self) -> None:
        self._init_count -= 1

    @_api
    def nvmlSystemGetDriverVersion(self) -> str:
        return self._driver_version

    @_api
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    # ------------------------------------------------------------------ devices

    @_api
    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    @_api
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self._gpus):
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpus[index]
        if gpu.lost:
            self._fail(self._nv.NVML_ERROR_GPU_IS_LOST)
        return gpu.handle

    @_api
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self._gpus:
            if gpu.uuid == text:
                if gpu.lost:
                    self._fail(self._nv.NVML_ERROR_GPU_IS_LOST)
                return gpu.handle
            for ci in self._live_cis(gpu):
                if ci.uuid == text:
                    if gpu.lost:
                        self._fail(self._nv.NVML_ERROR_GPU_IS_LOST)
                    return ci.dev_handle
        self._fail(self._nv.NVML_ERROR_NOT_FOUND)

    @_api
    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        """The GPU index; on a MIG handle the MIG device index, the one GetMigDeviceHandleByIndex takes
        (nvml.h: "When used with MIG device handles this API returns indices that can be passed to
        nvmlDeviceGetMigDeviceHandleByIndex")."""
        dev = self._device(handle)
        return dev.index if isinstance(dev, _Gpu) else dev.ci.mig_index

    @_api
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        """The /dev/nvidia<N> minor; the simulator numbers them like the indices."""
        return self._gpu(handle).index

    @_api
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        dev = self._device(handle)
        return dev.uuid if isinstance(dev, _Gpu) else dev.ci.uuid

    @_api
    def nvmlDeviceGetName(self, handle: Any) -> str:
        dev = self._device(handle)
        if isinstance(dev, _Gpu):
            return dev.model.driver_name
        return f"{dev.ci.gi.gpu.model.driver_name} MIG {_ci_name(dev.ci.gi, dev.ci.slices)}"

    @_api
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        dev = self._device(handle)
        if isinstance(dev, _Gpu):
            total = dev.model.memory_mib * MiB
            used = sum(p.used or 0 for p in self._processes.values() if p.gpu is dev)
        else:
            gi = dev.ci.gi
            total = gi.profile.memory_mib * MiB
            used = sum(p.used or 0 for p in self._processes.values() if p.ci is not None and p.ci.gi is gi)
        if version:
            mem = self._nv.c_nvmlMemory_v2_t()
            mem.version = version
            mem.reserved = 0
        else:
            mem = self._nv.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = total, used, total - used
        return mem

    @_api
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        dev = self._device(handle)
        if isinstance(dev, _MigDevice) or dev.mig_current:
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)  # "not currently supported" on MIG-enabled GPUs
        util = self._nv.c_nvmlUtilization_t()
        util.gpu, util.memory = dev.util_gpu, dev.util_memory
        return util

    @_api
    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpuSetSize: int) -> Any:
        return self._mask(self._gpu_of(self._device(handle)).cpus, cpuSetSize)

    @_api
    def nvmlDeviceGetCpuAffinityWithinScope(self, handle: Any, cpuSetSize: int, scope: int) -> Any:
        if scope not in (self._nv.NVML_AFFINITY_SCOPE_NODE, self._nv.NVML_AFFINITY_SCOPE_SOCKET):
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        return self._mask(self._gpu_of(self._device(handle)).cpus, cpuSetSize)

    @_api
    def nvmlDeviceGetMemoryAffinity(self, handle: Any, nodeSetSize: int, scope: int) -> Any:
        if scope not in (self._nv.NVML_AFFINITY_SCOPE_NODE, self._nv.NVML_AFFINITY_SCOPE_SOCKET):
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        return self._mask((self._gpu_of(self._device(handle)).numa_node,), nodeSetSize)

    @staticmethod
    def _mask(bits: Iterable[int], words: int) -> Any:
        arr = (ctypes.c_ulonglong * words)()
        for bit in bits:
            if bit // 64 < words:
                arr[bit // 64] |= 1 << (bit % 64)
        return arr

    @_api
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        self._device(handle)
        self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)  # only where GPUs are NUMA nodes (Grace); x86 says no

    # ------------------------------------------------------------------ processes

    @_api
    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any) -> list[Any]:
        dev = self._device(handle)
        if isinstance(dev, _Gpu):
            procs = [p for p in self._processes.values() if p.gpu is dev]
        else:
            procs = [p for p in self._processes.values() if p.ci is dev.ci]
        out = []
        for p in sorted(procs, key=lambda p: p.pid):
            info = self._nv.c_nvmlProcessInfo_v3_t()
            info.pid = p.pid
            info.usedGpuMemory = p.used if p.used is not None else self._nv.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            info.gpuInstanceId = p.ci.gi.id if p.ci is not None else NO_ID
            info.computeInstanceId = p.ci.id if p.ci is not None else NO_ID
            obj = self._nv.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == self._nv.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses_v3
    nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses_v3
