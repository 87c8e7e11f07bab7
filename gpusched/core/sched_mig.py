"""Dynamic MIG from demand: which idle instances go and which are created (core/migplan.py), the
instances a blocked MIG head claims, and MIG mode switched on idle dynamic GPUs; and, on AMD, the
partition modes of idle physical GPUs changed for `--partition` demand (core/partplan.py)."""

from __future__ import annotations

import math

from gpusched.core.actions import (
    Action,
    CreateInstance,
    DestroyInstance,
    SetMigMode,
    Snapshot,
    busy_uuids,
)
from gpusched.core.migplan import MigPolicy, plan_dynamic
from gpusched.core.partplan import (
    HeadNeed,
    claim_for_head,
    logical_in_mode,
    physical_gpus,
    plan_partitions,
    track_idle,
)
from gpusched.core.placement import Cluster
from gpusched.core.sched_sync import SyncMixin
from gpusched.gpu.backend import Gpu
from gpusched.model import (
    Job,
    MigRequest,
    PartitionRequest,
    WholeRequest,
)


class MigMixin(SyncMixin):
    """Instance plans, claims and MIG mode."""

    def _mig_claim(self, snapshot: Snapshot, job: Job) -> frozenset[str]:
        """Instances a MIG head needs destroyed on a dynamic GPU; backfill must leave them idle.

        Asks the planner where the head's profile would go if every instance could be destroyed
        (fewest slices lost); the instances in the way are claimed, so they go idle, outlive the
        hysteresis timer and are replaced, instead of being refilled by smaller jobs forever.
        """
        req = job.spec.request
        if not isinstance(req, MigRequest) or not snapshot.dynamic:
            return frozenset()
        gpus = [g for g in snapshot.gpus if g.index in snapshot.dynamic and g.mig_enabled]
        everyone = {i.uuid: float("-inf") for g in gpus for i in g.instances}
        relaxed = plan_dynamic(gpus, frozenset(), [req.profile], idle_since=everyone, now=0.0,
                               policy=MigPolicy(0.0, 0.0), unschedulable=snapshot.unschedulable)
        return frozenset(d.uuid for d in relaxed.destroys)

    def _plan_mig(self, snapshot: Snapshot, cluster: Cluster, demand: list[str], doomed: frozenset[str],
                  now: float) -> list[Action]:
        if not demand or not snapshot.dynamic:
            return []
        gpus = [g for g in snapshot.gpus if g.index in snapshot.dynamic and g.mig_enabled]
        busy = {u for u, d in cluster.devices.items() if not d.idle} | busy_uuids(snapshot.active)
        pending_profiles = {j.spec.request.profile for jid in self._blocked
                            if (j := self.queue.get(jid)) is not None and isinstance(j.spec.request, MigRequest)}
        mplan = plan_dynamic(gpus, busy, demand, pending_profiles=pending_profiles, claimed=doomed,
                             idle_since=self._idle_since,
                             last_reconfig=self._last_reconfig, now=now, policy=self.config.mig,
                             unschedulable=snapshot.unschedulable)
        for g in mplan.gpus_changed:
            self._last_reconfig[g] = now
        out: list[Action] = [DestroyInstance(d.uuid, d.reason) for d in mplan.destroys]
        out += [CreateInstance(c.gpu_index, c.profile, c.start, c.reason) for c in mplan.creates]
        return out

    def _plan_mig_mode(self, snapshot: Snapshot, cluster: Cluster, head: Job | None, mig_demand: list[str],
                       mig_actions: list[Action], now: float) -> list[Action]:
        """Switch idle dynamic GPUs out of MIG mode when the blocked fairness head needs whole GPUs
        that only they can give, and into it when MIG work finds no dynamic GPU to go on.

        Only a GPU idle for `min_idle_s` and not reconfigured for `min_reconfig_interval_s` is
        switched (the same damping as instances), and only when the switch completes what is needed:
        the 8-GPU pod gets its 8 GPUs, not a GPU that would idle until the others free up.
        """
        policy = self.config.mig
        if not policy.toggle_mode or not snapshot.dynamic:
            return []

        touched = {a.gpu_index for a in mig_actions if isinstance(a, CreateInstance)} | {
            g.index for g in snapshot.gpus for a in mig_actions if isinstance(a, DestroyInstance)
            for i in g.instances if i.uuid == a.uuid}

        def switchable(gpu: Gpu) -> bool:
            idle = self._gpu_idle_since.get(gpu.index)
            return (gpu.index in snapshot.dynamic and gpu.index not in touched
                    and gpu.uuid not in snapshot.unschedulable and idle is not None
                    and now - idle >= policy.min_idle_s
                    and now - self._last_reconfig.get(gpu.index, -math.inf) >= policy.min_reconfig_interval_s)

        usable = [g for g in snapshot.gpus if g.uuid not in snapshot.unschedulable]
        req = head.spec.request if head is not None else None
        if isinstance(req, WholeRequest):
            whole = sum(1 for g in usable if not g.mig_enabled)
            if whole >= req.gpus:
                return []
            cands = [g for g in usable if g.mig_enabled and switchable(g)]
            if whole + len(cands) < req.gpus:
                return []  # switching would not make the head fit: keep the MIG capacity
            out: list[Action] = []
            for gpu in cands[: req.gpus - whole]:
                self._last_reconfig[gpu.index] = now
                out += [DestroyInstance(i.uuid, f"GPU {gpu.index} leaves MIG mode") for i in gpu.instances]
                out.append(SetMigMode(gpu.index, False, f"job {head.id if head else '?'} needs {req.gpus} whole "
                                      f"GPU(s); GPU {gpu.index} has been idle in MIG mode"))
            return out
        if mig_demand and not mig_actions:  # the dynamic GPUs in MIG mode could not make room for it
            cands = [g for g in usable if not g.mig_enabled and switchable(g)
                     and (d := cluster.devices.get(g.uuid)) is not None and d.idle]
            if cands:
                gpu = cands[0]
                self._last_reconfig[gpu.index] = now
                return [SetMigMode(gpu.index, True, f"MIG work waits ({', '.join(sorted(set(mig_demand)))}) and no "
                                   f"dynamic GPU in MIG mode has room; GPU {gpu.index} has been idle")]
        return []

    def _partition_claim(self, snapshot: Snapshot, job: Job) -> frozenset[str]:
        """Logical GPUs a blocked `--partition` head needs changed to its mode; backfill must leave
        them to go idle (core/partplan.py `claim_for_head`)."""
        req = job.spec.request
        if not isinstance(req, PartitionRequest):
            return frozenset()
        phys = physical_gpus(snapshot.gpus)
        if not phys:
            return frozenset()
        return claim_for_head(phys, req.mode, req.gpus, blocked=self._partition_pins(snapshot))

    @staticmethod
    def _partition_pins(snapshot: Snapshot) -> set[str]:
        """Logical GPUs that pin every GPU before them besides busy ones: drained, or named by a
        `[gpus.N]` setting (share mode, kept for interactive work) whose index a change would move.
        The interactive headroom is not one: it is replanned every pass and moves with the GPUs."""
        return set(snapshot.unschedulable) | set(snapshot.reserved_interactive) | {
            u for u, mode in snapshot.share_modes.items() if mode != "exclusive"}

    def _plan_partitions(self, snapshot: Snapshot, cluster: Cluster, head: Job | None, reserved: frozenset[str],
                         now: float) -> list[Action]:
        """Change idle AMD physical GPUs to the compute mode pending `--partition` jobs find no idle
        logical GPU of (core/partplan.py), with the `[mig]` damping.

        Nothing changes while the blocked fairness head is another kind of job: its reservation may
        count on today's idle logical GPUs, and a mode change renumbers them. Nothing changes either
        while a running job holds a device the inventory no longer lists: it cannot be told which
        GPUs a change would renumber under it. The queue keeps the pending demand per mode, so a
        pass pays for the GPUs, not the queue (and on NVIDIA, which has no partition, the first
        test returns).
        """
        phys = physical_gpus(snapshot.gpus)
        if not phys:
            return []
        running = busy_uuids(snapshot.active)
        busy = {u for u, d in cluster.devices.items() if not d.idle} | running
        track_idle(phys, busy, self._part_idle_since, now)
        head_req = head.spec.request if head is not None else None
        if head_req is not None and not isinstance(head_req, PartitionRequest):
            return []
        pending = self.queue.partition_demand()
        if not pending or not running <= {g.uuid for g in snapshot.gpus}:
            return []
        idle: dict[str, int] = {}
        for d in cluster.devices.values():
            if d.partition is not None and d.idle and d.uuid not in reserved:
                idle[d.partition] = idle.get(d.partition, 0) + 1
        wanted = {m: n - idle.get(m, 0) for m, n in pending.items() if n > idle.get(m, 0)}
        need: HeadNeed | None = None
        pins = self._partition_pins(snapshot)
        if isinstance(head_req, PartitionRequest):
            need = HeadNeed(head_req.mode, logical_in_mode(phys, head_req.mode, pins) < head_req.gpus)
        order = sorted(wanted, key=lambda m: (need is None or need.mode != m, -wanted[m], m))
        changes = plan_partitions(phys, wanted, order, busy=busy, blocked=pins, idle_since=self._part_idle_since,
                                  last_reconfig=self._part_last_reconfig, now=now, policy=self.config.mig,
                                  head=need, whole_needed=self.queue.largest_whole())
        for c in changes:
            self._part_last_reconfig[c.physical_index] = now
        return list(changes)
