"""The simulated MIG mode switch, GPU-instance profiles (two ID spaces, placements, remaining
capacity) and GPU instances (create with or without a placement, destroy, enumerate)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpusched.gpu.profiles import (
    MigProfile,
)
from gpusched.gpu.simnvml_state import (
    _DEFAULT_ORDER,
    _MAX_GI_ID,
    SimCore,
    _api,
    _deref,
    _Gi,
    _Gpu,
    _MigDevice,
)


class MigMixin(SimCore):
    """The simulated MIG mode switch, GPU-instance profiles (two ID spaces, placements, remaining."""

    # ------------------------------------------------------------------ MIG mode

    @_api
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        dev = self._device(device)
        if isinstance(dev, _MigDevice):
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        return [dev.mig_current, dev.mig_pending]

    @_api
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        """Returns the activation status like pynvml: SUCCESS, or IN_USE while the GPU is not idle."""
        dev = self._device(device)
        if isinstance(dev, _MigDevice):
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        if mode not in (self._nv.NVML_DEVICE_MIG_DISABLE, self._nv.NVML_DEVICE_MIG_ENABLE):
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        self._need_privilege()
        dev.mig_pending = mode
        if dev.mig_current == mode:
            return int(self._nv.NVML_SUCCESS)
        if any(p.gpu is dev for p in self._processes.values()):
            return int(self._nv.NVML_ERROR_IN_USE)  # stays pending until idle and retried, or reset
        self._reset(dev)
        return int(self._nv.NVML_SUCCESS)

    def _reset(self, gpu: _Gpu) -> None:
        """A GPU reset: pending MIG mode takes effect; MIG config is not persistent across it."""
        for gi in list(gpu.gis.values()):
            for ci in list(gi.cis.values()):
                ci.alive = False
            gi.alive = False
        gpu.gis.clear()
        gpu.mig_current = gpu.mig_pending
        gpu.lost = False

    # ------------------------------------------------------------------ GPU-instance profiles

    def _profile_by_enum(self, gpu: _Gpu, enum: int) -> MigProfile:
        if not 0 <= enum < self._nv.NVML_GPU_INSTANCE_PROFILE_COUNT:
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        for p in gpu.model.profiles:
            if p.enum == enum:
                return p
        self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)

    def _profile_by_id(self, gpu: _Gpu, profile_id: int, missing: int) -> MigProfile:
        for p in gpu.model.profiles:
            if p.profile_id == profile_id:
                return p
        self._fail(missing)

    def _fill_profile_info(self, p: MigProfile, version: int) -> Any:
        nv = self._nv
        info = nv.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else nv.c_nvmlGpuInstanceProfileInfo_t()
        info.id = p.profile_id
        info.isP2pSupported = 0
        info.sliceCount = p.slices
        info.instanceCount = p.max_instances
        info.multiprocessorCount = p.sm_count
        info.copyEngineCount = p.copy_engines
        info.decoderCount = p.decoders
        info.encoderCount = 0
        info.jpegCount = p.jpegs
        info.ofaCount = p.ofas
        info.memorySizeMB = p.memory_mib
        if version == 2:
            info.name = f"MIG {p.name}".encode()
        return info

    @_api
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        if version not in (1, 2):
            self._fail(self._nv.NVML_ERROR_FUNCTION_NOT_FOUND)
        gpu = self._mig_gpu(device)
        return self._fill_profile_info(self._profile_by_enum(gpu, profile), version)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    @_api
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any:
        gpu = self._mig_gpu(device)
        return self._fill_profile_info(self._profile_by_id(gpu, profileId, self._nv.NVML_ERROR_NOT_SUPPORTED), 2)

    nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById

    @staticmethod
    def _used_slices(gpu: _Gpu) -> set[int]:
        return {s for gi in gpu.gis.values() for s in range(gi.start, gi.start + gi.profile.memory_slices)}

    def _free_starts(self, gpu: _Gpu, p: MigProfile, order: Iterable[int]) -> list[int]:
        used = self._used_slices(gpu)
        return [s for s in order if not used & set(range(s, s + p.memory_slices))]

    @_api
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        gpu = self._mig_gpu(device)
        self._need_privilege()
        p = self._profile_by_id(gpu, profileId, self._nv.NVML_ERROR_INVALID_ARGUMENT)
        left = p.max_instances - sum(1 for gi in gpu.gis.values() if gi.profile is p)
        used = self._used_slices(gpu)
        fits = 0
        for start in p.starts:  # greedy over aligned starts is exact for these placement tables
            cells = set(range(start, start + p.memory_slices))
            if not cells & used:
                used |= cells
                fits += 1
        return max(0, min(left, fits))

    @_api
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        """All placements of the profile, MIG on or off; NULL array -> only the count (pynvml _v2)."""
        dev = self._device(device)
        if isinstance(dev, _MigDevice):
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        self._need_privilege()
        p = self._profile_by_id(dev, profileId, self._nv.NVML_ERROR_INVALID_ARGUMENT)
        count = _deref(countRef)
        if count is None:
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        arr = _deref(placementsRef)
        if arr is not None:
            if len(arr) < len(p.starts):
                self._fail(self._nv.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, (start, size) in enumerate(p.placements):
                arr[i].start, arr[i].size = start, size
        count.value = len(p.starts)
        return int(self._nv.NVML_SUCCESS)

    # ------------------------------------------------------------------ GPU instances

    def _create_gi(self, gpu: _Gpu, p: MigProfile, start: int) -> Any:
        gi = _Gi(id=self._pick_id(range(1, _MAX_GI_ID + 1), gpu.gis), profile=p, start=start, gpu=gpu)
        gi.handle = self._new_handle(self._nv.struct_c_nvmlGpuInstance_t, gi)
        gpu.gis[gi.id] = gi
        return gi.handle

    def _pick_id(self, candidates: Iterable[int], taken: dict[int, Any]) -> int:
        """Driver-assigned ids: free ones, picked at random so nobody can come to rely on them."""
        free = [i for i in candidates if i not in taken]
        if not free:
            self._fail(self._nv.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._rng.choice(free)

    def _check_create(self, device: Any, profileId: int) -> tuple[_Gpu, MigProfile]:
        gpu = self._mig_gpu(device)
        self._need_privilege()
        p = self._profile_by_id(gpu, profileId, self._nv.NVML_ERROR_INVALID_ARGUMENT)
        if sum(1 for gi in gpu.gis.values() if gi.profile is p) >= p.max_instances:
            self._fail(self._nv.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return gpu, p

    @_api
    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        gpu, p = self._check_create(device, profileId)
        free = self._free_starts(gpu, p, _DEFAULT_ORDER.get(p.profile_id, p.starts))
        if not free:
            self._fail(self._nv.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._create_gi(gpu, p, free[0])

    @_api
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        gpu, p = self._check_create(device, profileId)
        pl = _deref(placement)
        if not isinstance(pl, self._nv.c_nvmlGpuInstancePlacement_t):
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        if pl.start not in p.starts or pl.size != p.memory_slices:
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        if not self._free_starts(gpu, p, (pl.start,)):
            self._fail(self._nv.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._create_gi(gpu, p, pl.start)

    @_api
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        gi: _Gi = self._resolve(gpuInstance, _Gi)
        self._need_privilege()
        if gi.holder is not None or gi.cis or any(p.ci is not None and p.ci.gi is gi for p in self._processes.values()):
            self._fail(self._nv.NVML_ERROR_IN_USE)
        gi.alive = False
        del gi.gpu.gis[gi.id]
        return int(self._nv.NVML_SUCCESS)

    @_api
    def nvmlDeviceGetGpuInstances(self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
        gpu = self._mig_gpu(device)
        self._need_privilege()
        p = self._profile_by_id(gpu, profileId, self._nv.NVML_ERROR_INVALID_ARGUMENT)
        gis = sorted((gi for gi in gpu.gis.values() if gi.profile is p), key=lambda g: g.start)
        return self._fill_handles([gi.handle for gi in gis], gpuInstancesRef, countRef)

    def _fill_handles(self, handles: list[Any], arrRef: Any, countRef: Any) -> int:
        count = _deref(countRef)
        arr = _deref(arrRef)
        if count is None or arr is None:
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        if len(arr) < len(handles):
            self._fail(self._nv.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, h in enumerate(handles):
            arr[i] = h
        count.value = len(handles)
        return int(self._nv.NVML_SUCCESS)

    @_api
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        gpu = self._mig_gpu(device)
        self._need_privilege()
        gi = gpu.gis.get(gpuInstanceId)
        if gi is None:
            self._fail(self._nv.NVML_ERROR_NOT_FOUND)
        return gi.handle

    @_api
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        gi: _Gi = self._resolve(gpuInstance, _Gi)
        info = self._nv.c_nvmlGpuInstanceInfo_t()
        info.device = gi.gpu.handle
        info.id = gi.id
        info.profileId = gi.profile.profile_id
        info.placement.start, info.placement.size = gi.start, gi.profile.memory_slices
        return info
