"""v1 first come, first served over whole devices: the baseline replay compares against.

Stateless and strict: nobody overtakes the head of the queue. Shares are not served (the Kubernetes
device plugin hands out whole GPUs; replay rounds shares up before they get here).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpusched.core.actions import Action, FailJob, Snapshot, StartJob, busy_uuids
from gpusched.core.placement import unsatisfiable_reason
from gpusched.gpu.backend import Gpu
from gpusched.model import AllocatedDevice, Allocation, Job, JobState, MigRequest, WholeRequest


def _pick_fifo(job: Job, free: list[_Device]) -> list[_Device] | None:
    request = job.spec.request
    if isinstance(request, WholeRequest):
        gpus = [d for d in free if d.kind == "gpu"]
        return gpus[: request.gpus] if len(gpus) >= request.gpus else None
    if isinstance(request, MigRequest):
        for device in free:
            if device.kind == "mig" and device.profile == request.profile:
                return [device]
    return None


@dataclass(frozen=True, slots=True)
class _Device:
    uuid: str
    gpu_index: int
    kind: str  # "gpu" | "mig"
    profile: str | None
    compute_fraction: float


def schedulable_devices(gpus: Iterable[Gpu], unschedulable: frozenset[str]) -> list[_Device]:
    """Every device a job could be given: whole GPUs with MIG off, and MIG instances."""
    devices: list[_Device] = []
    for gpu in gpus:
        if gpu.uuid in unschedulable:
            continue
        if not gpu.mig_enabled:
            devices.append(_Device(gpu.uuid, gpu.index, "gpu", None, 1.0))
            continue
        for inst in gpu.instances:
            if inst.uuid in unschedulable:
                continue
            fraction = inst.sm_count / gpu.sm_count if gpu.sm_count else 0.0
            devices.append(_Device(inst.uuid, gpu.index, "mig", inst.profile, fraction))
    return devices


class FifoScheduler:
    """v1: first come, first served over whole devices (no shares). Stateless; kept for replay baselines."""

    def plan(self, snapshot: Snapshot, now: float) -> list[Action]:
        actions: list[Action] = []
        busy = busy_uuids(snapshot.active)
        free = [d for d in schedulable_devices(snapshot.gpus, snapshot.unschedulable) if d.uuid not in busy]
        for job in snapshot.pending:
            if job.state is not JobState.PENDING:
                continue
            reason = unsatisfiable_reason(job.spec.request, snapshot.gpus)
            if reason is not None:
                actions.append(FailJob(job.id, f"unsatisfiable: {reason}"))
                continue
            chosen = _pick_fifo(job, free)
            if chosen is None:
                break  # strict FCFS: nobody overtakes the head of the queue
            for device in chosen:
                free.remove(device)
            actions.append(StartJob(job.id, _fifo_allocation(chosen), "first come, first served"))
        return actions


def _fifo_allocation(devices: list[_Device]) -> Allocation:
    return Allocation(
        devices=[AllocatedDevice(uuid=d.uuid, gpu_index=d.gpu_index, kind="gpu" if d.kind == "gpu" else "mig",
                                 profile=d.profile) for d in devices],
        compute_fraction=sum(d.compute_fraction for d in devices),
    )
