"""The simulator's state and plumbing: the records behind every handle (GPUs, GPU and compute
instances, MIG devices, processes, event sets), the driver constants it reproduces, the `_api`
wrapper (one lock, nvmlInit first, injected faults), and `SimCore`, which owns the state, turns
handles into records and forwards pynvml's constants and classes.

`SimNVML` (simnvml.py) is this core plus its parts: simnvml_device (init, device queries,
processes), simnvml_mig (MIG mode, GPU-instance profiles and instances), simnvml_ci (compute
instances, MIG device handles), simnvml_events (event sets) and simnvml_hooks (test hooks).
"""

from __future__ import annotations

import ctypes
import functools
import random
import threading
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Concatenate, NoReturn, ParamSpec, Self, TypeVar

from gpusched.gpu.profiles import (
    CI_ENUM_BY_SLICES,
    COMPUTE_SLICES,
    MODEL_KEYS,
    MODELS,
    GpuModel,
    MigProfile,
)

MiB = 1024 * 1024
NO_ID = 0xFFFFFFFF  # gi/ci id of processes and events that are not scoped to a MIG instance
DEFAULT_DRIVER_VERSION = "550.90.07"  # first R550 release that supports MIG on H200
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
_MAX_GI_ID = 14
_MAX_CI_ID = 7
_MAX_MIG_DEVICES = COMPUTE_SLICES

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
S = TypeVar("S", bound="SimCore")


def _api(fn: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Serialise a call on the simulator's lock and refuse it before nvmlInit, like the library."""

    def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            if self._init_count == 0:
                self._fail(self._nv.NVML_ERROR_UNINITIALIZED)
            fault = self._faults.get(fn.__name__)
            if fault:
                code = fault.popleft()
                if not fault:
                    del self._faults[fn.__name__]
                self._fail(code)
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


class SimCore:
    """The simulator's state, its handles and its pynvml passthrough; the API lives in the mixins.

    `_nv` is the pynvml module. Only gpu/nvml.py and simnvml.py import it (the house rule); the
    parts reach it through here, set on `SimNVML`, so they raise pynvml's own exception classes and
    fill pynvml's own ctypes structs without importing the vendor module themselves.
    """

    _nv: Any

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
            gpu.handle = self._new_handle(self._nv.struct_c_nvmlDevice_t, gpu)
            self._gpus.append(gpu)

    @classmethod
    def from_spec(cls, spec: str, **kwargs: Any) -> Self:
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

    def _fail(self, code: int) -> NoReturn:
        """Raise exactly what pynvml raises for `code` (the per-code NVMLError subclass)."""
        raise self._nv.NVMLError(code)

    def _supported_events(self) -> int:
        """The event types the simulator can deliver (nvmlDeviceGetSupportedEventTypes)."""
        nv = self._nv
        return int(nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeSingleBitEccError
                   | nv.nvmlEventTypeDoubleBitEccError | nv.nvmlEventTypePState)

    # ------------------------------------------------------------------ pynvml passthrough

    def __getattr__(self, name: str) -> Any:
        """Constants, struct classes and exception classes come straight from pynvml.

        NVML *functions* we do not simulate raise AttributeError instead of silently reaching
        for a real driver.
        """
        if name == "_nv":  # a core with no module set (only SimNVML sets it): no endless recursion
            raise AttributeError("_nv: the pynvml module is set by simnvml.SimNVML")
        value = getattr(self._nv, name)
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
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        if self._gpu_of(obj).lost:
            self._fail(self._nv.NVML_ERROR_GPU_IS_LOST)
        if not obj.alive:
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)  # stale handle: the instance was destroyed
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
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        return dev

    def _need_privilege(self) -> None:
        """Writes, and the reads nvml.h marks "Requires privileged user": GetGpuInstancePossiblePlacements_v2,
        GetGpuInstanceRemainingCapacity, GetGpuInstances, GetGpuInstanceById, GetComputeInstances,
        GetComputeInstanceById, GetComputeInstanceRemainingCapacity (nvml.h as vendored in NVIDIA/go-nvml)."""
        if not self._privileged:
            self._fail(self._nv.NVML_ERROR_NO_PERMISSION)

    @staticmethod
    def _live_cis(gpu: _Gpu) -> list[_Ci]:
        return [ci for gi in gpu.gis.values() for ci in gi.cis.values()]


def _ci_name(gi: _Gi, slices: int) -> str:
    """`3g.40gb` for the full-size CI, `1c.3g.40gb` for a smaller one (nvidia-smi -lcip naming)."""
    return gi.profile.name if slices == gi.profile.slices else f"{slices}c.{gi.profile.name}"


def _gpu_uuid(model: GpuModel, index: int) -> str:
    """Stable per (model, index), so a restarted simulated daemon sees the same GPUs."""
    u = str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"gpusched-sim/{model.key}/{index}"))
    return f"GPU-{model.uuid_prefix}{u[8:]}"
