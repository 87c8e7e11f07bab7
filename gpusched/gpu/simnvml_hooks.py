"""Test hooks, not part of pynvml: processes, XIDs, lost GPUs, resets, injected faults, holders of
MIG instances, privilege and utilization."""

from __future__ import annotations

from collections import deque

from gpusched.gpu.simnvml_mig import MigMixin
from gpusched.gpu.simnvml_state import (
    NO_ID,
    MiB,
    _Ci,
    _Gi,
    _Gpu,
    _Process,
)


class HooksMixin(MigMixin):
    """Test hooks, not part of pynvml: processes, XIDs, lost GPUs, resets, injected faults, holders of."""

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
                if es.masks.get(gpu_index, 0) & self._nv.nvmlEventTypeXidCriticalError:
                    es.queue.append(
                        (gpu, self._nv.nvmlEventTypeXidCriticalError, xid,
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
                self._fail(self._nv.NVML_ERROR_IN_USE)
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
