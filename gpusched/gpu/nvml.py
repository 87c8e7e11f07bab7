"""`NvmlBackend`: the GpuBackend over any module object with pynvml's API.

This module and its parts (nvml_core, nvml_read, nvml_mig, nvml_events) are the only code that calls
NVML. It is handed the module (real `pynvml` or a `SimNVML`), so the same code runs against the
driver and in every test. All NVML errors pass through `_call` (nvml_core),
which maps them to the GpuError classes of backend.py; values the scheduler relies on are never
defaulted: a GPU whose facts cannot be read lands in `Inventory.errors` and is not scheduled.

SM count choice: the whole-GPU SM count comes from our model table (profiles.py: A100 108, H100 PCIe
114, other Hopper models 132) because NVML has no call for it on a full GPU; for a GPU model we have
no table for, we use the 7g profile's multiprocessorCount when MIG is on, and otherwise report the
GPU as unschedulable.
"""

from __future__ import annotations

from gpusched.gpu.backend import GpuError, GpuInvalidArgumentError
from gpusched.gpu.nvml_core import (  # re-exported: callers and tests import them from here
    GI_REFUSED_HOLDOFF_S,
    NO_ID,
    SIM_HINT,
    XID_FALLEN_OFF_BUS,
    MiB,
)
from gpusched.gpu.nvml_events import EventsMixin
from gpusched.gpu.nvml_mig import MigMixin

__all__ = ["GI_REFUSED_HOLDOFF_S", "NO_ID", "SIM_HINT", "XID_FALLEN_OFF_BUS", "MiB", "NvmlBackend", "open_backend"]


class NvmlBackend(MigMixin, EventsMixin):
    """GpuBackend over pynvml or simnvml. Safe to call from the loop while `wait_event` blocks.

    Its parts: nvml_core (the module and the one wrapper that calls it), nvml_read (inventory and
    telemetry), nvml_mig (MIG changes), nvml_events (XIDs and lost GPUs)."""


def open_backend(sim_spec: str | None) -> NvmlBackend:
    """The simulator for a `--sim` spec, otherwise the real driver through pynvml."""
    if sim_spec:
        from gpusched.gpu.simnvml import SimNVML

        try:
            return NvmlBackend(SimNVML.from_spec(sim_spec))
        except ValueError as err:
            raise GpuInvalidArgumentError(str(err), hint="e.g. --sim H100-80GB:2 or --sim A100-40GB:2,H200:2") from None
    import pynvml

    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as err:
        raise GpuError(f"cannot load NVML: {type(err).__name__.removeprefix('NVMLError_')}", hint=SIM_HINT) from err
    except pynvml.NVMLError as err:
        raise GpuError(f"nvmlInit failed: {type(err).__name__.removeprefix('NVMLError_')}", hint=SIM_HINT) from err
    backend = NvmlBackend(pynvml, init=False)
    backend.backend_name = "pynvml"
    return backend
