"""Keeping the scheduler's view current: charging running jobs (start commitments, settlement at
the end) and the idle timers of MIG instances and dynamic GPUs."""

from __future__ import annotations

from collections.abc import Iterable

from gpusched.core.actions import (
    Snapshot,
    busy_uuids,
)
from gpusched.core.cluster_sync import sync
from gpusched.core.placement import Cluster
from gpusched.core.sched_core import (
    _Active,
)
from gpusched.core.sched_reserve import ReservationMixin
from gpusched.model import (
    ACTIVE_STATES,
    Job,
    JobState,
)


class SyncMixin(ReservationMixin):
    """Charging, idle timers, and the placement view."""

    def _cluster_for(self, snapshot: Snapshot) -> Cluster:
        """The pass's placement view: the last pass's Cluster brought up to the snapshot when the
        devices are the same (cluster_sync.py), else a fresh build."""
        shape = (snapshot.share_modes, snapshot.unschedulable, snapshot.mps_owner)
        live = self._live
        if (live is not None and self._live_gpus is snapshot.gpus and self._live_shape == shape
                and sync(live, snapshot.active, snapshot.yielded)):
            return live
        cluster = Cluster.build(snapshot.gpus, snapshot.active, share_modes=snapshot.share_modes,
                                unschedulable=snapshot.unschedulable, mps_owner=snapshot.mps_owner,
                                yielded=snapshot.yielded)
        self._live = cluster
        self._live_gpus = snapshot.gpus
        # copies: the engine may change a mapping in place between passes
        self._live_shape = (dict(snapshot.share_modes), snapshot.unschedulable, dict(snapshot.mps_owner))
        return cluster

    def _sync_active(self, active: Iterable[Job], now: float) -> None:
        """Charge every active job for the time since its last charge; settle jobs that ended."""
        seen: set[int] = set()
        touched: set[str] = set()
        # A job this scheduler did not start is charged from when the saved standing stopped charging
        # it (a restart: the downtime counts), else from this scheduler's first pass.
        first = (self._charged_until if self._charged_until is not None
                 else self._started_at_first_plan if self._started_at_first_plan is not None else now)
        for job in active:
            if job.state not in ACTIVE_STATES or job.allocation is None:
                continue
            seen.add(job.id)
            rec = self._active.get(job.id)
            running = job.state is not JobState.SUSPENDED
            if rec is None:  # started before this scheduler existed (restart) or outside it
                started = job.started_at if job.started_at is not None else now
                rec = _Active(job.user, job.uid, job.allocation.compute_fraction, max(started, first),
                              running, job.spec.requeue, started, job, job.allocation, self.estimator.predict(job))
                self._active[job.id] = rec
                self._count_running(rec, +1)
                touched.add(job.user)
            if now > rec.last_charge:
                if rec.running and self._accrue(rec, rec.fraction * (now - rec.last_charge)):
                    touched.add(rec.user)  # v moved: the user's deadline did (within a commitment it does not)
                rec.last_charge = now
            if running != rec.running:
                rec.running = running
                touched.add(rec.user)
        for jid in [j for j in self._active if j not in seen]:
            rec = self._active.pop(jid)
            if rec.running and now > rec.last_charge:
                self._accrue(rec, rec.fraction * (now - rec.last_charge))
            if rec.committed > rec.used:  # settle: refund what was committed and not used
                self.fair.charge(rec.user, 0.0, virtual_gpu_s=rec.used - rec.committed)
                self._outstanding(rec.user, rec.used - rec.committed)
            self._count_running(rec, -1)
            self._no_checkpoint.discard(jid)
            self._yielded_for.pop(jid, None)
            if self._preempting.pop(jid, None) is None:
                self._times_preempted.pop(jid, None)  # ended for good
            touched.add(rec.user)
        for user in sorted(touched):  # sorted: replay must not depend on PYTHONHASHSEED
            self._sync_user(user)
        self._charged_until = None  # it was for the jobs found running at the first pass, adopted now

    def _track_idle(self, snapshot: Snapshot, now: float) -> None:
        """Remember since when each MIG instance has been idle (hysteresis for destroying it)."""
        if not snapshot.dynamic and not self._idle_since and not any(g.instances for g in snapshot.gpus):
            return  # no instances and no dynamic GPUs: nothing to time (skips collecting busy devices)
        busy = busy_uuids(snapshot.active)
        present: set[str] = set()
        for gpu in snapshot.gpus:
            for inst in gpu.instances:
                present.add(inst.uuid)
                if inst.uuid in busy:
                    self._idle_since.pop(inst.uuid, None)
                else:
                    self._idle_since.setdefault(inst.uuid, now)
        if len(self._idle_since) > len(present):
            self._idle_since = {u: t for u, t in self._idle_since.items() if u in present}
        for gpu in snapshot.gpus:
            if gpu.index not in snapshot.dynamic:
                continue
            if gpu.uuid in busy or any(i.uuid in busy for i in gpu.instances):
                self._gpu_idle_since.pop(gpu.index, None)
            else:
                self._gpu_idle_since.setdefault(gpu.index, now)
