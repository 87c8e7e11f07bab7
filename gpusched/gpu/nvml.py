"""`NvmlBackend`: the GpuBackend over any module object with pynvml's API.

This is the only module that calls NVML. It is handed the module (real `pynvml` or a `SimNVML`),
so the same code runs against the driver and in every test. All NVML errors pass through `_call`,
which maps them to the GpuError classes of backend.py; values the scheduler relies on are never
defaulted: a GPU whose facts cannot be read lands in `Inventory.errors` and is not scheduled.

SM count choice: the whole-GPU SM count comes from our model table (profiles.py: A100 108, H100 PCIe
114, other Hopper models 132) because NVML has no call for it on a full GPU; for a GPU model we have
no table for, we use the 7g profile's multiprocessorCount when MIG is on, and otherwise report the
GPU as unschedulable.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpusched.gpu.backend import (
    Gpu,
    GpuBusyError,
    GpuError,
    GpuInsufficientResourcesError,
    GpuInvalidArgumentError,
    GpuLostError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuProcess,
    Instance,
    Inventory,
    MigModeChange,
    XidEvent,
)
from gpusched.gpu.holders import describe, instance_holders
from gpusched.gpu.profiles import CI_ENUM_BY_SLICES, MODELS, model_from_name, profile_by_id, profile_by_name

MiB = 1024 * 1024
NO_ID = 0xFFFFFFFF
XID_FALLEN_OFF_BUS = 79  # what a lost GPU is reported as (Xid 79: GPU has fallen off the bus)
# After a GI refused to go (its CI was re-created), further destroys of that GI are refused without
# touching the driver for this long: each try would destroy and re-create the CI (a new MIG UUID
# every planning pass) while a holder such as DCGM keeps it.
GI_REFUSED_HOLDOFF_S = 60.0
SIM_HINT = "no NVIDIA driver here; to try gpusched without GPUs run: gpuschedd --sim H100-80GB:2"

# NVML error code -> our error class (codes are pynvml's NVML_ERROR_* values).
_ERROR_CLASSES: dict[int, type[GpuError]] = {
    19: GpuBusyError,  # IN_USE
    15: GpuLostError,  # GPU_IS_LOST
    3: GpuNotSupportedError,  # NOT_SUPPORTED
    23: GpuInsufficientResourcesError,  # INSUFFICIENT_RESOURCES
    2: GpuInvalidArgumentError,  # INVALID_ARGUMENT
    6: GpuNotFoundError,  # NOT_FOUND
    4: GpuPermissionError,  # NO_PERMISSION
}
_HINTS: dict[int, str] = {
    # nvml.h marks MIG writes and the GI/CI enumeration reads "Requires privileged user".
    4: "MIG changes, and reading the MIG layout, need root (or the mig/config capability)",
    15: "the GPU stopped answering; it needs a reset or a reboot",
}


class NvmlBackend:
    """GpuBackend over pynvml or simnvml. Safe to call from the loop while `wait_event` blocks."""

    def __init__(
        self, nvml: Any, *, init: bool = True, proc_root: str = "/proc", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._nvml = nvml
        self._proc_root = proc_root  # where to look for who holds a MIG instance open (tests: a temp dir)
        self._clock = clock
        self._gi_refused: dict[tuple[str, int], tuple[float, str]] = {}  # (GPU UUID, GI id) -> (when, why)
        self._lock = threading.Lock()  # guards the event set and pending-loss bookkeeping
        self._event_set: Any = None
        self._registered: set[int] = set()
        self._lost_reported: set[int] = set()
        self._pending_lost: deque[int] = deque()
        self._closed = False
        self.backend_name = str(getattr(nvml, "backend_name", getattr(nvml, "__name__", "nvml")))
        if init:
            self._call("nvmlInit")

    @property
    def module(self) -> Any:
        """The nvml module this backend drives (a SimNVML in simulation; for its test hooks)."""
        return self._nvml

    # ------------------------------------------------------------------ the one wrapper

    def _call(self, fn: str, *args: Any, what: str = "") -> Any:
        """Call one NVML function, turning its errors into GpuError subclasses."""
        try:
            return getattr(self._nvml, fn)(*args)
        except self._nvml.NVMLError as err:
            raise self._map(err, fn, what) from err

    def _map(self, err: Any, fn: str, what: str) -> GpuError:
        code = int(getattr(err, "value", -1))
        cls = _ERROR_CLASSES.get(code, GpuError)
        label = type(err).__name__.removeprefix("NVMLError_") or "NVMLError"
        where = f" ({what})" if what else ""
        return cls(f"{fn}{where}: {label}", hint=_HINTS.get(code, ""))

    # Read-only door for tools (tools/hardware_check): only getters pass, so a caller holding this
    # backend cannot change MIG mode, instances or compute mode through it.
    _READ_PREFIXES = ("nvmlDeviceGet", "nvmlGpuInstanceGet", "nvmlComputeInstanceGet", "nvmlSystemGet",
                      "nvmlDeviceIsMigDeviceHandle")

    def query(self, fn: str, *args: Any) -> Any:
        """Call one NVML *getter* (names starting nvml...Get); anything else is refused before NVML sees it."""
        if not fn.startswith(self._READ_PREFIXES):
            raise GpuInvalidArgumentError(f"{fn} is not a read-only NVML call")
        return self._call(fn, *args)

    def _handle(self, gpu_index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", gpu_index, what=f"GPU {gpu_index}")

    def _call_opt(self, fn: str, *args: Any, none_on: tuple[type[GpuError], ...] = (GpuNotSupportedError,)) -> Any:
        """`_call`, where the listed (expected, harmless) errors mean "no value" and return None."""
        try:
            return self._call(fn, *args)
        except none_on:
            return None

    # ------------------------------------------------------------------ inventory

    def inventory(self) -> Inventory:
        driver = str(self._call_opt("nvmlSystemGetDriverVersion", none_on=(GpuError,)) or "")
        count = int(self._call("nvmlDeviceGetCount"))
        gpus: list[Gpu] = []
        errors: dict[int, str] = {}
        for index in range(count):
            try:
                gpus.append(self._read_gpu(index))
            except GpuError as err:
                errors[index] = f"{err.code}: {err.message}"
        return Inventory(gpus=tuple(gpus), driver_version=driver, backend=self.backend_name, errors=errors)

    def _read_gpu(self, index: int) -> Gpu:
        h = self._handle(index)
        what = f"GPU {index}"
        uuid = str(self._call("nvmlDeviceGetUUID", h, what=what))
        name = str(self._call("nvmlDeviceGetName", h, what=what))
        mem = self._call("nvmlDeviceGetMemoryInfo", h, what=what)
        total_mib = int(mem.total) // MiB
        mig = self._call_opt("nvmlDeviceGetMigMode", h)
        current, pending = (bool(mig[0]), bool(mig[1])) if mig is not None else (False, False)
        model = model_from_name(name, total_mib)
        if model is not None:
            sm_count = MODELS[model].sm_count
        elif current:
            full = self._call("nvmlDeviceGetGpuInstanceProfileInfo", h, self._nvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
            sm_count = int(full.multiprocessorCount)
        else:
            raise GpuNotSupportedError(f"GPU {index}: unknown model {name!r}; its SM count cannot be read")
        instances = self._read_instances(index, h, model) if current else ()
        return Gpu(
            index=index,
            uuid=uuid,
            name=name,
            model=model or name,
            memory_total_mib=total_mib,
            sm_count=sm_count,
            mig_enabled=current,
            mig_pending=pending,
            instances=instances,
            memory_used_mib=int(mem.used) // MiB,
            numa_node=self._numa_node(h),
            cpu_affinity=self._cpu_affinity(h),
        )

    def _cpu_affinity(self, h: Any) -> tuple[int, ...]:
        words = max(1, ((os.cpu_count() or 64) + 63) // 64)
        words = max(words, 4)  # the simulator's host may have more CPUs than this machine
        mask = self._call_opt("nvmlDeviceGetCpuAffinity", h, words)
        return _bits(mask) if mask is not None else ()

    def _numa_node(self, h: Any) -> int | None:
        node = self._call_opt("nvmlDeviceGetNumaNodeId", h)
        if node is not None:
            return int(node)
        # x86: the GPU is not a NUMA node; its host memory affinity names the node it sits on.
        mask = self._call_opt(
            "nvmlDeviceGetMemoryAffinity", h, 1, self._nvml.NVML_AFFINITY_SCOPE_NODE,
            none_on=(GpuNotSupportedError, GpuInvalidArgumentError),
        )
        nodes = _bits(mask) if mask is not None else ()
        return nodes[0] if len(nodes) == 1 else None

    def _mig_devices(self, h: Any) -> dict[tuple[int, int], str]:
        """(gi id, ci id) -> MIG UUID, enumerating MIG handles by index and skipping gaps."""
        out: dict[tuple[int, int], str] = {}
        for i in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", h))):
            mig = self._call_opt(
                "nvmlDeviceGetMigDeviceHandleByIndex", h, i, none_on=(GpuNotFoundError, GpuInvalidArgumentError)
            )
            if mig is None:
                continue
            gi_id = int(self._call("nvmlDeviceGetGpuInstanceId", mig))
            ci_id = int(self._call("nvmlDeviceGetComputeInstanceId", mig))
            out[(gi_id, ci_id)] = str(self._call("nvmlDeviceGetUUID", mig))
        return out

    def _read_instances(self, index: int, h: Any, model: str | None) -> tuple[Instance, ...]:
        """Every GI on the GPU. gpusched manages one full-size CI per GI; anything else is an error."""
        uuids = self._mig_devices(h)
        nvml = self._nvml
        instances: list[Instance] = []
        for enum in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            info = self._call_opt(
                "nvmlDeviceGetGpuInstanceProfileInfo", h, enum, none_on=(GpuNotSupportedError, GpuInvalidArgumentError)
            )
            if info is None:
                continue
            arr = (nvml.c_nvmlGpuInstance_t * max(1, int(info.instanceCount)))()
            count = ctypes.c_uint(0)
            self._call("nvmlDeviceGetGpuInstances", h, info.id, arr, ctypes.byref(count))
            for k in range(count.value):
                instances.append(self._read_instance(index, arr[k], info, model, uuids))
        return tuple(sorted(instances, key=lambda inst: inst.start))

    def _gi_compute_instances(self, gi: Any) -> list[tuple[Any, Any]]:
        """Every CI of a GI with its CI profile info, over all CI profiles the GI offers.

        Other tools may create CIs of any profile (e.g. 1_SLICE_REV1 on a 1g.20gb GI, which Hopper
        accepts), so we do not assume the one we would have created.
        """
        nvml = self._nvml
        out: list[tuple[Any, Any]] = []
        for enum in range(int(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
            prof = self._call_opt(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, enum,
                nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                none_on=(GpuNotSupportedError, GpuInvalidArgumentError),
            )
            if prof is None:
                continue
            arr = (nvml.c_nvmlComputeInstance_t * max(1, int(prof.instanceCount)))()
            count = ctypes.c_uint(0)
            self._call("nvmlGpuInstanceGetComputeInstances", gi, prof.id, arr, ctypes.byref(count))
            out.extend((arr[k], prof) for k in range(count.value))
        return out

    def _read_instance(
        self, index: int, gi: Any, info: Any, model: str | None, uuids: dict[tuple[int, int], str]
    ) -> Instance:
        """One GI with its single CI, whatever that CI's profile (its SMs are what jobs get)."""
        gi_info = self._call("nvmlGpuInstanceGetInfo", gi)
        gi_id = int(gi_info.id)
        cis = self._gi_compute_instances(gi)
        if len(cis) != 1 or len([key for key in uuids if key[0] == gi_id]) != 1:
            raise GpuInvalidArgumentError(
                f"GPU {index}: GPU instance {gi_id} holds {len(cis)} compute instances; gpusched needs exactly one",
                hint="gpusched manages one compute instance per GI: remove extra ones with `nvidia-smi mig -dci`, "
                "or a GI without any with `nvidia-smi mig -dgi`",
            )
        ci, ci_prof = cis[0]
        ci_id = int(self._call("nvmlComputeInstanceGetInfo", ci).id)
        uuid = uuids.get((gi_id, ci_id))
        if uuid is None:
            raise GpuNotFoundError(f"GPU {index}: no MIG device for GI {gi_id} CI {ci_id}")
        known = profile_by_id(model, int(info.id)) if model is not None else None
        name = known.name if known is not None else _profile_name(info.name)
        return Instance(
            uuid=uuid,
            gpu_index=index,
            profile=name,
            profile_id=int(info.id),
            gi_id=gi_id,
            ci_id=ci_id,
            start=int(gi_info.placement.start),
            size=int(gi_info.placement.size),
            memory_mib=int(info.memorySizeMB),
            sm_count=int(ci_prof.multiprocessorCount),
        )

    def _full_ci_profile(self, gi: Any, slices: int) -> Any:
        """The CI profile that covers the whole GI (its `id` is what CI calls take)."""
        enum = CI_ENUM_BY_SLICES.get(slices)
        if enum is None:
            raise GpuNotSupportedError(f"no compute-instance profile with {slices} slices")
        return self._call(
            "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, enum,
            self._nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
        )

    # ------------------------------------------------------------------ MIG changes

    def _model_of(self, gpu_index: int, h: Any) -> str:
        name = str(self._call("nvmlDeviceGetName", h))
        total = int(self._call("nvmlDeviceGetMemoryInfo", h).total) // MiB
        model = model_from_name(name, total)
        if model is None:
            raise GpuNotSupportedError(f"GPU {gpu_index}: no MIG profile table for {name!r}")
        return model

    def create_instance(self, gpu_index: int, profile: str, start: int) -> Instance:
        """Create GI at an explicit placement, then its full-size CI; never leaves a bare GI behind."""
        h = self._handle(gpu_index)
        model = self._model_of(gpu_index, h)
        try:
            prof = profile_by_name(model, profile)
        except ValueError as err:
            raise GpuInvalidArgumentError(str(err)) from None
        what = f"GPU {gpu_index} {profile}@{start}"
        info = self._call("nvmlDeviceGetGpuInstanceProfileInfo", h, prof.enum, what=what)
        size = self._placement_size(h, int(info.id), start, what)
        placement = self._nvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        gi = self._call("nvmlDeviceCreateGpuInstanceWithPlacement", h, info.id, ctypes.byref(placement), what=what)
        try:
            full = self._full_ci_profile(gi, int(info.sliceCount))
            ci = self._call("nvmlGpuInstanceCreateComputeInstance", gi, full.id, what=what)
        except GpuError:
            self._undo_gi(gi)
            raise
        try:
            gi_id = int(self._call("nvmlGpuInstanceGetInfo", gi).id)
            ci_id = int(self._call("nvmlComputeInstanceGetInfo", ci).id)
            uuid = self._mig_devices(h).get((gi_id, ci_id))
            if uuid is None:
                raise GpuNotFoundError(f"{what}: created GI {gi_id}/CI {ci_id} has no MIG device")
        except GpuError:
            self._call_opt("nvmlComputeInstanceDestroy", ci, none_on=(GpuError,))
            self._undo_gi(gi)
            raise
        return Instance(
            uuid=uuid,
            gpu_index=gpu_index,
            profile=prof.name,
            profile_id=int(info.id),
            gi_id=gi_id,
            ci_id=ci_id,
            start=start,
            size=size,
            memory_mib=int(info.memorySizeMB),
            sm_count=int(full.multiprocessorCount),
        )

    def _undo_gi(self, gi: Any) -> None:
        self._call_opt("nvmlGpuInstanceDestroy", gi, none_on=(GpuError,))

    def _placement_size(self, h: Any, profile_id: int, start: int, what: str) -> int:
        """The driver's own placement list decides whether `start` is valid (and its size)."""
        arr = (self._nvml.c_nvmlGpuInstancePlacement_t * 16)()
        count = ctypes.c_uint(0)
        self._call("nvmlDeviceGetGpuInstancePossiblePlacements", h, profile_id, arr, ctypes.byref(count), what=what)
        valid = {int(arr[i].start): int(arr[i].size) for i in range(count.value)}
        if start not in valid:
            raise GpuInvalidArgumentError(
                f"{what}: start {start} is not a valid placement; valid starts: {sorted(valid)}"
            )
        return valid[start]

    def destroy_instance(self, uuid: str) -> None:
        """Destroy a MIG instance (CI, then GI), all or nothing.

        Busy -> GpuBusyError naming the pids, or, when the driver says "in use" with no compute process
        (a handle holder such as DCGM), naming who holds it. If the GI refuses after its CI is gone,
        the CI is created again so the instance stays whole (under a new MIG UUID, given in the error).
        """
        mig = self._call("nvmlDeviceGetHandleByUUID", uuid, what=uuid)
        if not int(self._call("nvmlDeviceIsMigDeviceHandle", mig).value):
            raise GpuInvalidArgumentError(f"{uuid} is a whole GPU, not a MIG instance")
        procs = self._call("nvmlDeviceGetComputeRunningProcesses", mig, what=uuid)
        if procs:
            pids = ", ".join(str(p.pid) for p in procs)
            raise GpuBusyError(f"MIG instance {uuid} has running processes: {pids}")
        parent = self._call("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", mig)
        gi_id = int(self._call("nvmlDeviceGetGpuInstanceId", mig))
        ci_id = int(self._call("nvmlDeviceGetComputeInstanceId", mig))
        if sum(1 for key in self._mig_devices(parent) if key[0] == gi_id) != 1:
            raise GpuBusyError(f"MIG instance {uuid} shares its GPU instance with other compute instances")
        gi_key = (str(self._call("nvmlDeviceGetUUID", parent)), gi_id)
        refused = self._gi_refused.get(gi_key)
        if refused is not None and self._clock() - refused[0] < GI_REFUSED_HOLDOFF_S:
            raise GpuBusyError(
                f"MIG instance {uuid}: its GPU instance {gi_id} refused to be destroyed "
                f"{self._clock() - refused[0]:.0f} s ago ({refused[1]}); not retried for {GI_REFUSED_HOLDOFF_S:.0f} s",
                hint="stop or restart the holder (e.g. `systemctl restart nvidia-dcgm`) and retry later",
            )
        gi = self._call("nvmlDeviceGetGpuInstanceById", parent, gi_id)
        ci = self._call("nvmlGpuInstanceGetComputeInstanceById", gi, ci_id)
        ci_profile = int(self._call("nvmlComputeInstanceGetInfo", ci).profileId)
        try:
            self._call("nvmlComputeInstanceDestroy", ci, what=uuid)
        except GpuBusyError:
            raise GpuBusyError(
                f"MIG instance {uuid}: the driver refused to destroy its compute instance (in use); "
                f"{self._holders(parent, gi_id, ci_id)}; nothing was destroyed",
                hint="stop or restart the holder (e.g. `systemctl restart nvidia-dcgm`) and retry",
            ) from None
        try:
            self._call("nvmlGpuInstanceDestroy", gi, what=uuid)
        except GpuError as err:
            who = self._holders(parent, gi_id, None) if isinstance(err, GpuBusyError) else err.message
            self._gi_refused[gi_key] = (self._clock(), who)
            raise self._restore_ci(uuid, parent, gi, gi_id, ci_profile, err, who) from err
        self._gi_refused.pop(gi_key, None)

    def _holders(self, parent: Any, gi_id: int, ci_id: int | None) -> str:
        minor = self._call_opt("nvmlDeviceGetMinorNumber", parent, none_on=(GpuError,))
        if minor is None:
            return describe([])
        return describe(instance_holders(int(minor), gi_id, ci_id, proc_root=self._proc_root))

    def _restore_ci(
        self, uuid: str, parent: Any, gi: Any, gi_id: int, ci_profile: int, err: GpuError, who: str
    ) -> GpuError:
        """The GI refused after its CI was destroyed: put a CI back so no half instance is left."""
        try:
            self._call("nvmlGpuInstanceCreateComputeInstance", gi, ci_profile, what=uuid)
            ci_id = int(self._call("nvmlComputeInstanceGetInfo", self._only_ci(gi, ci_profile)).id)
            new_uuid = self._mig_devices(parent).get((gi_id, ci_id), "?")
        except GpuError as again:
            return GpuError(
                f"MIG instance {uuid}: its GPU instance {gi_id} refused to go ({who}) after the compute "
                f"instance was destroyed, and re-creating the compute instance failed: {again.message}",
                hint="the GPU instance is left without a compute instance; remove it with `nvidia-smi mig -dgi`",
            )
        return type(err)(
            f"MIG instance {uuid}: its GPU instance {gi_id} refused to be destroyed ({who}); the compute "
            f"instance was re-created, so the instance is whole again as {new_uuid}",
            hint="stop or restart the holder (e.g. `systemctl restart nvidia-dcgm`) and retry",
        )

    def _only_ci(self, gi: Any, ci_profile: int) -> Any:
        arr = (self._nvml.c_nvmlComputeInstance_t * 8)()
        count = ctypes.c_uint(0)
        self._call("nvmlGpuInstanceGetComputeInstances", gi, ci_profile, arr, ctypes.byref(count))
        if count.value != 1:
            raise GpuNotFoundError(f"expected one compute instance of profile {ci_profile}, found {count.value}")
        return arr[0]

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> MigModeChange:
        """Ask for a MIG mode. The driver answers with an activation status, not an exception."""
        nvml = self._nvml
        h = self._handle(gpu_index)
        mode = nvml.NVML_DEVICE_MIG_ENABLE if enabled else nvml.NVML_DEVICE_MIG_DISABLE
        status = int(self._call("nvmlDeviceSetMigMode", h, mode, what=f"GPU {gpu_index}"))
        current, pending_mode = self._call("nvmlDeviceGetMigMode", h)
        detail = ""
        if status == nvml.NVML_ERROR_IN_USE:
            detail = "GPU is not idle; the change applies once it is idle and retried, or after a reset"
        elif status == nvml.NVML_ERROR_RESET_REQUIRED:
            detail = "a GPU reset (or VM reboot) is required"
        elif status != nvml.NVML_SUCCESS:
            detail = f"activation status {status}"
        pending = status != nvml.NVML_SUCCESS or bool(current) != bool(pending_mode)
        return MigModeChange(gpu_index=gpu_index, current=bool(current), pending=pending, detail=detail)

    # ------------------------------------------------------------------ telemetry

    def processes(self, device_uuid: str) -> list[GpuProcess]:
        """Compute processes on a GPU or MIG device; on a MIG parent each is tagged with its MIG UUID."""
        h = self._call("nvmlDeviceGetHandleByUUID", device_uuid, what=device_uuid)
        procs = self._call("nvmlDeviceGetComputeRunningProcesses", h, what=device_uuid)
        by_ids: dict[tuple[int, int], str] = {}
        if any(int(p.gpuInstanceId) != NO_ID for p in procs) and not int(
            self._call("nvmlDeviceIsMigDeviceHandle", h).value
        ):
            by_ids = self._mig_devices(h)
        out = []
        for p in procs:
            uuid = by_ids.get((int(p.gpuInstanceId), int(p.computeInstanceId)), device_uuid)
            used = None if p.usedGpuMemory is None else int(p.usedGpuMemory)
            out.append(GpuProcess(pid=int(p.pid), device_uuid=uuid, used_memory_bytes=used))
        return out

    def utilization(self, gpu_index: int) -> int | None:
        """GPU utilisation %, or None where NVML cannot say (MIG mode)."""
        h = self._handle(gpu_index)
        rates = self._call_opt("nvmlDeviceGetUtilizationRates", h)
        return None if rates is None else int(rates.gpu)

    # ------------------------------------------------------------------ events

    def _ensure_events(self) -> Any:
        with self._lock:
            if self._event_set is None:
                self._event_set = self._call("nvmlEventSetCreate")
            xid = int(self._nvml.nvmlEventTypeXidCriticalError)
            for index in range(int(self._call("nvmlDeviceGetCount"))):
                if index in self._registered or index in self._lost_reported:
                    continue
                try:
                    h = self._handle(index)
                    supported = int(self._call("nvmlDeviceGetSupportedEventTypes", h))
                    if supported & xid:
                        self._call("nvmlDeviceRegisterEvents", h, xid, self._event_set)
                    self._registered.add(index)
                except GpuLostError:
                    self._note_lost(index)
                except GpuNotSupportedError:
                    self._registered.add(index)  # no XID events on this GPU; do not retry forever
            return self._event_set

    def _note_lost(self, index: int) -> None:
        if index not in self._lost_reported:
            self._lost_reported.add(index)
            self._pending_lost.append(index)

    def wait_event(self, timeout_ms: int) -> XidEvent | None:
        """The next critical XID (or lost GPU, as XID 79 with lost=True); None after the timeout."""
        if self._closed:
            return None
        es = self._ensure_events()
        with self._lock:
            if self._pending_lost:
                return XidEvent(gpu_index=self._pending_lost.popleft(), xid=XID_FALLEN_OFF_BUS, lost=True)
        try:
            data = self._call("nvmlEventSetWait", es, timeout_ms)
        except GpuLostError:
            return self._find_lost()
        except GpuError as err:
            if self._closed:
                return None
            if int(getattr(err.__cause__, "value", -1)) == int(self._nvml.NVML_ERROR_TIMEOUT):
                return None
            raise
        index = int(self._call("nvmlDeviceGetIndex", data.device))
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        return XidEvent(
            gpu_index=index,
            xid=int(data.eventData),
            gi_id=None if gi == NO_ID else gi,
            ci_id=None if ci == NO_ID else ci,
        )

    def _find_lost(self) -> XidEvent | None:
        """The wait said GPU_IS_LOST without saying which GPU: probe them all."""
        count = int(self._call("nvmlDeviceGetCount"))
        with self._lock:
            for index in range(count):
                try:
                    self._call("nvmlDeviceGetUUID", self._handle(index))
                except GpuLostError:
                    self._note_lost(index)
                except GpuError:
                    continue
            if self._pending_lost:
                return XidEvent(gpu_index=self._pending_lost.popleft(), xid=XID_FALLEN_OFF_BUS, lost=True)
        raise GpuLostError("event wait reported a lost GPU, but every GPU still answers")

    def close(self) -> None:
        """Free the event set and shut NVML down (pynvml's init is reference counted)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            es, self._event_set = self._event_set, None
        if es is not None:
            self._call_opt("nvmlEventSetFree", es, none_on=(GpuError,))
        self._call_opt("nvmlShutdown", none_on=(GpuError,))


def _bits(mask: Any) -> tuple[int, ...]:
    """CPU (or node) numbers set in an array of 64-bit words."""
    return tuple(w * 64 + b for w in range(len(mask)) for b in range(64) if int(mask[w]) >> b & 1)


def _profile_name(raw: Any) -> str:
    """`MIG 3g.40gb` (bytes from the v2 struct) -> `3g.40gb`."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.removeprefix("MIG ").strip()


def open_backend(sim_spec: str | None) -> NvmlBackend:
    """The simulator for a `--sim` spec, otherwise the real driver through pynvml."""
    if sim_spec:
        from gpusched.gpu.simnvml import SimNVML

        try:
            return NvmlBackend(SimNVML.from_spec(sim_spec))
        except ValueError as err:
            raise GpuInvalidArgumentError(str(err), hint="e.g. --sim H100-80GB:2 or --sim A100-40GB:2,H200:2") from None
    import pynvml

    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as err:
        raise GpuError(f"cannot load NVML: {type(err).__name__.removeprefix('NVMLError_')}", hint=SIM_HINT) from err
    except pynvml.NVMLError as err:
        raise GpuError(f"nvmlInit failed: {type(err).__name__.removeprefix('NVMLError_')}", hint=SIM_HINT) from err
    backend = NvmlBackend(pynvml, init=False)
    backend.backend_name = "pynvml"
    return backend
