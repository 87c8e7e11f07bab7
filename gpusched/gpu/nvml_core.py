"""The door to NVML: `NvmlCore` holds the nvml module and is the one place its functions are called
(`_call`, which maps every NVML error to a GpuError class of backend.py), plus the constants and the
small decoders the other parts of the backend share.

`NvmlBackend` (nvml.py) is this door plus its parts: nvml_read (inventory, processes, utilization),
nvml_mig (MIG changes) and nvml_events (XIDs, lost GPUs). Those parts name NVML functions but call
them only through `_call`, so error mapping stays in one place.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpusched.gpu.backend import (
    GpuBusyError,
    GpuError,
    GpuInsufficientResourcesError,
    GpuInvalidArgumentError,
    GpuLostError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuPermissionError,
)

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


class NvmlCore:
    """The nvml module, the one wrapper around its calls, and the state every part shares."""

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


def _bits(mask: Any) -> tuple[int, ...]:
    """CPU (or node) numbers set in an array of 64-bit words."""
    return tuple(w * 64 + b for w in range(len(mask)) for b in range(64) if int(mask[w]) >> b & 1)


def _profile_name(raw: Any) -> str:
    """`MIG 3g.40gb` (bytes from the v2 struct) -> `3g.40gb`."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.removeprefix("MIG ").strip()
