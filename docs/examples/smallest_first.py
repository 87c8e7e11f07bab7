"""An example plug-in policy (docs/policies.md): smallest job first on whole GPUs, with an age limit.

Pending jobs go in order of the GPU-seconds they ask for (GPUs x --time; a job without --time
counts as `default_time_s`), smallest first, each on whole free GPUs; a job that does not fit is
skipped, so small jobs fill the holes. So that big jobs cannot starve, one that has waited
`max_wait_s` goes first, and nothing overtakes it until it starts. It implements plan() only,
holds no state, and subclasses nothing: gpuschedd and `gpusched replay` drive it as they drive
the built-in policies (gpusched/policy.py).
"""

from __future__ import annotations

from gpusched.core.actions import Action, FailJob, Snapshot, StartJob, busy_uuids
from gpusched.model import AllocatedDevice, Allocation, Job, JobState, WholeRequest, pending_since
from gpusched.policy import PolicyContext


class SmallestFirst:
    """`[scheduler] policy = "smallest_first:SmallestFirst"` (the module on the daemon's Python path)."""

    name = "smallest-first"  # what replay's table and the daemon's log call it

    def __init__(self, context: PolicyContext) -> None:
        self.default_time_s = float(context.options.get("default_time_s", 3600.0))
        self.max_wait_s = float(context.options.get("max_wait_s", 4 * 3600.0))

    def plan(self, snapshot: Snapshot, now: float) -> list[Action]:
        busy = busy_uuids(snapshot.active) | snapshot.unschedulable
        whole = [g for g in snapshot.gpus if not g.mig_enabled]
        free = [g for g in whole if g.uuid not in busy]
        actions: list[Action] = []
        for job in sorted(snapshot.pending, key=lambda j: self._order(j, now)):
            request = job.spec.request
            if job.state is not JobState.PENDING:
                continue
            if not isinstance(request, WholeRequest) or request.gpus > len(whole):
                actions.append(FailJob(job.id, f"smallest-first serves whole GPUs only, at most {len(whole)}"))
                continue
            if request.gpus > len(free):
                if now - pending_since(job) >= self.max_wait_s:
                    break  # it has waited long enough: nobody overtakes it
                continue
            chosen, free = free[: request.gpus], free[request.gpus:]
            devices = [AllocatedDevice(uuid=g.uuid, gpu_index=g.index, kind="gpu") for g in chosen]
            actions.append(StartJob(job.id, Allocation(devices=devices, compute_fraction=float(request.gpus)),
                                    "smallest job first"))
        return actions

    def _order(self, job: Job, now: float) -> tuple[bool, float, int]:
        """Jobs past max_wait_s first (oldest first), then by GPU-seconds asked, then by id."""
        if now - pending_since(job) >= self.max_wait_s:
            return (False, pending_since(job), job.id)
        gpus = job.spec.request.gpus if isinstance(job.spec.request, WholeRequest) else 1
        return (True, gpus * (job.spec.time_limit_s or self.default_time_s), job.id)
