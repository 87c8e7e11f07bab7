"""The door to amdsmi: `AmdSmiCore` holds the amdsmi module (real or simulated) and is the one place
its functions are called (`_call`, which maps every amdsmi status to a GpuError class of backend.py).

Status mapping (codes are amdsmi_status_t values, amdsmi_wrapper.py):
  BUSY 30, AMDGPU_RESTART_ERR 54 -> GpuBusyError   (work on the GPU / the driver cannot reload)
  NOT_SUPPORTED 2                -> GpuNotSupportedError
  INVAL 1, SETTING_UNAVAILABLE 55 -> GpuInvalidArgumentError
  NOT_FOUND 31                   -> GpuNotFoundError (also a handle from before a mode change)
  NO_PERM 10                     -> GpuPermissionError
  OUT_OF_RESOURCES 15            -> GpuInsufficientResourcesError
  UNEXPECTED_SIZE 42             -> GpuLostError    (sysfs reads failing with EIO; assumed to mean
                                                     the GPU stopped answering, see docs/gpu.md)
  anything else                  -> GpuError
"""

from __future__ import annotations

import contextlib
import threading
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

AMD_SIM_HINT = "no AMD driver or amdsmi here; to try gpusched without GPUs use a simulator spec such as MI300X:2"
STATUS_NO_DATA = 40  # amdsmi_get_gpu_event_notification found no event within the timeout

_ERROR_CLASSES: dict[int, type[GpuError]] = {
    30: GpuBusyError,
    54: GpuBusyError,
    2: GpuNotSupportedError,
    1: GpuInvalidArgumentError,
    55: GpuInvalidArgumentError,
    31: GpuNotFoundError,
    10: GpuPermissionError,
    15: GpuInsufficientResourcesError,
    42: GpuLostError,
}
_HINTS: dict[int, str] = {
    10: "partition changes need root",
    54: "changing the memory mode reloads amdgpu, which needs every GPU on the node idle",
    42: "the GPU stopped answering; it needs a reset or a reboot",
    55: "the GPU does not offer that mode with its current memory mode",
}


class AmdSmiCore:
    """The amdsmi module and the one wrapper around its calls."""

    def __init__(self, module: Any, *, init: bool = True) -> None:
        self._smi = module
        self._lock = threading.Lock()
        self._closed = False
        self.backend_name = str(getattr(module, "backend_name", getattr(module, "__name__", "amdsmi")))
        if init:
            self._call("amdsmi_init", module.AmdSmiInitFlags.INIT_AMD_GPUS)

    @property
    def module(self) -> Any:
        """The amdsmi module this backend drives (a SimAmdSmi in simulation; for its test hooks)."""
        return self._smi

    def _call(self, fn: str, *args: Any, what: str = "") -> Any:
        """Call one amdsmi function, turning its exceptions into GpuError subclasses."""
        try:
            return getattr(self._smi, fn)(*args)
        except self._smi.AmdSmiLibraryException as err:
            raise self._map(int(err.get_error_code()), fn, what) from err
        except self._smi.AmdSmiException as err:  # parameter checks: a bug on our side, but typed
            raise GpuInvalidArgumentError(f"{fn}: {err}") from err

    def _map(self, code: int, fn: str, what: str) -> GpuError:
        cls = _ERROR_CLASSES.get(code, GpuError)
        where = f" ({what})" if what else ""
        return cls(f"{fn}{where}: {status_name(self._smi, code)}", hint=_HINTS.get(code, ""))

    def _reinit(self) -> None:
        """Enumerate again: amdsmi lists devices only in amdsmi_init, and a mode change re-creates them."""
        with contextlib.suppress(GpuError):
            self._call("amdsmi_shut_down")
        self._call("amdsmi_init", self._smi.AmdSmiInitFlags.INIT_AMD_GPUS)


def status_name(module: Any, code: int) -> str:
    """AMDSMI_STATUS_BUSY for 30, from the module's amdsmi_wrapper constants when it has them."""
    wrapper = getattr(module, "amdsmi_wrapper", None)
    for name in dir(wrapper) if wrapper is not None else ():
        if name.startswith("AMDSMI_STATUS_") and getattr(wrapper, name) == code:
            return str(name)
    return f"amdsmi status {code}"
