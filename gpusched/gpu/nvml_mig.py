"""MIG changes through NVML: create a GPU instance at an explicit placement with its full-size
compute instance, destroy one (refusing, with who holds it, when it is in use), switch MIG mode."""

from __future__ import annotations

import ctypes
from typing import Any

from gpusched.gpu.backend import (
    GpuBusyError,
    GpuError,
    GpuInvalidArgumentError,
    GpuNotFoundError,
    GpuNotSupportedError,
    Instance,
    MigModeChange,
    PartitionModeChange,
)
from gpusched.gpu.holders import describe, instance_holders
from gpusched.gpu.nvml_core import GI_REFUSED_HOLDOFF_S
from gpusched.gpu.nvml_read import ReadMixin
from gpusched.gpu.profiles import profile_by_name


class MigMixin(ReadMixin):
    """Create and destroy instances; set MIG mode."""

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

    def set_partition_mode(self, physical_index: int, compute: str, memory: str) -> PartitionModeChange:
        """NVIDIA GPUs have no compute/memory partition modes (that is AMD Instinct); MIG is the NVIDIA way."""
        raise GpuNotSupportedError(
            f"GPU {physical_index}: compute/memory partition modes ({compute}/{memory}) are an AMD Instinct feature",
            hint="on NVIDIA GPUs use MIG instead",
        )
