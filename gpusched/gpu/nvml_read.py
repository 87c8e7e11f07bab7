"""Reading the node through NVML: the inventory (GPUs, MIG instances, NUMA and CPU affinity),
compute processes and utilization. Values the scheduler relies on are never defaulted: a GPU whose
facts cannot be read lands in `Inventory.errors` and is not scheduled (see nvml.py on SM counts)."""

from __future__ import annotations

import ctypes
import os
from typing import Any

from gpusched.gpu.backend import (
    Gpu,
    GpuError,
    GpuInvalidArgumentError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuProcess,
    Instance,
    Inventory,
)
from gpusched.gpu.nvml_core import NO_ID, MiB, NvmlCore, _bits, _profile_name
from gpusched.gpu.profiles import CI_ENUM_BY_SLICES, MODELS, model_from_name, profile_by_id


class ReadMixin(NvmlCore):
    """Inventory and telemetry."""

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

    def _model_of(self, gpu_index: int, h: Any) -> str:
        name = str(self._call("nvmlDeviceGetName", h))
        total = int(self._call("nvmlDeviceGetMemoryInfo", h).total) // MiB
        model = model_from_name(name, total)
        if model is None:
            raise GpuNotSupportedError(f"GPU {gpu_index}: no MIG profile table for {name!r}")
        return model

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
