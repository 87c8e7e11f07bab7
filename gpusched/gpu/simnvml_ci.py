"""The simulated compute instances (profiles, create, destroy, enumerate) and MIG device handles."""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from typing import Any

from gpusched.gpu.simnvml_mig import MigMixin
from gpusched.gpu.simnvml_state import (
    _CI_SPLITS,
    _MAX_CI_ID,
    _MAX_MIG_DEVICES,
    _SLICES_BY_CI_ENUM,
    _api,
    _Ci,
    _ci_name,
    _Gi,
    _MigDevice,
)


class ComputeMixin(MigMixin):
    """The simulated compute instances (profiles, create, destroy, enumerate) and MIG device handles."""

    # ------------------------------------------------------------------ compute instances

    def _ci_slices(self, gi: _Gi, profile: int) -> int:
        if not 0 <= profile < self._nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        # the full-size CI that Hopper-class GPUs also accept on 1-slice REV2 GIs (1g.20gb, 1g.35gb ...;
        # NVIDIA/go-nvlib commit e85aa94). See GpuModel.hopper.
        if profile == self._nv.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1:
            if gi.profile.enum == self._nv.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 and gi.gpu.model.hopper:
                return 1
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        slices = _SLICES_BY_CI_ENUM.get(profile)
        if slices is None or slices not in _CI_SPLITS.get(gi.profile.slices, ()):
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        return slices

    @_api
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        """`device` is the GPU *instance* handle despite pynvml's parameter name."""
        gi: _Gi = self._resolve(device, _Gi)
        if engProfile != self._nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        if version not in (1, 2):
            self._fail(self._nv.NVML_ERROR_FUNCTION_NOT_FOUND)
        slices = self._ci_slices(gi, profile)
        p = gi.profile
        info = (
            self._nv.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else self._nv.c_nvmlComputeInstanceProfileInfo_t()
        )
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = p.slices // slices
        info.multiprocessorCount = p.sm_count * slices // p.slices
        info.sharedCopyEngineCount = p.copy_engines
        info.sharedDecoderCount = p.decoders
        info.sharedEncoderCount = 0
        info.sharedJpegCount = p.jpegs
        info.sharedOfaCount = p.ofas
        if version == 2:
            info.name = f"MIG {_ci_name(gi, slices)}".encode()
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def _ci_free_starts(self, gi: _Gi, slices: int) -> list[int]:
        used = {s for ci in gi.cis.values() for s in range(ci.start, ci.start + ci.slices)}
        starts = range(0, gi.profile.slices - slices + 1, slices)
        return [s for s in starts if not used & set(range(s, s + slices))]

    @_api
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance: Any, profileId: int) -> int:
        gi: _Gi = self._resolve(gpuInstance, _Gi)
        self._need_privilege()
        return len(self._ci_free_starts(gi, self._ci_slices(gi, profileId)))

    @_api
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        gi: _Gi = self._resolve(gpuInstance, _Gi)
        self._need_privilege()
        slices = self._ci_slices(gi, profileId)
        free = self._ci_free_starts(gi, slices)
        if not free:
            self._fail(self._nv.NVML_ERROR_INSUFFICIENT_RESOURCES)
        taken_idx = {ci.mig_index for ci in self._live_cis(gi.gpu)}
        mig_index = min(i for i in range(_MAX_MIG_DEVICES) if i not in taken_idx)
        ci = _Ci(
            id=self._pick_id(range(_MAX_CI_ID + 1), gi.cis),
            enum=profileId,
            slices=slices,
            start=free[0],
            gi=gi,
            uuid=f"MIG-{uuidlib.UUID(int=self._rng.getrandbits(128), version=4)}",
            mig_index=mig_index,
        )
        ci.handle = self._new_handle(self._nv.struct_c_nvmlComputeInstance_t, ci)
        ci.dev_handle = self._new_handle(self._nv.struct_c_nvmlDevice_t, _MigDevice(ci))
        gi.cis[ci.id] = ci
        return ci.handle

    @_api
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        ci: _Ci = self._resolve(computeInstance, _Ci)
        self._need_privilege()
        if ci.holder is not None or any(p.ci is ci for p in self._processes.values()):
            self._fail(self._nv.NVML_ERROR_IN_USE)
        ci.alive = False
        del ci.gi.cis[ci.id]
        return int(self._nv.NVML_SUCCESS)

    @_api
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        gi: _Gi = self._resolve(gpuInstance, _Gi)
        self._need_privilege()
        self._ci_slices(gi, profileId)
        cis = sorted((ci for ci in gi.cis.values() if ci.enum == profileId), key=lambda c: c.start)
        return self._fill_handles([ci.handle for ci in cis], computeInstancesRef, countRef)

    @_api
    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        gi: _Gi = self._resolve(gpuInstance, _Gi)
        self._need_privilege()
        ci = gi.cis.get(computeInstanceId)
        if ci is None:
            self._fail(self._nv.NVML_ERROR_NOT_FOUND)
        return ci.handle

    @_api
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> Any:
        ci: _Ci = self._resolve(computeInstance, _Ci)
        info = self._nv.c_nvmlComputeInstanceInfo_t()
        info.device = ci.gi.gpu.handle
        info.gpuInstance = ci.gi.handle
        info.id = ci.id
        info.profileId = ci.enum
        info.placement.start, info.placement.size = ci.start, ci.slices
        return info

    nvmlComputeInstanceGetInfo = nvmlComputeInstanceGetInfo_v2

    # ------------------------------------------------------------------ MIG devices

    @_api
    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        """Returns a c_uint object, exactly like pynvml (callers must read `.value`)."""
        return ctypes.c_uint(1 if isinstance(self._device(device), _MigDevice) else 0)

    @_api
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        """nvml.h: "Returns zero if MIG is not supported or enabled"."""
        return _MAX_MIG_DEVICES if self._gpu(device).mig_current else 0

    @_api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu = self._gpu(device)
        if not gpu.mig_current:
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= index < _MAX_MIG_DEVICES:
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        for ci in self._live_cis(gpu):
            if ci.mig_index == index:
                return ci.dev_handle
        self._fail(self._nv.NVML_ERROR_NOT_FOUND)  # gaps are normal after destroys

    def _mig(self, device: Any) -> _MigDevice:
        dev = self._device(device)
        if not isinstance(dev, _MigDevice):
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        return dev

    @_api
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        return self._mig(device).ci.gi.id

    @_api
    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        return self._mig(device).ci.id

    @_api
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        dev = self._device(migDevice)
        if not isinstance(dev, _MigDevice):
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        return dev.ci.gi.gpu.handle
