"""Test hooks of the simulated amdsmi, not part of the library: processes, events, lost GPUs,
injected faults, privilege and activity. They address a logical GPU by (physical index, partition id)
because amdsmi gives every partition of a physical GPU the same UUID."""

from __future__ import annotations

from collections import deque

from gpusched.gpu.simamdsmi_api import STATUS_NAMES, AmdSmiEvtNotificationType
from gpusched.gpu.simamdsmi_state import SimAmdCore, _Event, _Physical, _Process


class HooksMixin(SimAmdCore):
    """Test hooks (see module docstring)."""

    def _phys(self, physical_index: int) -> _Physical:
        if not 0 <= physical_index < len(self._physicals):
            raise ValueError(f"no simulated GPU {physical_index}")
        return self._physicals[physical_index]

    def mode(self, physical_index: int) -> tuple[str, str]:
        """The (compute, memory) mode a physical GPU is in now."""
        with self._lock:
            phys = self._phys(physical_index)
            return phys.compute, phys.memory

    def add_process(self, physical_index: int, partition_id: int, pid: int, vram_bytes: int = 0,
                    name: str = "python3") -> None:
        """Pretend `pid` runs HIP work on one logical GPU (it must exist in the current mode and have room)."""
        with self._lock:
            phys = self._phys(physical_index)
            if not 0 <= partition_id < phys.count:
                raise ValueError(f"GPU {physical_index} has no partition {partition_id} in {phys.compute}")
            if pid in self._processes:
                raise ValueError(f"pid {pid} already uses a GPU")
            total = phys.model.memory_per_partition_mib(phys.compute, phys.memory) * 1024 * 1024
            used = sum(p.vram_bytes for p in self._processes.values()
                       if p.physical is phys and p.partition_id == partition_id)
            if used + vram_bytes > total:
                raise ValueError("out of memory on the simulated logical GPU")
            self._processes[pid] = _Process(pid, name, vram_bytes, phys, partition_id)

    def remove_process(self, pid: int) -> None:
        """The process exited."""
        with self._lock:
            self._processes.pop(pid, None)

    def inject_event(self, physical_index: int, partition_id: int, event: str, message: str = "") -> None:
        """Deliver an event (VMFAULT, THERMAL_THROTTLE, GPU_PRE_RESET, GPU_POST_RESET, RING_HANG) to
        readers registered for that logical GPU and type; unregistered ones never hear it, as in the
        kernel's per-device event file."""
        kind = AmdSmiEvtNotificationType[event]
        with self._lock:
            self._events.append(_Event(self._phys(physical_index), partition_id, int(kind), message))
            self._cond.notify_all()

    def lose_gpu(self, physical_index: int) -> None:
        """The GPU stops answering: every call on its devices fails (AMDSMI_STATUS_UNEXPECTED_SIZE)."""
        with self._lock:
            self._phys(physical_index).lost = True
            self._cond.notify_all()

    def fail_next(self, function: str, code: int, times: int = 1) -> None:
        """Make the next `times` calls of an amdsmi function fail with status `code`."""
        if not callable(getattr(type(self), function, None)):
            raise ValueError(f"simamdsmi has no function {function}")
        if code not in STATUS_NAMES:
            raise ValueError(f"unknown amdsmi status {code}")
        with self._lock:
            self._faults.setdefault(function, deque()).extend([code] * times)

    def set_privileged(self, privileged: bool) -> None:
        """Act as root (True) or an ordinary user (False): partition changes need root."""
        with self._lock:
            self._privileged = privileged

    def set_activity(self, physical_index: int, percent: int) -> None:
        """What amdsmi_get_gpu_activity reports as gfx_activity for every device of the GPU."""
        with self._lock:
            self._phys(physical_index).activity = percent
