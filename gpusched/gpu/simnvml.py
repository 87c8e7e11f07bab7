"""A stateful, in-process stand-in for the `pynvml` module (a fake, not a mock).

`SimNVML` exposes pynvml's function names, signatures, ctypes structs, constants and exception
classes, and keeps real state (GPUs, MIG GPU/compute instances, processes, event sets), enforcing the
driver's rules (nvml.h doc comments, pynvml, published nvidia-smi transcripts; see docs/gpu.md and
docs/hardware-notes.md). `gpu/nvml.py` therefore runs the very same code path
against this object as against the real driver. Handles are genuine ctypes pointers (the types pynvml
returns), so callers cannot tell them apart; destroyed objects leave stale handles that raise.

What it does not model is listed in docs/gpu.md (engine counts beyond the info structs, GPM,
vGPU, ECC counters, clocks/power, driver persistence).
"""

from __future__ import annotations

import ctypes
import functools
import random
import threading
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Concatenate, NoReturn, ParamSpec, TypeVar

import pynvml

from gpusched.gpu.profiles import (
    CI_ENUM_BY_SLICES,
    COMPUTE_SLICES,
    MEMORY_SLICES,
    MODEL_KEYS,
    MODELS,
    GpuModel,
    MigProfile,
)

MiB = 1024 * 1024
NO_ID = 0xFFFFFFFF  # gi/ci id of processes and events that are not scoped to a MIG instance
DEFAULT_DRIVER_VERSION = "550.90.07"  # first R550 release that supports MIG on H200
_SUCCESS = int(pynvml.NVML_SUCCESS)
_SUPPORTED_EVENTS = int(
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
)
# Default placement heuristic of the driver when no placement is given (reference §1.3, observed on
# A100/H100): 1g fills 6,4,5 then ascends; the first 2g/3g goes to start 4. The later 2g order and the
# 1g.20gb order are not published: we continue "4 first, then ascending".
_DEFAULT_ORDER: dict[int, tuple[int, ...]] = {
    19: (6, 4, 5, 0, 1, 2, 3),
    20: (6, 4, 5, 0, 1, 2, 3),
    15: (6, 4, 0, 2),
    14: (4, 0, 2),
    9: (4, 0),
    5: (0,),
    0: (0,),
}
# Compute-instance splits per GI size (go-nvml's A100 mock): CI slices allowed inside a GI of N slices.
_CI_SPLITS: dict[int, tuple[int, ...]] = {1: (1,), 2: (1, 2), 3: (1, 2, 3), 4: (1, 2, 4), 7: (1, 2, 3, 4, 7)}
_SLICES_BY_CI_ENUM = {v: k for k, v in CI_ENUM_BY_SLICES.items()}
# NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1 (pynvml): the full-size CI that Hopper-class GPUs also accept
# on 1-slice REV2 GIs (1g.20gb, 1g.35gb ...; NVIDIA/go-nvlib commit e85aa94). See GpuModel.hopper.
_CI_1_SLICE_REV1 = int(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1)
_GI_1_SLICE_REV2 = int(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2)
_MAX_GI_ID = 14
_MAX_CI_ID = 7
_MAX_MIG_DEVICES = COMPUTE_SLICES

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def _fail(code: int) -> NoReturn:
    """Raise exactly what pynvml raises for `code` (the per-code NVMLError subclass)."""
    raise pynvml.NVMLError(code)


def _api(fn: Callable[Concatenate[SimNVML, P], R]) -> Callable[Concatenate[SimNVML, P], R]:
    """Serialise a call on the simulator's lock and refuse it before nvmlInit, like the library."""

    def wrapper(self: SimNVML, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            if self._init_count == 0:
                _fail(pynvml.NVML_ERROR_UNINITIALIZED)
            fault = self._faults.get(fn.__name__)
            if fault:
                code = fault.popleft()
                if not fault:
                    del self._faults[fn.__name__]
                _fail(code)
            return fn(self, *args, **kwargs)

    functools.update_wrapper(wrapper, fn)
    return wrapper


def _deref(ref: Any) -> Any:
    """Accept what C would: a ctypes object, `byref(obj)` or `pointer(obj)`; return the object."""
    if ref is None:
        return None
    obj = getattr(ref, "_obj", None)  # CArgObject from byref()
    if obj is not None:
        return obj
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    return ref


def _handle_addr(handle: Any) -> int | None:
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return None


@dataclass(eq=False)
class _Process:
    pid: int
    used: int | None
    gpu: _Gpu
    ci: _Ci | None


@dataclass(eq=False)
class _Ci:
    id: int
    enum: int
    slices: int
    start: int
    gi: _Gi
    uuid: str
    mig_index: int
    handle: Any = None
    dev_handle: Any = None
    alive: bool = True
    holder: str | None = None  # a non-compute client (e.g. DCGM) holding a handle: destroy is IN_USE


@dataclass(eq=False)
class _MigDevice:
    ci: _Ci

    @property
    def alive(self) -> bool:
        return self.ci.alive


@dataclass(eq=False)
class _Gi:
    id: int
    profile: MigProfile
    start: int
    gpu: _Gpu
    cis: dict[int, _Ci] = field(default_factory=dict)
    handle: Any = None
    alive: bool = True
    holder: str | None = None


@dataclass(eq=False)
class _Gpu:
    index: int
    model: GpuModel
    uuid: str
    numa_node: int
    cpus: tuple[int, ...]
    mig_current: int = 0
    mig_pending: int = 0
    gis: dict[int, _Gi] = field(default_factory=dict)
    lost: bool = False
    util_gpu: int = 0
    util_memory: int = 0
    handle: Any = None
    alive: bool = True


@dataclass(eq=False)
class _EventSet:
    handle: Any = None
    masks: dict[int, int] = field(default_factory=dict)  # gpu index -> registered event mask
    queue: deque[tuple[_Gpu, int, int, int, int]] = field(default_factory=deque)
    lost: deque[_Gpu] = field(default_factory=deque)
    alive: bool = True


class SimNVML:
    """Simulated NVML with pynvml's API. Build with `SimNVML.from_spec("H100-80GB:2")`.

    Test hooks (not part of pynvml): add_process, remove_process, inject_xid, lose_gpu, reset_gpu,
    fail_next, set_utilization, hold_instance, release_instance. Every call holds one lock, so a
    thread blocked in nvmlEventSetWait never stops the rest of the API.
    """

    backend_name = "simnvml"

    def __init__(
        self,
        models: Iterable[str],
        *,
        seed: int | None = None,
        driver_version: str = DEFAULT_DRIVER_VERSION,
        privileged: bool = True,
        host_cpus: int = 64,
        numa_nodes: int = 2,
    ) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._rng = random.Random(seed)
        self._init_count = 0
        self._driver_version = driver_version
        self._privileged = privileged
        self._objs: dict[int, Any] = {}  # handle address -> simulated object
        self._keep: list[Any] = []  # structs behind handles stay allocated so addresses are never reused
        self._processes: dict[int, _Process] = {}
        self._event_sets: list[_EventSet] = []
        self._faults: dict[str, deque[int]] = {}  # function name -> error codes to raise next
        keys = list(models)
        per_node = max(1, host_cpus // max(1, numa_nodes))
        self._gpus: list[_Gpu] = []
        for index, key in enumerate(keys):
            model = MODELS[key]
            node = index * numa_nodes // max(1, len(keys))
            gpu = _Gpu(
                index=index,
                model=model,
                uuid=_gpu_uuid(model, index),
                numa_node=node,
                cpus=tuple(range(node * per_node, (node + 1) * per_node)),
            )
            gpu.handle = self._new_handle(pynvml.struct_c_nvmlDevice_t, gpu)
            self._gpus.append(gpu)

    @classmethod
    def from_spec(cls, spec: str, **kwargs: Any) -> SimNVML:
        """Parse `MODEL[:COUNT][,MODEL[:COUNT]...]` (the `gpuschedd --sim` syntax)."""
        models: list[str] = []
        for part in (p.strip() for p in spec.split(",")):
            name, _, count_s = part.partition(":")
            if name not in MODELS:
                raise ValueError(
                    f"bad simulated GPU spec part {part!r}: unknown model {name!r}; "
                    f"valid models: {', '.join(MODEL_KEYS)}"
                )
            try:
                count = int(count_s) if count_s else 1
            except ValueError:
                raise ValueError(f"bad simulated GPU spec part {part!r}: count must be an integer") from None
            if count < 1 or count > 64:
                raise ValueError(f"bad simulated GPU spec part {part!r}: count must be 1..64")
            models.extend([name] * count)
        if not models:
            raise ValueError(f"empty simulated GPU spec; valid models: {', '.join(MODEL_KEYS)}")
        return cls(models, **kwargs)

    # ------------------------------------------------------------------ pynvml passthrough

    def __getattr__(self, name: str) -> Any:
        """Constants, struct classes and exception classes come straight from pynvml.

        NVML *functions* we do not simulate raise AttributeError instead of silently reaching
        for a real driver.
        """
        value = getattr(pynvml, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):
            raise AttributeError(f"simnvml does not simulate {name}")
        return value

    # ------------------------------------------------------------------ handles

    def _new_handle(self, struct_type: Any, obj: Any) -> Any:
        struct = struct_type()
        self._keep.append(struct)
        self._objs[ctypes.addressof(struct)] = obj
        return ctypes.pointer(struct)

    def _resolve(self, handle: Any, *kinds: type[Any]) -> Any:
        addr = _handle_addr(handle)
        obj = self._objs.get(addr) if addr is not None else None
        if obj is None or not isinstance(obj, kinds):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._gpu_of(obj).lost:
            _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        if not obj.alive:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # stale handle: the instance was destroyed
        return obj

    @staticmethod
    def _gpu_of(obj: Any) -> _Gpu:
        if isinstance(obj, _Gpu):
            return obj
        if isinstance(obj, _Gi):
            return obj.gpu
        if isinstance(obj, _Ci):
            return obj.gi.gpu
        if isinstance(obj, _MigDevice):
            return obj.ci.gi.gpu
        raise TypeError(obj)

    def _gpu(self, handle: Any) -> _Gpu:
        gpu: _Gpu = self._resolve(handle, _Gpu)
        return gpu

    def _device(self, handle: Any) -> _Gpu | _MigDevice:
        dev: _Gpu | _MigDevice = self._resolve(handle, _Gpu, _MigDevice)
        return dev

    def _mig_gpu(self, handle: Any) -> _Gpu:
        """A parent GPU handle with MIG enabled (profile/instance calls are NOT_SUPPORTED otherwise)."""
        dev = self._device(handle)
        if isinstance(dev, _MigDevice) or not dev.mig_current:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev

    def _need_privilege(self) -> None:
        """Writes, and the reads nvml.h marks "Requires privileged user": GetGpuInstancePossiblePlacements_v2,
        GetGpuInstanceRemainingCapacity, GetGpuInstances, GetGpuInstanceById, GetComputeInstances,
        GetComputeInstanceById, GetComputeInstanceRemainingCapacity (nvml.h as vendored in NVIDIA/go-nvml)."""
        if not self._privileged:
            _fail(pynvml.NVML_ERROR_NO_PERMISSION)

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
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpus[index]
        if gpu.lost:
            _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu.handle

    @_api
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self._gpus:
            if gpu.uuid == text:
                if gpu.lost:
                    _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
                return gpu.handle
            for ci in self._live_cis(gpu):
                if ci.uuid == text:
                    if gpu.lost:
                        _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
                    return ci.dev_handle
        _fail(pynvml.NVML_ERROR_NOT_FOUND)

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
            mem = pynvml.c_nvmlMemory_v2_t()
            mem.version = version
            mem.reserved = 0
        else:
            mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = total, used, total - used
        return mem

    @_api
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        dev = self._device(handle)
        if isinstance(dev, _MigDevice) or dev.mig_current:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # "not currently supported" on MIG-enabled GPUs
        util = pynvml.c_nvmlUtilization_t()
        util.gpu, util.memory = dev.util_gpu, dev.util_memory
        return util

    @_api
    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpuSetSize: int) -> Any:
        return self._mask(self._gpu_of(self._device(handle)).cpus, cpuSetSize)

    @_api
    def nvmlDeviceGetCpuAffinityWithinScope(self, handle: Any, cpuSetSize: int, scope: int) -> Any:
        if scope not in (pynvml.NVML_AFFINITY_SCOPE_NODE, pynvml.NVML_AFFINITY_SCOPE_SOCKET):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._mask(self._gpu_of(self._device(handle)).cpus, cpuSetSize)

    @_api
    def nvmlDeviceGetMemoryAffinity(self, handle: Any, nodeSetSize: int, scope: int) -> Any:
        if scope not in (pynvml.NVML_AFFINITY_SCOPE_NODE, pynvml.NVML_AFFINITY_SCOPE_SOCKET):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
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
        _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # only where GPUs are NUMA nodes (Grace); x86 says no

    # ------------------------------------------------------------------ MIG mode

    @_api
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        dev = self._device(device)
        if isinstance(dev, _MigDevice):
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [dev.mig_current, dev.mig_pending]

    @_api
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        """Returns the activation status like pynvml: SUCCESS, or IN_USE while the GPU is not idle."""
        dev = self._device(device)
        if isinstance(dev, _MigDevice):
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._need_privilege()
        dev.mig_pending = mode
        if dev.mig_current == mode:
            return _SUCCESS
        if any(p.gpu is dev for p in self._processes.values()):
            return int(pynvml.NVML_ERROR_IN_USE)  # stays pending until idle and retried, or reset
        self._reset(dev)
        return _SUCCESS

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
        if not 0 <= enum < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for p in gpu.model.profiles:
            if p.enum == enum:
                return p
        _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _profile_by_id(self, gpu: _Gpu, profile_id: int, missing: int) -> MigProfile:
        for p in gpu.model.profiles:
            if p.profile_id == profile_id:
                return p
        _fail(missing)

    @staticmethod
    def _fill_profile_info(p: MigProfile, version: int) -> Any:
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else pynvml.c_nvmlGpuInstanceProfileInfo_t()
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
            _fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        gpu = self._mig_gpu(device)
        return self._fill_profile_info(self._profile_by_enum(gpu, profile), version)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    @_api
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any:
        gpu = self._mig_gpu(device)
        return self._fill_profile_info(self._profile_by_id(gpu, profileId, pynvml.NVML_ERROR_NOT_SUPPORTED), 2)

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
        p = self._profile_by_id(gpu, profileId, pynvml.NVML_ERROR_INVALID_ARGUMENT)
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
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._need_privilege()
        p = self._profile_by_id(dev, profileId, pynvml.NVML_ERROR_INVALID_ARGUMENT)
        count = _deref(countRef)
        if count is None:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        arr = _deref(placementsRef)
        if arr is not None:
            if len(arr) < len(p.starts):
                _fail(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, (start, size) in enumerate(p.placements):
                arr[i].start, arr[i].size = start, size
        count.value = len(p.starts)
        return _SUCCESS

    # ------------------------------------------------------------------ GPU instances

    def _create_gi(self, gpu: _Gpu, p: MigProfile, start: int) -> Any:
        gi = _Gi(id=self._pick_id(range(1, _MAX_GI_ID + 1), gpu.gis), profile=p, start=start, gpu=gpu)
        gi.handle = self._new_handle(pynvml.struct_c_nvmlGpuInstance_t, gi)
        gpu.gis[gi.id] = gi
        return gi.handle

    def _pick_id(self, candidates: Iterable[int], taken: dict[int, Any]) -> int:
        """Driver-assigned ids: free ones, picked at random so nobody can come to rely on them."""
        free = [i for i in candidates if i not in taken]
        if not free:
            _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._rng.choice(free)

    def _check_create(self, device: Any, profileId: int) -> tuple[_Gpu, MigProfile]:
        gpu = self._mig_gpu(device)
        self._need_privilege()
        p = self._profile_by_id(gpu, profileId, pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if sum(1 for gi in gpu.gis.values() if gi.profile is p) >= p.max_instances:
            _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return gpu, p

    @_api
    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        gpu, p = self._check_create(device, profileId)
        free = self._free_starts(gpu, p, _DEFAULT_ORDER.get(p.profile_id, p.starts))
        if not free:
            _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._create_gi(gpu, p, free[0])

    @_api
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        gpu, p = self._check_create(device, profileId)
        pl = _deref(placement)
        if not isinstance(pl, pynvml.c_nvmlGpuInstancePlacement_t):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if pl.start not in p.starts or pl.size != p.memory_slices:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not self._free_starts(gpu, p, (pl.start,)):
            _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._create_gi(gpu, p, pl.start)

    @_api
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        gi: _Gi = self._resolve(gpuInstance, _Gi)
        self._need_privilege()
        if gi.holder is not None or gi.cis or any(p.ci is not None and p.ci.gi is gi for p in self._processes.values()):
            _fail(pynvml.NVML_ERROR_IN_USE)
        gi.alive = False
        del gi.gpu.gis[gi.id]
        return _SUCCESS

    @_api
    def nvmlDeviceGetGpuInstances(self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
        gpu = self._mig_gpu(device)
        self._need_privilege()
        p = self._profile_by_id(gpu, profileId, pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gis = sorted((gi for gi in gpu.gis.values() if gi.profile is p), key=lambda g: g.start)
        return self._fill_handles([gi.handle for gi in gis], gpuInstancesRef, countRef)

    @staticmethod
    def _fill_handles(handles: list[Any], arrRef: Any, countRef: Any) -> int:
        count = _deref(countRef)
        arr = _deref(arrRef)
        if count is None or arr is None:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if len(arr) < len(handles):
            _fail(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, h in enumerate(handles):
            arr[i] = h
        count.value = len(handles)
        return _SUCCESS

    @_api
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        gpu = self._mig_gpu(device)
        self._need_privilege()
        gi = gpu.gis.get(gpuInstanceId)
        if gi is None:
            _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return gi.handle

    @_api
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        gi: _Gi = self._resolve(gpuInstance, _Gi)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = gi.gpu.handle
        info.id = gi.id
        info.profileId = gi.profile.profile_id
        info.placement.start, info.placement.size = gi.start, gi.profile.memory_slices
        return info

    # ------------------------------------------------------------------ compute instances

    def _ci_slices(self, gi: _Gi, profile: int) -> int:
        if not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if profile == _CI_1_SLICE_REV1:
            if gi.profile.enum == _GI_1_SLICE_REV2 and gi.gpu.model.hopper:
                return 1
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        slices = _SLICES_BY_CI_ENUM.get(profile)
        if slices is None or slices not in _CI_SPLITS.get(gi.profile.slices, ()):
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return slices

    @_api
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        """`device` is the GPU *instance* handle despite pynvml's parameter name."""
        gi: _Gi = self._resolve(device, _Gi)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version not in (1, 2):
            _fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        slices = self._ci_slices(gi, profile)
        p = gi.profile
        info = (
            pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlComputeInstanceProfileInfo_t()
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
            _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
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
        ci.handle = self._new_handle(pynvml.struct_c_nvmlComputeInstance_t, ci)
        ci.dev_handle = self._new_handle(pynvml.struct_c_nvmlDevice_t, _MigDevice(ci))
        gi.cis[ci.id] = ci
        return ci.handle

    @_api
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        ci: _Ci = self._resolve(computeInstance, _Ci)
        self._need_privilege()
        if ci.holder is not None or any(p.ci is ci for p in self._processes.values()):
            _fail(pynvml.NVML_ERROR_IN_USE)
        ci.alive = False
        del ci.gi.cis[ci.id]
        return _SUCCESS

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
            _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return ci.handle

    @_api
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> Any:
        ci: _Ci = self._resolve(computeInstance, _Ci)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = ci.gi.gpu.handle
        info.gpuInstance = ci.gi.handle
        info.id = ci.id
        info.profileId = ci.enum
        info.placement.start, info.placement.size = ci.start, ci.slices
        return info

    nvmlComputeInstanceGetInfo = nvmlComputeInstanceGetInfo_v2

    # ------------------------------------------------------------------ MIG devices

    @staticmethod
    def _live_cis(gpu: _Gpu) -> list[_Ci]:
        return [ci for gi in gpu.gis.values() for ci in gi.cis.values()]

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
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= index < _MAX_MIG_DEVICES:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for ci in self._live_cis(gpu):
            if ci.mig_index == index:
                return ci.dev_handle
        _fail(pynvml.NVML_ERROR_NOT_FOUND)  # gaps are normal after destroys

    def _mig(self, device: Any) -> _MigDevice:
        dev = self._device(device)
        if not isinstance(dev, _MigDevice):
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
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
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return dev.ci.gi.gpu.handle

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
            info = pynvml.c_nvmlProcessInfo_v3_t()
            info.pid = p.pid
            info.usedGpuMemory = p.used if p.used is not None else pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            info.gpuInstanceId = p.ci.gi.id if p.ci is not None else NO_ID
            info.computeInstanceId = p.ci.id if p.ci is not None else NO_ID
            obj = pynvml.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses_v3
    nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses_v3

    # ------------------------------------------------------------------ events

    @_api
    def nvmlEventSetCreate(self) -> Any:
        es = _EventSet()
        es.handle = self._new_handle(pynvml.struct_c_nvmlEventSet_t, es)
        self._event_sets.append(es)
        return es.handle

    def _event_set(self, handle: Any) -> _EventSet:
        addr = _handle_addr(handle)
        es = self._objs.get(addr) if addr is not None else None
        if not isinstance(es, _EventSet) or not es.alive:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return es

    @_api
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._gpu(handle)
        return _SUPPORTED_EVENTS

    @_api
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        dev = self._device(handle)
        if isinstance(dev, _MigDevice):
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # events are registered on the parent GPU only
        es = self._event_set(eventSet)
        if eventTypes & ~_SUPPORTED_EVENTS:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        es.masks[dev.index] = es.masks.get(dev.index, 0) | eventTypes

    @_api
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """Block up to `timeoutms` for the next event; TIMEOUT when none, GPU_IS_LOST once per loss."""
        es = self._event_set(eventSet)
        deadline = time.monotonic() + max(0, timeoutms) / 1000.0
        while True:
            if not es.alive:
                _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if es.lost:
                es.lost.popleft()
                _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            if es.queue:
                gpu, etype, edata, gi_id, ci_id = es.queue.popleft()
                data = pynvml.c_nvmlEventData_t()
                data.device = gpu.handle
                data.eventType = etype
                data.eventData = edata
                data.gpuInstanceId = gi_id
                data.computeInstanceId = ci_id
                return data
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _fail(pynvml.NVML_ERROR_TIMEOUT)
            self._cond.wait(remaining)

    nvmlEventSetWait = nvmlEventSetWait_v2

    @_api
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        es = self._event_set(eventSet)
        es.alive = False
        self._event_sets.remove(es)
        self._cond.notify_all()

    # ------------------------------------------------------------------ test hooks

    def add_process(self, device_uuid: str, pid: int, used_bytes: int | None) -> None:
        """Pretend `pid` runs CUDA work on a GPU (MIG off) or a MIG device (by MIG UUID)."""
        with self._lock:
            if pid in self._processes:
                raise ValueError(f"pid {pid} already has a GPU context")
            for gpu in self._gpus:
                if gpu.uuid == device_uuid:
                    if gpu.mig_current:
                        raise ValueError(f"GPU {device_uuid} is in MIG mode: processes run on MIG devices")
                    self._check_fits(gpu.model.memory_mib, gpu, None, used_bytes)
                    self._processes[pid] = _Process(pid, used_bytes, gpu, None)
                    return
                for ci in self._live_cis(gpu):
                    if ci.uuid == device_uuid:
                        self._check_fits(ci.gi.profile.memory_mib, gpu, ci.gi, used_bytes)
                        self._processes[pid] = _Process(pid, used_bytes, gpu, ci)
                        return
            raise ValueError(f"no simulated device with UUID {device_uuid}")

    def _check_fits(self, total_mib: int, gpu: _Gpu, gi: _Gi | None, used_bytes: int | None) -> None:
        used = sum(
            p.used or 0
            for p in self._processes.values()
            if p.gpu is gpu and (gi is None or (p.ci is not None and p.ci.gi is gi))
        )
        if used + (used_bytes or 0) > total_mib * MiB:
            raise ValueError("out of memory on the simulated device")

    def remove_process(self, pid: int) -> None:
        """The process exited (its contexts are gone)."""
        with self._lock:
            self._processes.pop(pid, None)

    def inject_xid(self, gpu_index: int, xid: int, gi: int | None = None, ci: int | None = None) -> None:
        """Deliver an Xid critical error once to every event set registered for it on that GPU.

        Unprivileged callers never hear instance-scoped events (nvml.h, nvmlEventSetWait: "In absence of
        required privileges, only the events which affect all the instances (i.e. whole device) are
        reported"), so those are dropped when the simulator runs with privileged=False.
        """
        with self._lock:
            gpu = self._gpus[gpu_index]
            if not self._privileged and (gi is not None or ci is not None):
                return
            for es in self._event_sets:
                if es.masks.get(gpu_index, 0) & pynvml.nvmlEventTypeXidCriticalError:
                    es.queue.append(
                        (gpu, pynvml.nvmlEventTypeXidCriticalError, xid,
                         NO_ID if gi is None else gi, NO_ID if ci is None else ci)
                    )
            self._cond.notify_all()

    def lose_gpu(self, index: int) -> None:
        """The GPU falls off the bus: every call on it raises GpuIsLost; waiting sets hear it once."""
        with self._lock:
            gpu = self._gpus[index]
            gpu.lost = True
            for es in self._event_sets:
                if index in es.masks:
                    es.lost.append(gpu)
            self._cond.notify_all()

    def reset_gpu(self, index: int) -> None:
        """`nvidia-smi -r`: needs an idle GPU; applies a pending MIG mode and clears MIG config."""
        with self._lock:
            gpu = self._gpus[index]
            if any(p.gpu is gpu for p in self._processes.values()):
                _fail(pynvml.NVML_ERROR_IN_USE)
            self._reset(gpu)

    def fail_next(self, function: str, code: int, times: int = 1) -> None:
        """Make the next `times` calls of an NVML function fail with `code` (fault injection)."""
        target = getattr(type(self), function, None)
        if not callable(target):
            raise ValueError(f"simnvml has no function {function}")
        with self._lock:  # aliases (nvmlEventSetWait -> _v2) share one queue under the real name
            self._faults.setdefault(target.__name__, deque()).extend([code] * times)

    def hold_instance(self, mig_uuid: str, holder: str = "nv-hostengine", *, level: str = "ci") -> None:
        """A non-compute client (DCGM's nv-hostengine is the known one) keeps a handle open on a MIG
        instance: destroying its CI (level="ci") or its GI (level="gi") fails IN_USE with no process
        listed (NVIDIA/DCGM issues #95 on H100, #276 on H200: both CIs and GIs)."""
        if level not in ("ci", "gi"):
            raise ValueError("level must be 'ci' or 'gi'")
        with self._lock:
            ci = self._ci_by_uuid(mig_uuid)
            if level == "ci":
                ci.holder = holder
            else:
                ci.gi.holder = holder

    def release_instance(self, mig_uuid: str) -> None:
        """The holder let go (e.g. DCGM restarted): destroy works again."""
        with self._lock:
            ci = self._ci_by_uuid(mig_uuid)
            ci.holder = None
            ci.gi.holder = None

    def _ci_by_uuid(self, mig_uuid: str) -> _Ci:
        for gpu in self._gpus:
            for ci in self._live_cis(gpu):
                if ci.uuid == mig_uuid:
                    return ci
        raise ValueError(f"no simulated MIG device with UUID {mig_uuid}")

    @property
    def privileged(self) -> bool:
        """Whether callers act as root (pynvml has no such attribute; tools read it to mirror a run)."""
        return self._privileged

    def set_privileged(self, privileged: bool) -> None:
        """Switch between a root and an unprivileged caller (e.g. after building a layout as root)."""
        with self._lock:
            self._privileged = privileged

    def set_utilization(self, index: int, gpu: int, memory: int = 0) -> None:
        """Set what nvmlDeviceGetUtilizationRates reports for a GPU (MIG off)."""
        with self._lock:
            self._gpus[index].util_gpu = gpu
            self._gpus[index].util_memory = memory


def _ci_name(gi: _Gi, slices: int) -> str:
    """`3g.40gb` for the full-size CI, `1c.3g.40gb` for a smaller one (nvidia-smi -lcip naming)."""
    return gi.profile.name if slices == gi.profile.slices else f"{slices}c.{gi.profile.name}"


def _gpu_uuid(model: GpuModel, index: int) -> str:
    """Stable per (model, index), so a restarted simulated daemon sees the same GPUs."""
    u = str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"gpusched-sim/{model.key}/{index}"))
    return f"GPU-{model.uuid_prefix}{u[8:]}"


__all__ = ["MEMORY_SLICES", "NO_ID", "SimNVML"]
