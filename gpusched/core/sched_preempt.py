"""Preemption and the interactive headroom: which victims to stop and how (core/preempt.py),
shares suspended in place and continued, checkpointed jobs pinned to their GPUs."""

from __future__ import annotations

import math
from collections.abc import Iterable

from gpusched.core.actions import (
    Action,
    PreemptJob,
    ResumeJob,
    Snapshot,
)
from gpusched.core.devices import _EPS
from gpusched.core.interactive import choose_headroom
from gpusched.core.placement import Cluster
from gpusched.core.preempt import Candidate, choose_victims
from gpusched.core.sched_scan import ScanMixin
from gpusched.model import (
    Allocation,
    Job,
    PartitionRequest,
    ShareRequest,
    WholeRequest,
)


class PreemptionMixin(ScanMixin):
    """Victims, suspend/resume in place, pins, headroom."""

    def pin(self, job_id: int, uuids: Iterable[str]) -> None:
        """A checkpointed job (submitted like a pending one) resumes only on these devices: they hold
        its state. For jobs checkpointed before a restart; a preemption in this scheduler pins itself."""
        self._pinned[job_id] = frozenset(uuids)

    def preempt_failed(self, job_id: int) -> None:
        """The engine could not carry out a checkpoint preemption: the job runs on where it was. It is
        not offered for checkpointing again (a requeue job may still be requeued)."""
        self._preempting.pop(job_id, None)
        self._pinned.pop(job_id, None)
        self._no_checkpoint.add(job_id)

    def _resume_yielded(self, cluster: Cluster, yielded: frozenset[int]) -> list[Action]:
        """Shares suspended in place continue once the job they yielded to is no longer waiting and
        their compute is free again, before anything new may take it (they hold their memory all
        along), oldest suspension first."""
        out: list[Action] = []
        # Compute freed for a job that has not started yet is that job's: nothing on its device
        # continues before it starts (another share stopped earlier would take it).
        awaited = {u for jid in yielded if (w := self._yielded_for.get(jid)) is not None
                   and self.queue.get(w) is not None for u in cluster.devices_of(jid)}
        for jid in sorted(yielded, key=lambda j: (self._preempting.get(j, 0.0), j)):
            self._preempting.pop(jid, None)  # carried out: the next preemption may be chosen
            if awaited.intersection(cluster.devices_of(jid)):
                continue
            if cluster.paused(jid) and cluster.unpause(jid):
                self._yielded_for.pop(jid, None)
                out.append(ResumeJob(jid, "its compute is free again: continues where it stopped"))
        return out

    def _waiting_interactive(self, now: float) -> Job | None:
        """The interactive job that has waited longest, if past `interactive_preempt_after_s`."""
        bound = self.config.interactive_preempt_after_s
        if bound is None or not self._interactive_pending:
            return None
        jid = min(self._interactive_pending, key=lambda j: (self._pending_since.get(j, now), j))
        if now - self._pending_since.get(jid, now) < bound:
            return None
        return self.queue.get(jid)

    def _resume_devices(self, alloc: Allocation, moves: bool) -> frozenset[str]:
        """Where a checkpointed job may resume: its own GPUs, or (when the driver can map devices on
        restore) any whole GPU of the same model."""
        if not moves:
            return frozenset(alloc.uuids)
        models = {g.model for g in self._gpus if g.uuid in alloc.uuids}
        return frozenset(g.uuid for g in self._gpus if g.model in models and not g.mig_enabled)

    def _preempt(self, cluster: Cluster, job: Job, now: float, reserved: frozenset[str],
                 checkpoint: bool, moves: bool = False) -> list[Action]:
        """Preempt batch jobs of users above share so a long-waiting job fits (core/preempt.py).

        For the fairness head (its freed devices go to it, not to a backfill job that would only be
        preempted again) or an interactive job waiting past its bound. Checkpointable whole-GPU
        jobs go first (nothing is lost), then `--requeue` jobs within their user's daily budget.
        """
        interactive = job.spec.job_class == "interactive"
        since = self._pending_since.get(job.id, job.submitted_at)
        waited = now - max(job.submitted_at, since)
        if interactive:
            bound = self.config.interactive_preempt_after_s
            if bound is None or waited < bound:
                return []
        else:
            bound = self.config.preempt_after_s
            if bound is None or waited < bound or self.fair.lag(job.user) <= 0:
                return []  # a batch job of a user at or above share waits its turn
        # A share suspended in place keeps its memory and its slot, so its device never becomes
        # idle: it can make room only for another share, never for a whole GPU or a MIG instance.
        suspend_helps = isinstance(job.spec.request, ShareRequest)
        margin = self.config.preempt_lag_margin_gpu_s
        above = min(self.fair.lag(job.user) - margin, -margin)  # a victim's owner's lag must be below this
        cap = self.config.preempt_max_per_job
        min_run = 0.0 if interactive else self.config.preempt_min_run_s
        suspend = self.config.preempt_suspend_shares
        held = cluster.held
        cands: list[Candidate] = []
        lags: dict[str, float] = {}  # per user, read once: nothing is charged during the search
        for jid, rec in self._active.items():
            # For the head, a victim must have run preempt_min_run_s whatever the mode, or a job
            # started in a pass is preempted in the same pass and the two swap places for ever.
            # An interactive job's victims stand on its headroom, where no batch job starts anew.
            if (rec.user == job.user or rec.started >= now or now - rec.started < min_run or jid not in held
                    or rec.job.spec.job_class == "interactive"):
                continue
            lag = lags.get(rec.user)
            if lag is None:
                lag = lags[rec.user] = self.fair.lag(rec.user)
            if lag >= above or (cap and self._times_preempted.get(jid, 0) >= cap):
                continue
            alloc = rec.alloc
            if suspend and alloc.share is not None and rec.running and any(
                    (d := cluster.devices.get(u)) is not None and d.shared for u in alloc.uuids):
                if suspend_helps:
                    cands.append(Candidate(jid, "suspend", (0, lag, -rec.started), 0.0))
            elif (checkpoint and rec.running and alloc.share is None and jid not in self._no_checkpoint
                  and all(d.kind == "gpu" for d in alloc.devices)):
                cands.append(Candidate(jid, "checkpoint", (0, lag, -rec.started), 0.0))
            elif rec.requeue:
                lost = rec.fraction * (now - rec.started)
                if self._budget.left(rec.user, now) >= lost:
                    cands.append(Candidate(jid, "requeue", (1, lag, -rec.started), lost))
        if not cands:
            return []
        # Whether any set of these victims makes room depends only on what is held, the waiting job
        # and who may be stopped how: a search that found none is not repeated until one changes.
        memo_key = (cluster.fingerprint(), job.id, reserved, tuple(sorted((c.job_id, c.mode) for c in cands)))
        if self._no_victims == memo_key:
            return []
        if self._hopeless(cluster, job, cands, reserved):
            self._no_victims = memo_key
            return []
        if not interactive:  # (read after the cheaper reasons not to preempt: it costs the most)
            res = self._head_reservation()
            if res is None or res.at - now <= self.config.preempt_min_gain_s:
                return []  # running jobs will make room soon enough without losing work
        victims = choose_victims(cluster, cands, lambda sim: self._place(sim, job, reserved) is not None)
        if not victims:
            self._no_victims = memo_key
            return []
        out: list[Action] = []
        for cand in victims:
            rec = self._active[cand.job_id]
            self._preempting[cand.job_id] = now
            self._times_preempted[cand.job_id] = self._times_preempted.get(cand.job_id, 0) + 1
            if cand.mode == "checkpoint":
                self._pinned[cand.job_id] = self._resume_devices(rec.alloc, moves)
            elif cand.mode == "requeue":
                self._budget.spend(rec.user, now, cand.lost_gpu_s)
            else:
                self._yielded_for[cand.job_id] = job.id
            how = {"checkpoint": "checkpointed", "suspend": "suspended in place, keeps its GPU memory"}.get(
                cand.mode, f"requeued, {cand.lost_gpu_s:.0f} GPU-s lost")
            out.append(PreemptJob(cand.job_id, (
                f"preempted ({how}) for job {job.id} ({job.user}, {job.spec.job_class}, waiting "
                f"{waited:.0f} s); {rec.user} is {-self.fair.lag(rec.user) / 3600:.2f} GPU-h above share"),
                cand.mode))
        return out

    def _hopeless(self, cluster: Cluster, job: Job, cands: list[Candidate], reserved: frozenset[str]) -> bool:
        """Would the job find no room even with every candidate stopped? Read off the devices: a
        whole-GPU or MIG request needs an idle device, and one is idle once everything on it is
        released (a share suspended in place stays on its device); a share needs a device whose
        remaining clients leave it the compute, memory and slot (`_share_hopeless`).

        choose_victims answers the same by releasing the candidates on a copy and placing, which
        copies every device they hold: most searches find nothing, pass after pass."""
        req = job.spec.request
        released = {c.job_id for c in cands if c.mode != "suspend"}
        forbidden = self._forbidden(cluster, job, reserved)
        if isinstance(req, ShareRequest):
            paused = {c.job_id for c in cands if c.mode == "suspend"}
            return self._share_hopeless(cluster, job, req, released, paused, forbidden)
        found = 0
        need = req.gpus if isinstance(req, (WholeRequest, PartitionRequest)) else 1
        for d in cluster.devices.values():
            if d.uuid in forbidden:
                continue
            if isinstance(req, WholeRequest):
                if d.kind != "gpu":
                    continue
            elif isinstance(req, PartitionRequest):
                if d.kind != "gpu" or d.partition != req.mode:
                    continue
            elif d.kind != "mig" or d.profile != req.profile:
                continue
            if (d.holder is None or d.holder in released) and all(jid in released for jid in d.clients):
                found += 1
                if found >= need:
                    return False
        return True

    def _share_hopeless(self, cluster: Cluster, job: Job, req: ShareRequest, released: set[int], paused: set[int],
                        forbidden: frozenset[str]) -> bool:
        """`_hopeless` for a share: no device where, with `released` gone and `paused` stopped in
        place (their memory and slots stay), `_share_fits` would hold (the same sums, slots and MPS
        uid rule; what the picker only ranks by, precision and idle servers' owners, is left out)."""
        across = self.config.mps_across_users
        any_uid = across == "always" or (across == "interactive" and job.spec.job_class == "interactive")
        for d in cluster.devices.values():
            if not d.shared or d.uuid in forbidden or (d.holder is not None and d.holder not in released):
                continue
            fraction, mem, slots = 0.0, 0, 0
            uids: set[int] = set()
            for jid, client in d.clients.items():
                if jid in released:
                    continue
                slots += 1
                mem += client.mem
                uids.add(client.uid)
                if jid not in paused:
                    fraction += client.fraction
            if (fraction + req.fraction <= 1 + _EPS and mem + req.gpu_mem_mib <= d.memory_mib
                    and slots < d.max_clients
                    and (any_uid or d.mode != "mps" or not uids or uids == {job.uid})):
                return False
        return True

    def _plan_headroom(self, cluster: Cluster, snapshot: Snapshot, now: float) -> frozenset[str]:
        """Devices kept for interactive work this pass (core/interactive.py)."""
        running = sum((rec.fraction for rec in self._active.values() if rec.job.spec.job_class == "interactive"), 0.0)
        self._demand.observe(now, running + sum(self._interactive_pending.values(), 0.0))
        cap = min(self.config.interactive_headroom_gpus,
                  math.floor(len(snapshot.gpus) * self.config.interactive_headroom_fraction + 1e-9))
        n = self._demand.devices_needed(now, cap)
        if n == 0:
            self._headroom = frozenset()
            return self._headroom
        interactive_on = frozenset(u for rec in self._active.values() if rec.job.spec.job_class == "interactive"
                                   for u in rec.alloc.uuids)
        ends: dict[str, float] = {}
        for jid, rec in self._active.items():
            if jid in cluster.held:
                end = self._expected_end(rec, now)
                for u in rec.alloc.uuids:
                    ends[u] = max(ends.get(u, 0.0), end)
        self._headroom = choose_headroom(cluster, n, interactive_on, ends, snapshot.reserved_interactive)
        return self._headroom
