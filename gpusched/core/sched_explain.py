"""What the scheduler can say about the future and the present: expected starts and ends, the
fairness order, and why a job waits (for `gpusched show` and `queue`)."""

from __future__ import annotations

import bisect
import math

from gpusched.core.sched_preempt import PreemptionMixin
from gpusched.model import describe_request


class ExplainMixin(PreemptionMixin):
    """Expected starts and ends, fairness order, explanations."""

    def expected_end(self, job_id: int) -> float | None:
        """When a running job is expected to end (never before k x its elapsed time); None if unknown."""
        rec = self._active.get(job_id)
        return self._expected_end(rec, self._last_now) if rec is not None else None

    def expected_start(self, job_id: int, max_ahead: int = 500) -> float | None:
        """When a pending job is expected to start if nothing new arrives: None if it cannot be told.

        Plays the queue forward from the last pass: running jobs end at their expected ends, pending
        jobs start in fairness order as soon as they fit (no backfill, so this errs late) and run
        for their estimates. Jobs that need a MIG change, or more than `max_ahead` jobs ahead of it,
        make the answer unknown rather than wrong.
        """
        if self._cluster is None or job_id not in self.queue:
            return None
        now = self._last_now
        order = self.queue.ordered_jobs(limit=max_ahead + 1)
        if job_id not in order:
            return None
        sim = self._cluster.copy()
        ends: list[tuple[float, int]] = sorted(
            (self._expected_end(rec, now), jid) for jid, rec in self._active.items() if jid in sim.held)
        t = now
        for jid in order:
            job = self.queue.get(jid)
            assert job is not None
            # batch jobs stay off the devices kept for interactive work, as in the pass
            alloc = self._place(sim, job, self._reserved)
            while alloc is None and ends:
                t = max(t, ends[0][0])
                sim.release(ends.pop(0)[1])
                alloc = self._place(sim, job, self._reserved)
            if alloc is None:
                return None
            if jid == job_id:
                return t
            sim.commit(job, alloc)
            bisect.insort(ends, (t + self.queue.expected_of(job), jid))
        return None

    def fairness_order(self) -> list[int]:
        """Pending job ids in the order they would be served (O(n log u); for `gpusched queue`)."""
        return self.queue.ordered_jobs()

    def explain(self, job_id: int) -> str:
        """Why a pending job is waiting, in words: what it needs, its owner's standing, its place."""
        if job_id in self._failed:
            return f"job {job_id} cannot run on this node: {self._failed[job_id]}"
        job = self.queue.get(job_id)
        if job is None:
            return f"job {job_id} is not pending"
        order = self.queue.ordered_jobs()
        ahead = order.index(job_id) if job_id in order else len(order)
        lag_h = self.fair.lag(job.user) / 3600
        if abs(lag_h) < 0.005:
            standing = f"{job.user} is at their share"
        elif lag_h < 0:
            standing = f"{job.user} is {-lag_h:.2f} GPU-h above their share"
        else:
            standing = f"{job.user} is {lag_h:.2f} GPU-h below their share"
        if not self.fair.is_eligible(job.user):
            standing += " (not eligible until others catch up)"
        parts = [f"job {job_id} ({describe_request(job.spec.request)}, {job.spec.job_class})"]
        blocked = self._blocked.get(job_id, "waiting behind the jobs ahead of it by fairness")
        if blocked is None:
            blocked = self._need(job, self._cluster) if self._cluster is not None else "no room for it yet"
        parts.append(str(blocked))
        parts.append(standing)
        parts.append(f"{ahead} job(s) ahead by fairness")
        res = self._head_reservation()
        if res is not None and res.job_id == job_id and math.isfinite(res.at):
            parts.append(f"expected to start in about {res.at - self._last_now:.0f} s")
        return "; ".join(parts)
