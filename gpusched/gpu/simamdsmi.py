"""A stateful, in-process stand-in for the `amdsmi` Python package (a fake, not a mock).

`SimAmdSmi` has amdsmi's function names, signatures, return shapes, enums, status codes and exception
classes (simamdsmi_api), keeps real state (simamdsmi_state: physical GPUs, their compute and memory
partition modes, the devices enumerated at amdsmi_init, processes, event readers) and enforces the
rules of the library, rocm_smi and the amdgpu driver it sits on, so `gpu/amdsmi.py` runs the same code
path against it as against the real library. Every rule's source is in docs/gpu.md, "AMD Instinct
(amdsmi)". Test hooks (not in amdsmi) live in simamdsmi_hooks.

Mode changes, as the driver does them:
- compute (amdsmi_set_gpu_compute_partition): root only (NO_PERM); a mode the GPU does not offer with
  its current memory mode -> SETTING_UNAVAILABLE (rocm_smi is_available_compute_partition over the
  kernel's available_compute_partition); any process on the physical GPU -> BUSY (amdgpu refuses to
  switch while KFD processes exist: amdgpu_amdkfd_check_and_lock_kfd returns -EBUSY); the same mode
  is a no-op. The GPU's logical devices are re-created: handles from before fail NOT_FOUND until
  amdsmi_shut_down + amdsmi_init enumerate the new ones.
- memory (amdsmi_set_gpu_memory_partition): root only; rocm_smi accepts it only on boards whose name
  contains "mi" and "00x" (NOT_SUPPORTED otherwise, rocm_smi.cc rsmi_dev_memory_partition_set); the
  new mode takes effect by reloading amdgpu, which fails while any process uses any GPU
  (AMDGPU_RESTART_ERR) and re-creates every device of every GPU. A compute mode that is not compatible
  with the new memory mode is replaced by the kernel's automatic choice (aqua_vanjaram.c
  __aqua_vanjaram_get_auto_mode: NPS1 -> SPX, NPS4 on an 8-XCD dGPU -> QPX).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

from gpusched.gpu.amd_profiles import MEMORY_PARTITIONS_PER_MODE
from gpusched.gpu.simamdsmi_api import (
    AMDSMI_STATUS_AMDGPU_RESTART_ERR,
    AMDSMI_STATUS_BUSY,
    AMDSMI_STATUS_INVAL,
    AMDSMI_STATUS_NO_DATA,
    AMDSMI_STATUS_NO_PERM,
    AMDSMI_STATUS_NOT_SUPPORTED,
    AMDSMI_STATUS_SETTING_UNAVAILABLE,
    AmdSmiComputePartitionType,
    AmdSmiEvtNotificationType,
    AmdSmiInitFlags,
    AmdSmiMemoryPartitionType,
    AmdSmiMemoryType,
    AmdSmiParameterException,
    fail,
)
from gpusched.gpu.simamdsmi_hooks import HooksMixin
from gpusched.gpu.simamdsmi_state import _api, _Logical, _Reader

MiB = 1024 * 1024


class SimAmdSmi(HooksMixin):
    """Simulated amdsmi. Build with `SimAmdSmi.from_spec("MI300X:2")`; call amdsmi_init first."""

    # The library's enums and exception classes, as attributes of the module object.
    from gpusched.gpu.simamdsmi_api import (
        AmdSmiComputePartitionType,
        AmdSmiEvtNotificationType,
        AmdSmiException,
        AmdSmiInitFlags,
        AmdSmiLibraryException,
        AmdSmiMemoryPartitionType,
        AmdSmiMemoryType,
        AmdSmiParameterException,
        AmdSmiRetryException,
        AmdSmiTimeoutException,
        amdsmi_wrapper,
    )

    # ------------------------------------------------------------------ init and enumeration

    def amdsmi_init(self, flag: AmdSmiInitFlags = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        if not isinstance(flag, AmdSmiInitFlags):
            raise AmdSmiParameterException(flag, AmdSmiInitFlags)
        with self._lock:
            self._enumerate()
            self._initialized = True

    @_api
    def amdsmi_shut_down(self) -> None:
        self._initialized = False
        self._handles.clear()
        self._sockets.clear()
        self._readers.clear()
        self._events.clear()
        self._cond.notify_all()

    @_api
    def amdsmi_get_socket_handles(self) -> list[ctypes.c_void_p]:
        return [ctypes.c_void_p(v) for v in self._sockets]

    @_api
    def amdsmi_get_socket_info(self, socket_handle: Any) -> str:
        return self._socket(socket_handle).socket_id

    @_api
    def amdsmi_get_processor_handles(self) -> list[ctypes.c_void_p]:
        return [ctypes.c_void_p(v) for v in self._order]

    # ------------------------------------------------------------------ identity

    @_api
    def amdsmi_get_gpu_device_uuid(self, processor_handle: Any) -> str:
        return self._logical(processor_handle).physical.uuid

    @_api
    def amdsmi_get_gpu_device_bdf(self, processor_handle: Any) -> str:
        return f"0000:{self._logical(processor_handle).physical.bus:02x}:00.0"

    @_api
    def amdsmi_get_gpu_bdf_id(self, processor_handle: Any) -> int:
        dev = self._logical(processor_handle)
        return (dev.partition_id << 28) | (dev.physical.bus << 8)

    @_api
    def amdsmi_get_gpu_kfd_info(self, processor_handle: Any) -> dict[str, Any]:
        dev = self._logical(processor_handle)
        return {"kfd_id": dev.kfd_id, "node_id": dev.kfd_id, "current_partition_id": dev.partition_id}

    @_api
    def amdsmi_get_gpu_asic_info(self, processor_handle: Any) -> dict[str, Any]:
        """num_compute_units is the logical GPU's (the KFD node's), market_name the product's."""
        dev = self._logical(processor_handle)
        model = dev.physical.model
        return {
            "market_name": model.market_name,
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002",
            "device_id": hex(model.device_id),
            "rev_id": "0x00",
            "asic_serial": f"0x{dev.physical.asic_serial:016X}",
            "oam_id": dev.physical.index,
            "num_compute_units": model.cus_per_partition(dev.physical.compute),
            "target_graphics_version": "gfx942",
        }

    @_api
    def amdsmi_get_gpu_driver_info(self, processor_handle: Any) -> dict[str, str]:
        self._logical(processor_handle)
        return {"driver_name": "amdgpu", "driver_version": self._driver_version, "driver_date": "2015/01/01 00:00"}

    @_api
    def amdsmi_topo_get_numa_node_number(self, processor_handle: Any) -> int:
        return self._logical(processor_handle).physical.numa_node

    # ------------------------------------------------------------------ memory and activity

    def _vram_total(self, dev: _Logical) -> int:
        phys = dev.physical
        return phys.model.memory_per_partition_mib(phys.compute, phys.memory) * MiB

    def _vram_used(self, dev: _Logical) -> int:
        return sum(p.vram_bytes for p in self._processes.values()
                   if p.physical is dev.physical and p.partition_id == dev.partition_id)

    @_api
    def amdsmi_get_gpu_memory_total(self, processor_handle: Any, mem_type: AmdSmiMemoryType) -> int:
        if not isinstance(mem_type, AmdSmiMemoryType):
            raise AmdSmiParameterException(mem_type, AmdSmiMemoryType)
        dev = self._logical(processor_handle)
        if mem_type != AmdSmiMemoryType.VRAM:
            fail(AMDSMI_STATUS_NOT_SUPPORTED)  # only VRAM is modelled
        return self._vram_total(dev)

    @_api
    def amdsmi_get_gpu_memory_usage(self, processor_handle: Any, mem_type: AmdSmiMemoryType) -> int:
        if not isinstance(mem_type, AmdSmiMemoryType):
            raise AmdSmiParameterException(mem_type, AmdSmiMemoryType)
        dev = self._logical(processor_handle)
        if mem_type != AmdSmiMemoryType.VRAM:
            fail(AMDSMI_STATUS_NOT_SUPPORTED)
        return self._vram_used(dev)

    @_api
    def amdsmi_get_gpu_vram_usage(self, processor_handle: Any) -> dict[str, int]:
        """In MB, as the library reports it."""
        dev = self._logical(processor_handle)
        return {"vram_total": self._vram_total(dev) // MiB, "vram_used": self._vram_used(dev) // MiB}

    @_api
    def amdsmi_get_gpu_activity(self, processor_handle: Any) -> dict[str, Any]:
        dev = self._logical(processor_handle)
        return {"gfx_activity": dev.physical.activity, "umc_activity": 0, "mm_activity": "N/A"}

    @_api
    def amdsmi_get_gpu_process_list(self, processor_handle: Any) -> list[dict[str, Any]]:
        dev = self._logical(processor_handle)
        return [
            {
                "name": p.name or "N/A",
                "pid": p.pid,
                "mem": p.vram_bytes,
                "engine_usage": {"gfx": 0, "enc": 0},
                "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": p.vram_bytes},
            }
            for p in sorted(self._processes.values(), key=lambda p: p.pid)
            if p.physical is dev.physical and p.partition_id == dev.partition_id
        ]

    # ------------------------------------------------------------------ partitions

    @_api
    def amdsmi_get_gpu_compute_partition(self, processor_handle: Any) -> str:
        return self._logical(processor_handle).physical.compute

    @_api
    def amdsmi_get_gpu_memory_partition(self, processor_handle: Any) -> str:
        return self._logical(processor_handle).physical.memory

    @_api
    def amdsmi_set_gpu_compute_partition(self, processor_handle: Any,
                                         compute_partition: AmdSmiComputePartitionType) -> None:
        if not isinstance(compute_partition, AmdSmiComputePartitionType):
            raise AmdSmiParameterException(compute_partition, AmdSmiComputePartitionType)
        phys = self._logical(processor_handle).physical
        if not self._privileged:
            fail(AMDSMI_STATUS_NO_PERM)
        if compute_partition == AmdSmiComputePartitionType.INVALID:
            fail(AMDSMI_STATUS_INVAL)
        mode = compute_partition.name
        if not phys.model.is_valid(mode, phys.memory):
            fail(AMDSMI_STATUS_SETTING_UNAVAILABLE)
        if mode == phys.compute:
            return
        if self._busy(phys):
            fail(AMDSMI_STATUS_BUSY)
        phys.compute = mode
        phys.generation += 1

    @_api
    def amdsmi_set_gpu_memory_partition(self, processor_handle: Any,
                                        memory_partition: AmdSmiMemoryPartitionType) -> None:
        if not isinstance(memory_partition, AmdSmiMemoryPartitionType):
            raise AmdSmiParameterException(memory_partition, AmdSmiMemoryPartitionType)
        phys = self._logical(processor_handle).physical
        if not self._privileged:
            fail(AMDSMI_STATUS_NO_PERM)
        name = phys.model.market_name.lower()
        if not ("mi" in name and "00x" in name):
            fail(AMDSMI_STATUS_NOT_SUPPORTED)
        if memory_partition == AmdSmiMemoryPartitionType.UNKNOWN:
            fail(AMDSMI_STATUS_INVAL)
        mode = memory_partition.name
        if mode == phys.memory:
            return
        if mode not in phys.model.memory_modes:
            fail(AMDSMI_STATUS_SETTING_UNAVAILABLE)
        if self._processes:
            fail(AMDSMI_STATUS_AMDGPU_RESTART_ERR)  # the driver reload needs every GPU idle
        phys.memory = mode
        if not phys.model.is_valid(phys.compute, mode):
            phys.compute = "SPX" if MEMORY_PARTITIONS_PER_MODE[mode] == 1 else "QPX"
        for other in self._physicals:  # the reload re-creates every device
            other.generation += 1

    # ------------------------------------------------------------------ events

    def AmdSmiEventReader(self, processor_handle: Any,
                          event_types: list[AmdSmiEvtNotificationType]) -> SimEventReader:
        """amdsmi's AmdSmiEventReader: registers the device for the given event types."""
        return SimEventReader(self, processor_handle, event_types)

    def _register(self, processor_handle: Any, event_types: list[AmdSmiEvtNotificationType]) -> _Reader:
        for t in event_types:
            if not isinstance(t, AmdSmiEvtNotificationType):
                raise AmdSmiParameterException(t, AmdSmiEvtNotificationType)
        mask = 0
        for t in event_types:
            if t != AmdSmiEvtNotificationType.NONE:
                mask |= 1 << (int(t) - 1)
        with self._lock:
            if not self._initialized:
                fail(32)
            reader = _Reader([self._logical(processor_handle)], mask)
            self._readers.append(reader)
            return reader

    def _read(self, timeout_ms: int, num_elem: int) -> list[dict[str, Any]]:
        """amdsmi_get_gpu_event_notification: events of every registered device, waiting up to
        timeout_ms for the first; none -> AMDSMI_STATUS_NO_DATA (rocm_smi.cc rsmi_event_notification_get)."""
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        with self._lock:
            while True:
                if not self._initialized:
                    fail(32)
                out = self._take(num_elem)
                if out:
                    return out
                left = deadline - time.monotonic()
                if left <= 0:
                    fail(AMDSMI_STATUS_NO_DATA)
                self._cond.wait(left)

    def _take(self, num_elem: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        keep = []
        while self._events:
            ev = self._events.popleft()
            wanted = any(not r.stopped and r.mask & (1 << (ev.kind - 1)) and
                         any(d.physical is ev.physical and d.partition_id == ev.partition_id
                             for d in r.devices) for r in self._readers)
            value = next((v for v, d in self._handles.items() if d.physical is ev.physical
                          and d.partition_id == ev.partition_id and d.generation == ev.physical.generation), None)
            if not wanted or value is None:
                continue
            if len(out) < num_elem:
                out.append({"processor_handle": ctypes.c_void_p(value),
                            "event": AmdSmiEvtNotificationType(ev.kind).name, "message": ev.message})
            else:
                keep.append(ev)
        self._events.extendleft(reversed(keep))
        return out


class SimEventReader:
    """amdsmi.AmdSmiEventReader over the simulator: read(timestamp=timeout in ms, num_elem), stop()."""

    def __init__(self, sim: SimAmdSmi, processor_handle: Any, event_types: list[AmdSmiEvtNotificationType]) -> None:
        self._sim = sim
        self._reader = sim._register(processor_handle, event_types)

    def read(self, timestamp: int, num_elem: int = 10) -> list[dict[str, Any]]:
        return self._sim._read(timestamp, num_elem)

    def stop(self) -> None:
        with self._sim._lock:
            self._reader.stopped = True

    def __enter__(self) -> SimEventReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["MiB", "SimAmdSmi", "SimEventReader"]
