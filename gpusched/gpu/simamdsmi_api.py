"""The names of the `amdsmi` Python package that the simulator reproduces: status codes, exception
classes, enums and handle types, with the real values.

Source: ROCm/amdsmi, py-interface/amdsmi_wrapper.py, amdsmi_exception.py, amdsmi_interface.py at
commit 0ceca28f4139dced5e9b5739a3f393780d7add48 (Oct 2024). The real package cannot be imported
without libamd_smi.so, so these are copied by value, not imported; tests/gpu/test_amdsmi_backend.py
compares them with the real package where it is installed.
"""

from __future__ import annotations

import ctypes
from enum import IntEnum
from types import SimpleNamespace
from typing import Any, NoReturn

# amdsmi_status_t (amdsmi_wrapper.py). Only the codes the simulator or the backend use are listed.
AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NOT_YET_IMPLEMENTED = 3
AMDSMI_STATUS_FAIL_LOAD_MODULE = 4
AMDSMI_STATUS_DRM_ERROR = 6
AMDSMI_STATUS_API_FAILED = 7
AMDSMI_STATUS_TIMEOUT = 8
AMDSMI_STATUS_RETRY = 9
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_INTERRUPT = 11
AMDSMI_STATUS_IO = 12
AMDSMI_STATUS_FILE_ERROR = 14
AMDSMI_STATUS_OUT_OF_RESOURCES = 15
AMDSMI_STATUS_INPUT_OUT_OF_BOUNDS = 17
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_BUSY = 30
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
AMDSMI_STATUS_NO_DATA = 40
AMDSMI_STATUS_INSUFFICIENT_SIZE = 41
AMDSMI_STATUS_UNEXPECTED_SIZE = 42
AMDSMI_STATUS_UNEXPECTED_DATA = 43
AMDSMI_STATUS_AMDGPU_RESTART_ERR = 54
AMDSMI_STATUS_SETTING_UNAVAILABLE = 55
AMDSMI_STATUS_UNKNOWN_ERROR = 4294967295

STATUS_NAMES: dict[int, str] = {
    v: k for k, v in globals().items() if k.startswith("AMDSMI_STATUS_") and isinstance(v, int)
}

# `amdsmi.amdsmi_wrapper` exposes the raw constants; code written against the real package reads
# status codes from there, so the simulator offers the same attribute.
amdsmi_wrapper = SimpleNamespace(**{name: code for code, name in STATUS_NAMES.items()})


class AmdSmiException(Exception):
    """Base smi exception class (amdsmi_exception.py)."""


class AmdSmiLibraryException(AmdSmiException):
    """A call returned a non-success status; `err_code` is the amdsmi_status_t value."""

    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = f"{STATUS_NAMES.get(err_code, 'AMDSMI_STATUS_UNKNOWN_ERROR')}"

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_info(self) -> str:
        return self.err_info

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    """A Python-side argument check failed before the C library was called (err_code is None)."""

    def __init__(self, receivedValue: Any, expectedType: Any, msg: str | None = None) -> None:
        super().__init__(msg)
        self.err_code = None
        self.actualType = type(receivedValue)
        self.expectedType = expectedType
        self.err_msg = msg or f"Invalid parameter:\nActual type: {self.actualType}\nExpected type: {expectedType}"

    def __str__(self) -> str:
        return self.err_msg


def check_res(code: int) -> None:
    """`_check_res` of amdsmi_interface.py: RETRY and TIMEOUT have classes of their own."""
    if code == AMDSMI_STATUS_RETRY:
        raise AmdSmiRetryException()
    if code == AMDSMI_STATUS_TIMEOUT:
        raise AmdSmiTimeoutException()
    if code != AMDSMI_STATUS_SUCCESS:
        raise AmdSmiLibraryException(code)


def fail(code: int) -> NoReturn:
    """Raise what the library raises for a non-success status."""
    check_res(code)
    raise AssertionError(f"fail() needs a non-success status, got {code}")


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 4294967295
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2
    INIT_NON_AMD_CPUS = 4
    INIT_NON_AMD_GPUS = 8
    INIT_AMD_APUS = 3


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


class AmdSmiComputePartitionType(IntEnum):
    CPX = 5
    SPX = 1
    DPX = 2
    TPX = 3
    QPX = 4
    INVALID = 0


class AmdSmiMemoryPartitionType(IntEnum):
    NPS1 = 1
    NPS2 = 2
    NPS4 = 3
    NPS8 = 4
    UNKNOWN = 0


class AmdSmiEvtNotificationType(IntEnum):
    NONE = 0
    VMFAULT = 1
    THERMAL_THROTTLE = 2
    GPU_PRE_RESET = 3
    GPU_POST_RESET = 4
    RING_HANG = 5


# amdsmi_wrapper.py: both handle types are `ctypes.POINTER(None)`, i.e. ctypes.c_void_p.
amdsmi_processor_handle = ctypes.c_void_p
amdsmi_socket_handle = ctypes.c_void_p
MAX_NUM_PROCESSES = 1024  # amdsmi_interface.py: the process list buffer size
