"""Driver facts the backend relies on, read through NvmlBackend.query (getters only), as flat data.

The same reader runs against the real driver and against the simulator, so comparing the two maps
is a fact-by-fact check of the simulator (tools/hardware_check.py). Keys name GPUs by index and
profiles by name, never by driver-assigned GI/CI ids, so two GPUs with the same layout compare equal.
"""

from __future__ import annotations

import ctypes
from typing import Any

from gpusched.gpu.backend import GpuError
from gpusched.gpu.nvml import NvmlBackend
from gpusched.gpu.profiles import MODELS, model_from_name

Fact = int | str | bool | tuple[Any, ...]
MiB = 1024 * 1024
_GI_FIELDS = ("id", "sliceCount", "instanceCount", "multiprocessorCount", "copyEngineCount",
              "decoderCount", "encoderCount", "jpegCount", "ofaCount", "memorySizeMB")
_CI_FIELDS = ("id", "sliceCount", "instanceCount", "multiprocessorCount")


def _err(err: GpuError) -> str:
    """`error:NoPermission`, the NVML error name as a fact (so refusals are compared too)."""
    return "error:" + err.message.rsplit(": ", 1)[-1]


def _try(backend: NvmlBackend, fn: str, *args: Any) -> Any:
    try:
        return backend.query(fn, *args)
    except GpuError as err:
        return _err(err)


def read_facts(backend: NvmlBackend) -> dict[str, Fact]:
    """Every fact of every GPU (see docs/hardware-notes.md for what each one is used for)."""
    nvml = backend.module
    facts: dict[str, Fact] = {}
    for index in range(int(backend.query("nvmlDeviceGetCount"))):
        h = backend.query("nvmlDeviceGetHandleByIndex", index)
        g = f"gpu{index}"
        name = str(backend.query("nvmlDeviceGetName", h))
        total = int(backend.query("nvmlDeviceGetMemoryInfo", h).total) // MiB
        model = model_from_name(name, total)
        facts[f"{g}.name"] = name
        facts[f"{g}.model"] = model or "no table"
        facts[f"{g}.memory_total_mib"] = total
        mig = _try(backend, "nvmlDeviceGetMigMode", h)
        facts[f"{g}.mig_mode"] = mig if isinstance(mig, str) else (int(mig[0]), int(mig[1]))
        facts[f"{g}.max_mig_device_count"] = _try(backend, "nvmlDeviceGetMaxMigDeviceCount", h)
        _profile_facts(backend, nvml, h, g, model, facts)
        if not isinstance(mig, str) and int(mig[0]):
            _instance_facts(backend, nvml, h, g, facts)
    return facts


def _profile_facts(backend: NvmlBackend, nvml: Any, h: Any, g: str, model: str | None,
                   facts: dict[str, Fact]) -> None:
    """Profile info per pynvml enum (MIG on), and possible placements per `-lgip` id (MIG on or off)."""
    ids: dict[int, str] = {p.profile_id: p.name for p in MODELS[model].profiles} if model else {}
    for enum in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        info = _try(backend, "nvmlDeviceGetGpuInstanceProfileInfo", h, enum)
        if isinstance(info, str):
            facts[f"{g}.gi_enum{enum}"] = info
            continue
        label = _profile_name(info.name) or f"enum{enum}"
        ids.setdefault(int(info.id), label)
        for f in _GI_FIELDS:
            facts[f"{g}.profile[{label}].{f}"] = int(getattr(info, f))
    for pid, label in sorted(ids.items()):
        arr = (nvml.c_nvmlGpuInstancePlacement_t * 16)()
        count = ctypes.c_uint(0)
        res = _try(backend, "nvmlDeviceGetGpuInstancePossiblePlacements", h, pid, arr, ctypes.byref(count))
        facts[f"{g}.profile[{label}].placements"] = (
            res if isinstance(res, str) else tuple((int(arr[i].start), int(arr[i].size)) for i in range(count.value))
        )


def _instance_facts(backend: NvmlBackend, nvml: Any, h: Any, g: str, facts: dict[str, Fact]) -> None:
    """CI profiles offered by each existing GI, and MIG handle index round trips."""
    for i in range(int(backend.query("nvmlDeviceGetMaxMigDeviceCount", h))):
        mig = _try(backend, "nvmlDeviceGetMigDeviceHandleByIndex", h, i)
        if isinstance(mig, str):
            continue
        facts[f"{g}.mig_device{i}.index"] = _try(backend, "nvmlDeviceGetIndex", mig)
    for enum in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        info = _try(backend, "nvmlDeviceGetGpuInstanceProfileInfo", h, enum)
        if isinstance(info, str):
            continue
        label = _profile_name(info.name) or f"enum{enum}"
        arr = (nvml.c_nvmlGpuInstance_t * max(1, int(info.instanceCount)))()
        count = ctypes.c_uint(0)
        res = _try(backend, "nvmlDeviceGetGpuInstances", h, info.id, arr, ctypes.byref(count))
        if isinstance(res, str):
            facts[f"{g}.profile[{label}].instances"] = res
            continue
        if count.value == 0:
            continue
        gi = arr[0]  # CI profiles depend on the GI profile only: one GI of each profile is enough
        for ci_enum in range(int(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
            ci = _try(backend, "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, ci_enum,
                      nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            key = f"{g}.profile[{label}].ci_enum{ci_enum}"
            if isinstance(ci, str):
                facts[key] = ci
            else:
                for f in _CI_FIELDS:
                    facts[f"{key}.{f}"] = int(getattr(ci, f))


def _profile_name(raw: Any) -> str:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.removeprefix("MIG ").strip()


def existing_layout(backend: NvmlBackend) -> dict[int, list[tuple[int, int, int]]]:
    """Per GPU index, its GIs as (profile id, start, ci profile enum): to rebuild them in a simulator."""
    nvml = backend.module
    out: dict[int, list[tuple[int, int, int]]] = {}
    for index in range(int(backend.query("nvmlDeviceGetCount"))):
        h = backend.query("nvmlDeviceGetHandleByIndex", index)
        mig = _try(backend, "nvmlDeviceGetMigMode", h)
        if isinstance(mig, str) or not int(mig[0]):
            continue
        for enum in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            info = _try(backend, "nvmlDeviceGetGpuInstanceProfileInfo", h, enum)
            if isinstance(info, str):
                continue
            arr = (nvml.c_nvmlGpuInstance_t * max(1, int(info.instanceCount)))()
            count = ctypes.c_uint(0)
            if isinstance(_try(backend, "nvmlDeviceGetGpuInstances", h, info.id, arr, ctypes.byref(count)), str):
                continue
            for k in range(count.value):
                start = int(backend.query("nvmlGpuInstanceGetInfo", arr[k]).placement.start)
                for ci_enum in range(int(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
                    cis = (nvml.c_nvmlComputeInstance_t * 8)()
                    n = ctypes.c_uint(0)
                    if isinstance(_try(backend, "nvmlGpuInstanceGetComputeInstances", arr[k], ci_enum, cis,
                                       ctypes.byref(n)), str):
                        continue
                    out.setdefault(index, []).extend((int(info.id), start, ci_enum) for _ in range(n.value))
                if not any(e[0] == int(info.id) and e[1] == start for e in out.get(index, [])):
                    out.setdefault(index, []).append((int(info.id), start, -1))  # a GI without CI
    return out
