"""A stateful, in-process stand-in for the `pynvml` module (a fake, not a mock).

`SimNVML` exposes pynvml's function names, signatures, ctypes structs, constants and exception
classes, and keeps real state (GPUs, MIG GPU/compute instances, processes, event sets), enforcing the
driver's rules (nvml.h doc comments, pynvml, published nvidia-smi transcripts; see docs/gpu.md and
docs/hardware-notes.md). `gpu/nvml.py` therefore runs the very same code path
against this object as against the real driver. Handles are genuine ctypes pointers (the types pynvml
returns), so callers cannot tell them apart; destroyed objects leave stale handles that raise.

What it does not model is listed in docs/gpu.md (engine counts beyond the info structs, GPM,
vGPU, ECC counters, clocks/power, driver persistence).

`SimNVML` is composed by responsibility: simnvml_state (records, constants, the `_api` wrapper,
`SimCore`: state, handles, passthrough), simnvml_device (init, device queries, processes),
simnvml_mig (MIG mode, GPU-instance profiles and instances), simnvml_ci (compute instances, MIG
device handles), simnvml_events (event sets) and simnvml_hooks (test hooks).
"""

from __future__ import annotations

import pynvml

from gpusched.gpu.profiles import MEMORY_SLICES
from gpusched.gpu.simnvml_ci import ComputeMixin
from gpusched.gpu.simnvml_device import DeviceMixin
from gpusched.gpu.simnvml_events import EventsMixin
from gpusched.gpu.simnvml_hooks import HooksMixin
from gpusched.gpu.simnvml_state import DEFAULT_DRIVER_VERSION, NO_ID, MiB  # re-exported: imported from here


class SimNVML(ComputeMixin, HooksMixin, DeviceMixin, EventsMixin):
    """Simulated NVML with pynvml's API. Build with `SimNVML.from_spec("H100-80GB:2")`.

    Test hooks (not part of pynvml): add_process, remove_process, inject_xid, lose_gpu, reset_gpu,
    fail_next, set_utilization, hold_instance, release_instance. Every call holds one lock, so a
    thread blocked in nvmlEventSetWait never stops the rest of the API.
    """

    backend_name = "simnvml"
    _nv = pynvml  # the simulator's one import of the vendor module; its parts reach it as self._nv


__all__ = ["DEFAULT_DRIVER_VERSION", "MEMORY_SLICES", "NO_ID", "MiB", "SimNVML"]
