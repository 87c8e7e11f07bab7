"""The only place scheduling decisions are made: `Scheduler.plan(snapshot, now) -> [Action]`.

Pure: the snapshot carries everything (GPUs, jobs, what is drained), `now` is passed in, and the
result is a list of actions for the engine to carry out. v1 is first come, first served over whole
devices (whole GPUs and MIG instances that already exist); the fair-share policy replaces the
policy, not this shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpusched.gpu.backend import Gpu
from gpusched.model import (
    ACTIVE_STATES,
    AllocatedDevice,
    Allocation,
    Job,
    JobState,
    MigRequest,
    ShareRequest,
    WholeRequest,
)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the scheduler may look at. `pending` is in submission order."""

    gpus: tuple[Gpu, ...]
    pending: tuple[Job, ...]
    active: tuple[Job, ...]  # STARTING / RUNNING / SUSPENDED, each with an allocation
    unschedulable: frozenset[str] = field(default_factory=frozenset)  # GPU or instance UUIDs


@dataclass(frozen=True, slots=True)
class StartJob:
    job_id: int
    allocation: Allocation
    reason: str


@dataclass(frozen=True, slots=True)
class CreateInstance:
    gpu_index: int
    profile: str
    start: int
    reason: str


@dataclass(frozen=True, slots=True)
class DestroyInstance:
    uuid: str
    reason: str


@dataclass(frozen=True, slots=True)
class PreemptJob:
    job_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class FailJob:
    job_id: int
    reason: str


Action = StartJob | CreateInstance | DestroyInstance | PreemptJob | FailJob


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


def busy_uuids(active: Iterable[Job]) -> set[str]:
    """Device UUIDs held by jobs that are starting, running or suspended."""
    busy: set[str] = set()
    for job in active:
        if job.state in ACTIVE_STATES and job.allocation is not None:
            busy.update(job.allocation.uuids)
    return busy


def unsatisfiable_reason(request: WholeRequest | MigRequest | ShareRequest, gpus: Sequence[Gpu]) -> str | None:
    """Why this node can never run the request, in words that say what the node has; None if it can."""
    whole = [g for g in gpus if not g.mig_enabled]
    if isinstance(request, WholeRequest):
        if request.gpus > len(whole):
            mig_note = f" ({len(gpus) - len(whole)} more are in MIG mode)" if len(whole) < len(gpus) else ""
            return (
                f"asks for {request.gpus} whole GPU(s) but this node has {len(whole)} GPU(s) "
                f"with MIG off{mig_note}"
            )
        return None
    if isinstance(request, MigRequest):
        offered = sorted({i.profile for g in gpus for i in g.instances})
        if request.profile not in offered:
            have = ", ".join(offered) if offered else "none"
            return f"asks for MIG profile {request.profile} but this node's MIG instances are: {have}"
        return None
    return "asks for a GPU share but no device on this node is configured for sharing (mps or timeslice)"


class Scheduler:
    """First come, first served over whole devices. Stateless between passes."""

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
            chosen = _pick(job, free)
            if chosen is None:
                break  # strict FCFS: nobody overtakes the head of the queue
            for device in chosen:
                free.remove(device)
            actions.append(StartJob(job.id, _allocation(chosen), "first come, first served"))
        return actions


def _pick(job: Job, free: list[_Device]) -> list[_Device] | None:
    request = job.spec.request
    if isinstance(request, WholeRequest):
        gpus = [d for d in free if d.kind == "gpu"]
        return gpus[: request.gpus] if len(gpus) >= request.gpus else None
    if isinstance(request, MigRequest):
        for device in free:
            if device.kind == "mig" and device.profile == request.profile:
                return [device]
    return None


def _allocation(devices: list[_Device]) -> Allocation:
    return Allocation(
        devices=[AllocatedDevice(uuid=d.uuid, gpu_index=d.gpu_index, kind=d.kind, profile=d.profile)  # type: ignore[arg-type]
                 for d in devices],
        compute_fraction=sum(d.compute_fraction for d in devices),
    )
