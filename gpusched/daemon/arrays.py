"""Job arrays in the daemon: what each task is told about its array, and `%MAX`.

An array's tasks are ordinary jobs (their own ids, histories, logs); this module only knows which
array each belongs to. `%MAX` is enforced here, not in core/: a task of a capped array reaches the
scheduler only while fewer than MAX of its array's tasks are *admitted* (queued in the scheduler,
starting, running or suspended), lowest task first, so the policy never sees more than MAX of them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from gpusched.arrayspec import parse_array_spec
from gpusched.daemon.schema import task_bytes
from gpusched.model import Job


@dataclass(slots=True)
class ArrayInfo:
    """One array with unfinished tasks: its shape (for the environment) and its %MAX bookkeeping."""

    id: int
    text: str
    count: int
    first: int
    last: int
    step: int | None  # the spacing of its indices when they are evenly spaced
    max_running: int | None
    bytes_per_task: int  # the shared spec's bytes, split between its tasks (max_pending_bytes_per_user)
    live: int = 0  # tasks not yet ended; the array is forgotten with its last one
    admitted: set[int] = field(default_factory=set)  # job ids let through to the scheduler
    waiting: set[int] = field(default_factory=set)  # job ids held back by %MAX
    queue: list[int] = field(default_factory=list)  # heap of the held-back ids (lazily pruned)


class Arrays:
    """The engine's view of its job arrays."""

    def __init__(self) -> None:
        self.by_id: dict[int, ArrayInfo] = {}

    def add(self, array_id: int, text: str, example: Job, live: int) -> ArrayInfo:
        """Register an array with `live` unfinished tasks (at submission, or when the engine loads it)."""
        spec = parse_array_spec(text, max_tasks=2**62)  # it was accepted once: no limit applies now
        tasks = spec.tasks
        gaps = {b - a for a, b in itertools.pairwise(tasks)}
        info = ArrayInfo(id=array_id, text=spec.text, count=len(tasks), first=tasks[0], last=tasks[-1],
                         step=gaps.pop() if len(gaps) == 1 else (1 if len(tasks) == 1 else None),
                         max_running=spec.max_running,
                         bytes_per_task=task_bytes(example.spec, len(tasks)), live=live)
        self.by_id[array_id] = info
        return info

    def env(self, job: Job) -> dict[str, str]:
        """What a task learns about its array, as Slurm's SLURM_ARRAY_* variables."""
        info = self.by_id.get(job.array_id) if job.array_id is not None else None
        if info is None or job.array_task is None:
            return {}
        env = {
            "GPUSCHED_ARRAY_JOB_ID": str(info.id),
            "GPUSCHED_ARRAY_TASK_ID": str(job.array_task),
            "GPUSCHED_ARRAY_TASK_MIN": str(info.first),
            "GPUSCHED_ARRAY_TASK_MAX": str(info.last),
            "GPUSCHED_ARRAY_TASK_COUNT": str(info.count),
        }
        if info.step is not None:
            env["GPUSCHED_ARRAY_TASK_STEP"] = str(info.step)
        return env

    def held_bytes(self, job: Job) -> int | None:
        """A task's share of its array's spec bytes; None for a job that is not a task."""
        info = self.by_id.get(job.array_id) if job.array_id is not None else None
        return None if info is None else info.bytes_per_task

    def mark_active(self, job: Job) -> None:
        """A task found starting or running at start-up holds one of its array's %MAX places."""
        info = self._capped(job)
        if info is not None:
            info.admitted.add(job.id)

    def admit(self, job: Job) -> bool:
        """May this PENDING task go to the scheduler now? If not, it waits for a place (lowest id first)."""
        info = self._capped(job)
        if info is None or job.id in info.admitted:
            return True
        assert info.max_running is not None
        if len(info.admitted) < info.max_running:
            info.waiting.discard(job.id)
            info.admitted.add(job.id)
            return True
        if job.id not in info.waiting:
            info.waiting.add(job.id)
            heapq.heappush(info.queue, job.id)
        return False

    def is_admitted(self, job: Job) -> bool:
        info = self._capped(job)
        return info is None or job.id in info.admitted

    def leave(self, job: Job, ended: bool) -> list[int]:
        """The task ended (`ended`) or was held: free its place; returns the held-back tasks that may go now."""
        if ended and job.array_id is not None and job.array_id in self.by_id:
            whole = self.by_id[job.array_id]
            whole.live -= 1
            if whole.live <= 0:
                del self.by_id[job.array_id]
                return []
        info = self._capped(job)
        if info is None:
            return []
        info.admitted.discard(job.id)
        info.waiting.discard(job.id)
        assert info.max_running is not None
        freed: list[int] = []
        while info.queue and len(info.admitted) + len(freed) < info.max_running:
            job_id = heapq.heappop(info.queue)
            if job_id in info.waiting:  # not cancelled or held meanwhile
                freed.append(job_id)
        return freed

    def _capped(self, job: Job) -> ArrayInfo | None:
        if job.array_id is None:
            return None
        info = self.by_id.get(job.array_id)
        return info if info is not None and info.max_running is not None else None
