"""What the scheduler is shown (`Snapshot`) and what it decides (actions): the contract with the engine.

Kept apart from the policy so the engine, replay and the FIFO baseline share these types without
importing the fair-share scheduler. docs/scheduling.md, "Engine contract".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpusched.core.preempt import PreemptMode
from gpusched.gpu.backend import Gpu
from gpusched.model import ACTIVE_STATES, Allocation, Job


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the scheduler may look at. `pending` is in submission order.

    Added in v2 (all optional): `share_modes` device UUID -> exclusive|mps|timeslice (absent means
    exclusive); `dynamic` GPU indices whose MIG layout the scheduler may change; `mps_owner` device
    UUID -> uid of the MPS server running there now; `reserved_interactive` device UUIDs that only
    interactive jobs may be given; `checkpoint` whether preemption may checkpoint whole-GPU jobs;
    `yielded` jobs the scheduler suspended in place on a share device (SIGSTOP): they keep their GPU
    memory and MPS slot but use no compute until a ResumeJob.
    """

    gpus: tuple[Gpu, ...]
    pending: tuple[Job, ...]
    active: tuple[Job, ...]  # STARTING / RUNNING / SUSPENDED, each with an allocation
    unschedulable: frozenset[str] = field(default_factory=frozenset)  # GPU or instance UUIDs
    share_modes: Mapping[str, str] = field(default_factory=dict)
    dynamic: frozenset[int] = field(default_factory=frozenset)
    mps_owner: Mapping[str, int] = field(default_factory=dict)
    reserved_interactive: frozenset[str] = field(default_factory=frozenset)
    checkpoint: bool = False  # whole-GPU jobs can be preempted with cuda-checkpoint (the engine can do it)
    checkpoint_moves: bool = False  # a checkpointed job may resume on another GPU of its model (r580+ device map)
    yielded: frozenset[int] = field(default_factory=frozenset)  # shares suspended in place by a PreemptJob


@dataclass(frozen=True, slots=True)
class StartJob:
    job_id: int
    allocation: Allocation
    reason: str
    expected_s: float | None = None  # the run-time estimate it was scheduled with (None: the policy has none)


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
    mode: PreemptMode = "requeue"  # checkpoint: the job keeps its work and resumes on the same devices


@dataclass(frozen=True, slots=True)
class SetMigMode:
    """Switch an idle dynamic GPU's MIG mode (its instances, all idle, are destroyed first)."""

    gpu_index: int
    enabled: bool
    reason: str


@dataclass(frozen=True, slots=True)
class SetPartitionMode:
    """Change an idle AMD physical GPU's compute/memory partition mode (core/partplan.py): its logical
    GPUs disappear and new ones, with new UUIDs, take their place."""

    physical_index: int
    compute: str  # SPX, DPX, QPX, CPX
    memory: str  # NPS1, NPS4
    reason: str


@dataclass(frozen=True, slots=True)
class ResumeJob:
    """Continue a share the scheduler suspended in place (its compute is free again)."""

    job_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class FailJob:
    job_id: int
    reason: str


Action = (StartJob | CreateInstance | DestroyInstance | SetMigMode | SetPartitionMode | PreemptJob | ResumeJob
          | FailJob)


def busy_uuids(active: Iterable[Job]) -> set[str]:
    """Device UUIDs held by jobs that are starting, running or suspended."""
    busy: set[str] = set()
    for job in active:
        if job.state in ACTIVE_STATES and job.allocation is not None:
            busy.update(job.allocation.uuids)
    return busy
