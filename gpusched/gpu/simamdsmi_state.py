"""The simulated amdsmi's state: physical GPUs and their modes, the enumeration taken at amdsmi_init
(which handles exist), processes, event queues, and the one lock every call holds.

Facts reproduced here, with their sources (details in docs/gpu.md, "AMD Instinct (amdsmi)"):
- amdsmi enumerates devices once, in amdsmi_init (src/amd_smi/amd_smi_system.cc, populate_amd_gpu_devices);
  a handle the library does not know answers AMDSMI_STATUS_NOT_FOUND (AMDSMI_System::handle_to_processor),
  a call before init AMDSMI_STATUS_NOT_INIT (AMDSMI_CHECK_INIT in amd_smi.cc).
- The UUID is built from the ASIC serial and the PCI device id with function byte 0xff
  (amd_smi.cc amdsmi_get_gpu_device_uuid, amd_smi_uuid.cc), so every logical GPU of one physical GPU
  reports the same UUID, in every mode.
- A socket is a physical GPU, named by the domain:bus:device part of its BDF (amd_smi_system.cc,
  get_gpu_socket_id); the partition id sits in bits 31:28 of the 64-bit BDF id, which the formatted
  BDF string leaves out (amdsmi_interface.py, _format_bdf).
"""

from __future__ import annotations

import ctypes
import functools
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from gpusched.gpu.amd_profiles import AmdModel, amd_model
from gpusched.gpu.simamdsmi_api import (
    AMDSMI_STATUS_INVAL,
    AMDSMI_STATUS_NOT_FOUND,
    AMDSMI_STATUS_NOT_INIT,
    AMDSMI_STATUS_UNEXPECTED_SIZE,
    AmdSmiParameterException,
    fail,
)

DEFAULT_DRIVER_VERSION = "6.8.5"  # an amdgpu DKMS version string as amdsmi_get_gpu_driver_info shows it (illustrative)

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="SimAmdCore")


def amdsmi_uuid(asic_serial: int, device_id: int) -> str:
    """amd_smi_uuid.cc amdsmi_uuid_gen(serial, did, fcn=0xff) printed as amdsmi prints it."""
    asic_0 = asic_serial & 0xFFFFFFFF
    asic_4 = (asic_serial >> 32) & 0xFFFF
    asic_6 = (asic_serial >> 48) & 0xFF
    asic_7 = (asic_serial >> 56) & 0xFF
    return f"{asic_7:02x}ff{device_id:04x}-0000-1000-80{asic_6:02x}-{asic_4:04x}{asic_0:08x}"


@dataclass(eq=False)
class _Physical:
    """One physical GPU (an amdsmi socket)."""

    index: int
    model: AmdModel
    asic_serial: int
    bus: int
    numa_node: int
    compute: str
    memory: str
    generation: int = 0  # bumped whenever the driver re-creates this GPU's devices
    lost: bool = False
    activity: int = 0  # gfx_activity in percent

    @property
    def uuid(self) -> str:
        return amdsmi_uuid(self.asic_serial, self.model.device_id)

    @property
    def socket_id(self) -> str:
        return f"0000:{self.bus:02X}:00"  # amd_smi_system.cc get_gpu_socket_id: upper-case hex, no function

    @property
    def count(self) -> int:
        return self.model.partitions(self.compute)


@dataclass(eq=False)
class _Logical:
    """One enumerated device: a partition of a physical GPU as it was when amdsmi_init ran."""

    physical: _Physical
    partition_id: int
    generation: int
    kfd_id: int


@dataclass
class _Process:
    pid: int
    name: str
    vram_bytes: int
    physical: _Physical
    partition_id: int


@dataclass(eq=False)
class _Reader:
    """An AmdSmiEventReader's registration: which devices, which event types."""

    devices: list[_Logical]
    mask: int
    stopped: bool = False


@dataclass
class _Event:
    physical: _Physical
    partition_id: int
    kind: int  # AmdSmiEvtNotificationType value
    message: str


def _api(fn: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """One lock per call, NOT_INIT before amdsmi_init, and injected faults, like the library's checks."""

    @functools.wraps(fn)
    def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            if not self._initialized:
                fail(AMDSMI_STATUS_NOT_INIT)
            faults = self._faults.get(fn.__name__)
            if faults:
                fail(faults.popleft())
            return fn(self, *args, **kwargs)

    return wrapper


class SimAmdCore:
    """State and handle lookup shared by the simulated library's functions and its test hooks."""

    backend_name = "simamdsmi"

    def __init__(self, models: list[str], *, seed: int = 0, privileged: bool = True,
                 driver_version: str = DEFAULT_DRIVER_VERSION,
                 modes: list[tuple[str, str] | None] | None = None, host_cpus: int = 64) -> None:
        """`modes`: each GPU's (compute, memory) mode at start (as the driver kept it from the last
        boot), None for the model's boot mode (SPX/NPS1). `host_cpus`: the simulated host's CPUs,
        split evenly over its two NUMA nodes (as simnvml's)."""
        self._host_cpus = host_cpus
        rng = random.Random(seed)
        half = max(1, (len(models) + 1) // 2)
        start = modes or [None] * len(models)
        self._physicals = [
            _Physical(index=i, model=amd_model(key), asic_serial=rng.getrandbits(64), bus=0x05 + 0x20 * i,
                      numa_node=0 if i < half else 1,
                      compute=(start[i] or (amd_model(key).boot_compute, ""))[0],
                      memory=(start[i] or ("", amd_model(key).boot_memory))[1])
            for i, key in enumerate(models)
        ]
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._initialized = False
        self._privileged = privileged
        self._driver_version = driver_version
        self._handles: dict[int, _Logical] = {}  # handle value -> device, from the last amdsmi_init
        self._order: list[int] = []
        self._sockets: dict[int, _Physical] = {}
        self._next_handle = 0x1000
        self._next_kfd = 1
        self._processes: dict[int, _Process] = {}
        self._readers: list[_Reader] = []
        self._events: deque[_Event] = deque()
        self._faults: dict[str, deque[int]] = {}

    @classmethod
    def from_spec(cls, spec: str, **kwargs: Any) -> Any:
        """`MI300X:2` or `MI300X:1,MI325X:1` -> a simulator with those GPUs (ValueError if malformed).
        A part may name the mode its GPUs start in: `MI300X:2@CPX` (memory NPS1) or `MI300X:1@QPX/NPS4`."""
        models: list[str] = []
        modes: list[tuple[str, str] | None] = []
        for part in spec.split(","):
            part, _, mode = part.strip().partition("@")
            key, _, n = part.partition(":")
            try:
                count = int(n) if n else 1
            except ValueError:
                raise ValueError(f"bad GPU count in {part!r}") from None
            if count < 1:
                raise ValueError(f"bad GPU count in {part!r}")
            model = amd_model(key)
            start = None
            if mode:
                compute, _, memory = mode.upper().partition("/")
                start = (compute, memory or model.boot_memory)
                if not model.is_valid(*start):
                    valid = ", ".join(f"{c}/{m}" for c, m in model.valid_combinations())
                    raise ValueError(f"{key} does not run {start[0]}/{start[1]} (in {spec!r}); valid: {valid}")
            models.extend([key] * count)
            modes.extend([start] * count)
        if not models:
            raise ValueError("empty simulator spec")
        return cls(models, modes=modes, **kwargs)

    def node_cpus(self, node: int) -> tuple[int, ...]:
        """The simulated host's CPUs of NUMA node `node` (not an amdsmi call: the host's sysfs
        answers this on real hardware, gpu/numa.py), () for a node it does not have."""
        per_node = max(1, self._host_cpus // 2)
        return tuple(range(node * per_node, (node + 1) * per_node)) if node in (0, 1) else ()

    # ------------------------------------------------------------------ enumeration

    def _enumerate(self) -> None:
        """What amdsmi_init sees: every partition of every GPU, sockets in BDF order, partitions by id."""
        self._handles.clear()
        self._order.clear()
        self._sockets.clear()
        for phys in sorted(self._physicals, key=lambda p: p.bus):
            self._sockets[self._new_handle_value()] = phys
            for pid in range(phys.count):
                value = self._new_handle_value()
                self._handles[value] = _Logical(phys, pid, phys.generation, self._next_kfd)
                self._next_kfd += 1
                self._order.append(value)

    def _new_handle_value(self) -> int:
        self._next_handle += 0x40
        return self._next_handle

    def _logical(self, handle: Any) -> _Logical:
        """The device behind a handle: wrong type -> AmdSmiParameterException, unknown or from a
        previous enumeration -> NOT_FOUND, lost GPU -> UNEXPECTED_SIZE (sysfs reads fail with EIO,
        which rocm_smi maps there: rocm_smi_utils.cc ErrnoToRsmiStatus)."""
        if not isinstance(handle, ctypes.c_void_p):
            raise AmdSmiParameterException(handle, ctypes.c_void_p)
        if handle.value is None:
            fail(AMDSMI_STATUS_INVAL)
        logical = self._handles.get(int(handle.value or 0))
        if logical is None or logical.generation != logical.physical.generation:
            fail(AMDSMI_STATUS_NOT_FOUND)
        if logical.physical.lost:
            fail(AMDSMI_STATUS_UNEXPECTED_SIZE)
        return logical

    def _socket(self, handle: Any) -> _Physical:
        if not isinstance(handle, ctypes.c_void_p):
            raise AmdSmiParameterException(handle, ctypes.c_void_p)
        phys = self._sockets.get(int(handle.value or 0))
        if phys is None:
            fail(AMDSMI_STATUS_NOT_FOUND)
        return phys

    def _busy(self, phys: _Physical) -> bool:
        return any(p.physical is phys for p in self._processes.values())
