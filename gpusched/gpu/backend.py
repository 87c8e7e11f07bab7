"""The one interface between gpusched and GPUs, and the plain snapshot types it returns.

Everything above this line (core, daemon, replay) sees frozen dataclasses, never NVML handles, so
the scheduler can be fed from the real driver, the simulator, or a replay without knowing which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class GpuError(Exception):
    """A GPU operation failed. `code` is stable and shown to operators."""

    code = "gpu_error"

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class GpuBusyError(GpuError):
    """The device or instance has processes or children; nothing was changed."""

    code = "gpu_busy"


class GpuLostError(GpuError):
    """The GPU fell off the bus or stopped answering; it must be drained."""

    code = "gpu_lost"


class GpuNotSupportedError(GpuError):
    """The operation does not apply (MIG off, profile not offered, MIG-mode telemetry)."""

    code = "gpu_not_supported"


class GpuInsufficientResourcesError(GpuError):
    """No room: overlapping placement or the profile's instance cap reached."""

    code = "gpu_insufficient_resources"


class GpuInvalidArgumentError(GpuError):
    """A placement or profile the GPU does not accept."""

    code = "gpu_invalid_argument"


class GpuNotFoundError(GpuError):
    """No GPU or instance with that index or UUID."""

    code = "gpu_not_found"


class GpuPermissionError(GpuError):
    """The driver refused: MIG changes need root or the mig/config capability."""

    code = "gpu_no_permission"


class Health(StrEnum):
    OK = "ok"
    DRAINED = "drained"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class Instance:
    """A MIG GPU instance with its (single, full-size) compute instance."""

    uuid: str
    gpu_index: int
    profile: str  # name, e.g. "3g.40gb"
    profile_id: int  # the `-lgip` id (19, 14, 9, ...), not the pynvml enum
    gi_id: int
    ci_id: int
    start: int  # first memory slice of the placement
    size: int  # memory slices covered
    memory_mib: int
    sm_count: int


@dataclass(frozen=True, slots=True)
class Partition:
    """Where a logical GPU sits on its physical GPU (AMD Instinct compute/memory partitions).

    amdsmi enumerates each logical GPU as a device of its own; this says which physical GPU it
    belongs to, in which modes, and which of its `count` parts it is, so a mode change (which
    needs the whole physical GPU idle) can be planned."""

    physical_index: int  # index of the physical GPU (amdsmi socket) in enumeration order
    physical_uuid: str  # amdsmi's UUID of the physical GPU (shared by all its partitions)
    compute_mode: str  # SPX, DPX, QPX, CPX (TPX on MI300A)
    memory_mode: str  # NPS1, NPS4 (NPS2, NPS8 on other parts)
    index_in_physical: int  # the driver's partition id, 0 .. count-1
    count: int  # logical GPUs the physical GPU shows in this compute mode


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU as the scheduler needs to see it: a physical NVIDIA GPU, or one logical AMD GPU."""

    index: int
    uuid: str
    name: str  # the driver's name, e.g. "NVIDIA H100 80GB HBM3"
    model: str  # our model key: A100-40GB, A100-80GB, H100-80GB, H200
    memory_total_mib: int
    sm_count: int  # NVIDIA: streaming multiprocessors; AMD: compute units (CUs) of this logical GPU
    mig_enabled: bool
    mig_pending: bool  # the mode the GPU will have after the next reset
    instances: tuple[Instance, ...] = ()
    memory_used_mib: int | None = None
    numa_node: int | None = None
    cpu_affinity: tuple[int, ...] = ()
    partition: Partition | None = None  # set for AMD logical GPUs; None on NVIDIA
    vendor: str = "nvidia"  # "nvidia" or "amd"


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a device. `used_memory_bytes` is None where NVML reports N/A."""

    pid: int
    device_uuid: str
    used_memory_bytes: int | None


@dataclass(frozen=True, slots=True)
class XidEvent:
    """A critical XID; gi_id/ci_id are set when the driver scoped it to a MIG instance."""

    gpu_index: int
    xid: int
    gi_id: int | None = None
    ci_id: int | None = None
    lost: bool = False  # the GPU stopped answering (reported as XID 79); drain it whole


@dataclass(frozen=True, slots=True)
class MigModeChange:
    """Result of asking for a MIG mode: `pending` is True when a reset or idle GPU is still needed."""

    gpu_index: int
    current: bool
    pending: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PartitionModeChange:
    """Result of setting a physical GPU's compute and memory partition modes (AMD Instinct)."""

    physical_index: int
    compute: str
    memory: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Inventory:
    """All GPUs at one moment, plus the driver version when known."""

    gpus: tuple[Gpu, ...]
    driver_version: str = ""
    backend: str = ""
    errors: dict[int, str] = field(default_factory=dict)  # gpu index -> why it is unschedulable


class GpuBackend(Protocol):
    """What gpusched needs from GPUs. Implemented by `gpu.nvml.NvmlBackend` over pynvml or simnvml and
    by `gpu.amdsmi.AmdSmiBackend` over amdsmi or simamdsmi."""

    def inventory(self) -> Inventory: ...

    def create_instance(self, gpu_index: int, profile: str, start: int) -> Instance: ...

    def destroy_instance(self, uuid: str) -> None: ...

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> MigModeChange: ...

    def set_partition_mode(self, physical_index: int, compute: str, memory: str) -> PartitionModeChange: ...

    def processes(self, device_uuid: str) -> list[GpuProcess]: ...

    def utilization(self, gpu_index: int) -> int | None: ...

    def wait_event(self, timeout_ms: int) -> XidEvent | None: ...

    def close(self) -> None: ...
