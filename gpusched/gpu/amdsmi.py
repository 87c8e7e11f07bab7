"""`AmdSmiBackend`: the GpuBackend over any module object with amdsmi's Python API (AMD Instinct).

This module and its parts (amdsmi_core: the one wrapper and the status mapping; amdsmi_events: health
events) are the only code that calls amdsmi, and `open_amd_backend` the only place that imports it.
It is handed the module (real `amdsmi` or a `SimAmdSmi`), so the same code runs against the driver and
in every test.

Each logical GPU is one `Gpu`, in amdsmi's enumeration order, with `partition` saying which physical
GPU it belongs to. The physical GPU is the domain:bus:device part of the BDF (amdsmi's socket), the
partition id comes from amdsmi_get_gpu_kfd_info. amdsmi gives every partition of a physical GPU the
same UUID, so a logical GPU's `uuid` is that UUID when the GPU is whole (one partition) and
`<uuid>-<compute><memory>-<partition id>` (lower case) otherwise: stable while the mode stays, new
when it changes. See docs/gpu.md, "AMD Instinct (amdsmi)".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpusched.gpu.amd_profiles import model_of_market_name
from gpusched.gpu.amdsmi_core import AMD_SIM_HINT, AmdSmiCore
from gpusched.gpu.amdsmi_events import EventsMixin
from gpusched.gpu.backend import (
    Gpu,
    GpuBusyError,
    GpuError,
    GpuInvalidArgumentError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuProcess,
    Instance,
    Inventory,
    MigModeChange,
    Partition,
    PartitionModeChange,
)
from gpusched.gpu.numa import sysfs_node_cpus

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class _Device:
    """One enumerated logical GPU before it becomes a `Gpu`."""

    index: int
    handle: Any
    bdf_key: str  # domain:bus:device, the physical GPU ("" when it could not be read)
    partition_id: int
    error: str = ""  # why this device could not be read (it goes to Inventory.errors)


def _value(handle: Any) -> Any:
    """A handle's address (ctypes.c_void_p compares by identity, not by what it points to)."""
    return getattr(handle, "value", handle)


def logical_uuid(physical_uuid: str, compute: str, memory: str, partition_id: int, count: int) -> str:
    """The id gpusched gives a logical GPU (amdsmi's UUID names only the physical GPU)."""
    if count == 1:
        return physical_uuid
    return f"{physical_uuid}-{compute.lower()}{memory.lower()}-{partition_id}"


class AmdSmiBackend(EventsMixin, AmdSmiCore):
    """GpuBackend over amdsmi or simamdsmi. Safe to call from the loop while `wait_event` blocks."""

    def __init__(self, module: Any, *, init: bool = True,
                 node_cpus: Callable[[int], tuple[int, ...]] = sysfs_node_cpus) -> None:
        """`node_cpus`: the CPUs of a NUMA node (sysfs on a real host; the simulated host's topology
        under `--sim`), which become each GPU's CPU affinity."""
        super().__init__(module, init=init)
        self._node_cpus = node_cpus
        self._handles = []
        self._enumeration = 0
        self._uuid_handles: dict[str, Any] = {}
        self._init_events()

    # ------------------------------------------------------------------ enumeration

    def _scan(self) -> list[_Device]:
        """The devices amdsmi enumerated, grouped by physical GPU (BDF without function)."""
        handles = list(self._call("amdsmi_get_processor_handles"))
        devices: list[_Device] = []
        seen: dict[str, int] = {}
        for index, h in enumerate(handles):
            try:
                bdf = str(self._call("amdsmi_get_gpu_device_bdf", h, what=f"GPU {index}"))
                kfd = self._call("amdsmi_get_gpu_kfd_info", h, what=f"GPU {index}")
            except GpuError as err:
                devices.append(_Device(index, h, "", 0, error=err.message))
                continue
            key = bdf.rsplit(".", 1)[0].upper()
            pid = kfd.get("current_partition_id")
            partition_id = int(pid) if isinstance(pid, int) else seen.get(key, 0)
            seen[key] = seen.get(key, 0) + 1
            devices.append(_Device(index, h, key, partition_id))
        with self._lock:
            if [_value(d.handle) for d in devices] != [_value(h) for h in self._handles]:
                self._handles = [d.handle for d in devices]
                self._enumeration += 1
        return devices

    def _physical_keys(self, devices: list[_Device]) -> list[str]:
        return list(dict.fromkeys(d.bdf_key for d in devices if not d.error))

    # ------------------------------------------------------------------ inventory

    def inventory(self) -> Inventory:
        """Every logical GPU; one whose facts cannot be read lands in `errors` and is left out."""
        devices = self._scan()
        keys = self._physical_keys(devices)
        counts = {k: sum(1 for d in devices if d.bdf_key == k) for k in keys}
        gpus: list[Gpu] = []
        errors: dict[int, str] = {}
        uuids: dict[str, Any] = {}
        driver = ""
        for dev in devices:
            if dev.error:
                errors[dev.index] = dev.error
                continue
            try:
                gpu = self._read_gpu(dev, keys.index(dev.bdf_key), counts[dev.bdf_key])
                if not driver:
                    driver = str(self._call("amdsmi_get_gpu_driver_info", dev.handle)["driver_version"])
            except GpuError as err:
                errors[dev.index] = err.message
                continue
            gpus.append(gpu)
            uuids[gpu.uuid] = dev.handle
        with self._lock:
            self._uuid_handles = uuids
        return Inventory(gpus=tuple(gpus), driver_version=driver, backend=self.backend_name, errors=errors)

    def _read_gpu(self, dev: _Device, physical_index: int, count: int) -> Gpu:
        h, what = dev.handle, f"GPU {dev.index}"
        asic = self._call("amdsmi_get_gpu_asic_info", h, what=what)
        name = str(asic.get("market_name", ""))
        model = model_of_market_name(name)
        physical_uuid = str(self._call("amdsmi_get_gpu_device_uuid", h, what=what))
        try:
            compute = str(self._call("amdsmi_get_gpu_compute_partition", h, what=what))
            memory = str(self._call("amdsmi_get_gpu_memory_partition", h, what=what))
        except GpuNotSupportedError:
            compute, memory = "", ""  # a GPU without partitions: one logical GPU, no Partition
        cus = asic.get("num_compute_units")
        if not isinstance(cus, int):
            if model is None or not compute:
                raise GpuNotSupportedError(f"{what}: compute unit count unknown for {name!r}")
            cus = model.cus_per_partition(compute)
        vram = self._smi.AmdSmiMemoryType.VRAM
        total = int(self._call("amdsmi_get_gpu_memory_total", h, vram, what=what))
        used = int(self._call("amdsmi_get_gpu_memory_usage", h, vram, what=what))
        numa = self._call_opt("amdsmi_topo_get_numa_node_number", h)
        partition = None
        if compute:
            partition = Partition(physical_index=physical_index, physical_uuid=physical_uuid, compute_mode=compute,
                                  memory_mode=memory, index_in_physical=dev.partition_id, count=count)
        return Gpu(
            index=dev.index,
            uuid=logical_uuid(physical_uuid, compute, memory, dev.partition_id, count),
            name=name,
            model=model.key if model is not None else name,
            memory_total_mib=total // MiB,
            sm_count=int(cus),
            mig_enabled=False,
            mig_pending=False,
            memory_used_mib=used // MiB,
            numa_node=int(numa) if isinstance(numa, int) else None,
            cpu_affinity=self._node_cpus(int(numa)) if isinstance(numa, int) else (),
            partition=partition,
            vendor="amd",
        )

    def _call_opt(self, fn: str, *args: Any) -> Any:
        try:
            return self._call(fn, *args)
        except GpuNotSupportedError:
            return None

    def _handle_of(self, device_uuid: str) -> Any:
        with self._lock:
            h = self._uuid_handles.get(device_uuid)
        if h is None:
            self.inventory()
            with self._lock:
                h = self._uuid_handles.get(device_uuid)
        if h is None:
            raise GpuNotFoundError(f"no AMD GPU with id {device_uuid}")
        return h

    # ------------------------------------------------------------------ telemetry

    def processes(self, device_uuid: str) -> list[GpuProcess]:
        """Processes amdsmi lists on one logical GPU; used_memory_bytes is their VRAM."""
        rows = self._call("amdsmi_get_gpu_process_list", self._handle_of(device_uuid), what=device_uuid)
        out = []
        for row in rows:
            vram = row.get("memory_usage", {}).get("vram_mem", row.get("mem"))
            out.append(GpuProcess(pid=int(row["pid"]), device_uuid=device_uuid,
                                  used_memory_bytes=int(vram) if isinstance(vram, int) else None))
        return out

    def utilization(self, gpu_index: int) -> int | None:
        """gfx_activity in percent, None where amdsmi reports N/A."""
        devices = self._scan()
        if not 0 <= gpu_index < len(devices):
            raise GpuNotFoundError(f"no AMD GPU {gpu_index}")
        value = self._call_opt("amdsmi_get_gpu_activity", devices[gpu_index].handle)
        gfx = value.get("gfx_activity") if isinstance(value, dict) else None
        return gfx if isinstance(gfx, int) else None

    # ------------------------------------------------------------------ partitions

    def set_partition_mode(self, physical_index: int, compute: str, memory: str) -> PartitionModeChange:
        """Put one physical GPU in a compute/memory mode. Refused while any of its logical GPUs has a
        process (and, for a memory change, which reloads amdgpu, while any GPU on the node has one)."""
        compute, memory = compute.upper(), memory.upper()
        devices = self._scan()
        keys = self._physical_keys(devices)
        if not 0 <= physical_index < len(keys):
            raise GpuNotFoundError(f"no physical AMD GPU {physical_index}")
        mine = [d for d in devices if d.bdf_key == keys[physical_index]]
        devices = [d for d in devices if not d.error]
        name = str(self._call("amdsmi_get_gpu_asic_info", mine[0].handle)["market_name"])
        model = model_of_market_name(name)
        if model is None:
            raise GpuNotSupportedError(f"physical GPU {physical_index} ({name}): no partition table for this model")
        if not model.is_valid(compute, memory):
            valid = ", ".join(f"{c}/{m}" for c, m in model.valid_combinations())
            raise GpuInvalidArgumentError(f"{model.key} does not run {compute}/{memory}", hint=f"valid: {valid}")
        current = (str(self._call("amdsmi_get_gpu_compute_partition", mine[0].handle)),
                   str(self._call("amdsmi_get_gpu_memory_partition", mine[0].handle)))
        if current == (compute, memory):
            return PartitionModeChange(physical_index, compute, memory, detail="already in that mode")
        busy = [d for d in (devices if memory != current[1] else mine)
                if self._call("amdsmi_get_gpu_process_list", d.handle)]
        if busy:
            scope = "the node (a memory mode change reloads amdgpu)" if memory != current[1] else "it"
            raise GpuBusyError(f"physical GPU {physical_index}: processes run on logical GPU(s) "
                               f"{', '.join(str(d.index) for d in busy)} of {scope}")
        steps = [("compute", compute), ("memory", memory)]
        if not model.is_valid(compute, current[1]):
            steps.reverse()  # e.g. CPX/NPS4 -> SPX/NPS1: SPX is refused while the memory mode is NPS4
        for kind, mode in steps:
            handle = self._physical_handle(keys[physical_index])
            now = str(self._call(f"amdsmi_get_gpu_{kind}_partition", handle))
            if now == mode:
                continue
            enum_name = "AmdSmiComputePartitionType" if kind == "compute" else "AmdSmiMemoryPartitionType"
            enum = getattr(self._smi, enum_name)
            self._call(f"amdsmi_set_gpu_{kind}_partition", handle, enum[mode], what=f"physical GPU {physical_index}")
            self._reinit()  # the driver re-created the devices; old handles are gone
        count = sum(1 for d in self._scan() if d.bdf_key == keys[physical_index])
        return PartitionModeChange(physical_index, compute, memory, detail=f"{count} logical GPU(s)")

    def _physical_handle(self, key: str) -> Any:
        for d in self._scan():
            if d.bdf_key == key:
                return d.handle
        raise GpuNotFoundError(f"physical AMD GPU {key} disappeared")

    # ------------------------------------------------------------------ MIG: not on AMD

    def create_instance(self, gpu_index: int, profile: str, start: int) -> Instance:
        raise GpuNotSupportedError("AMD GPUs have no MIG instances", hint="use set_partition_mode")

    def destroy_instance(self, uuid: str) -> None:
        raise GpuNotSupportedError("AMD GPUs have no MIG instances", hint="use set_partition_mode")

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> MigModeChange:
        raise GpuNotSupportedError("AMD GPUs have no MIG mode", hint="use set_partition_mode")


def open_amd_backend(sim_spec: str | None) -> AmdSmiBackend:
    """The simulator for a spec such as `MI300X:2`, otherwise the real library through `amdsmi`."""
    if sim_spec:
        from gpusched.gpu.simamdsmi import SimAmdSmi

        try:
            sim = SimAmdSmi.from_spec(sim_spec)
            return AmdSmiBackend(sim, node_cpus=sim.node_cpus)
        except ValueError as err:
            raise GpuInvalidArgumentError(str(err), hint="e.g. --sim MI300X:2 or --sim MI300X:1,MI325X:1") from None
    try:
        import amdsmi  # type: ignore[import-not-found]  # the only import of the real library
    except (ImportError, OSError) as err:  # OSError: the package is there but libamd_smi.so is not
        raise GpuError(f"cannot load amdsmi: {err}", hint=AMD_SIM_HINT) from err
    try:
        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except amdsmi.AmdSmiException as err:
        raise GpuError(f"amdsmi_init failed: {err}".replace("\n", " "), hint=AMD_SIM_HINT) from err
    backend = AmdSmiBackend(amdsmi, init=False)
    backend.backend_name = "amdsmi"
    return backend
